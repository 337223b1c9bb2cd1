"""Load-or-recompute: load a hit only where loading it is faster than recomputing it.

Measured, not configured. Three rates feed exponential moving averages:

* the engine's **prefill speed** (tokens/s): the workers time every forward pass that computes >= 16 tokens and
  report it with the step's output (``KVPrefetchWorkerMeta``);
* the **disk tier's read throughput** (bytes/s): a `TierMeter` watches the completion of every read this process
  submits (prefetches and demand reads) and measures bytes over the time the tier was busy, so queueing in front
  of the tier is not mistaken for a slow device, and a burst of parallel reads counts once;
* the **DRAM -> engine copy** throughput, reported by the workers.

Until a rate has been measured its prior is used (``disk_bps_prior``/``prefill_tps_prior``; with no prefill
prior, loads pay until the first forward has been timed: a fresh engine has nothing measured yet, and a load
from DRAM is far faster than any prefill). A rule that recomputes because the disk looks slow reads nothing, so
nothing would ever correct that estimate once the disk is fast again: the scheduler then reads a few of the
chunks it recomputes in the background, at most every ``disk_probe_interval_s``, to measure the disk again
(`SchedulerSide._probe_disk`).

Per request the plan (which leading chunks to load, which to recompute) is `kvprefetch.loadplan.plan` on these
rates: the rule the simulator applies too. An asynchronous load (a prefix reaching below DRAM, ``load_mode:
async``) costs the request at least ``async_s``, the expected duration of the step being scheduled
(`expected_step_s`: the last step's tokens at the measured speed, capped by the measured step time; ~0 on an
idle engine).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

from kvprefetch.loadplan import Plan, Rates, finish_in_step, plan


class Ema:
    def __init__(self, prior: float | None, alpha: float = 0.3):
        self.value = prior
        self.samples = 0
        self.alpha = alpha

    def observe(self, x: float) -> None:
        if x <= 0:
            return
        self.value = x if self.samples == 0 or self.value is None else (1 - self.alpha) * self.value + self.alpha * x
        self.samples += 1


class TierMeter:
    """Throughput of one tier's reads, from their completions: bytes / busy time, and the ops still queued.

    ``started(n)`` is called for each batch of reads submitted and ``completed(ok, nbytes)`` as each finishes
    (``track(futures, nbytes)`` wires both to futures). While at least one read is outstanding the tier is
    busy; every ``sample_ops`` completions (or when the tier goes idle) bytes / busy-seconds since the last
    sample is one observation. ``outstanding`` is the queue in front of a new read (in ops).
    """

    def __init__(
        self, on_sample: Callable[[int, float], None], sample_ops: int = 4, clock: Callable[[], float] = time.monotonic
    ):
        self._on_sample = on_sample
        self._sample_ops = sample_ops
        self._clock = clock
        self._lock = threading.Lock()
        self.outstanding = 0
        self._mark = 0.0
        self._bytes = 0
        self._ops = 0

    def track(self, futures: Sequence[Any], nbytes: int) -> None:
        """Watch a batch of read futures of ``nbytes`` each (a read counts its bytes if it did not fail)."""
        futs = [f for f in futures if f is not None]
        self.started(len(futs))
        for f in futs:
            f.add_done_callback(lambda fut, n=nbytes: self.completed(_moved(fut), n))

    def started(self, n: int) -> None:
        """n reads were submitted to the tier."""
        if n <= 0:
            return
        with self._lock:
            if self.outstanding == 0:
                self._mark = self._clock()
                self._bytes = self._ops = 0
            self.outstanding += n

    def completed(self, ok: bool, nbytes: int) -> None:
        """One of them finished (ok: it moved its nbytes; else it failed or was dropped)."""
        sample = None
        with self._lock:
            self.outstanding -= 1
            if ok:
                self._bytes += nbytes
                self._ops += 1
            if self._ops and (self._ops >= self._sample_ops or self.outstanding == 0):
                now = self._clock()
                sample = (self._bytes, now - self._mark)
                self._mark, self._bytes, self._ops = now, 0, 0
            elif self.outstanding == 0:
                self._mark = self._clock()
        if sample is not None and sample[1] > 1e-6:
            self._on_sample(*sample)


def _moved(fut: Any) -> bool:
    return not fut.cancelled() and fut.exception() is None


class CostModel:
    def __init__(
        self,
        chunk_bytes: int,
        chunk_tokens: int,
        *,
        disk_bps: float = 1e9,
        copy_bps: float = 4e9,
        prefill_tps: float | None = None,
        margin: float = 1.0,
        clock: Callable[[], float] = time.monotonic,
    ):
        self.chunk_bytes = chunk_bytes
        self.chunk_tokens = chunk_tokens
        self.disk_bps = Ema(disk_bps)
        self.copy_bps = Ema(copy_bps)
        self.prefill_tps = Ema(prefill_tps)
        self.step_s = Ema(None)  # duration of an engine step that computes something
        self.margin = margin  # load only if load_time * margin <= recompute_time
        self.clock = clock
        self.disk_measured_at: float | None = None  # when the disk rate was last sampled (None: only the prior)
        self._lock = threading.Lock()

    # ---- measurements ---------------------------------------------------------------------------------------
    def observe_disk(self, nbytes: int, seconds: float) -> None:
        if nbytes > 0 and seconds > 1e-6:
            with self._lock:
                self.disk_bps.observe(nbytes / seconds)
                self.disk_measured_at = self.clock()

    def disk_rate_older_than(self, seconds: float) -> bool:
        """Whether the disk rate rests on no sample newer than `seconds` (or on the prior alone)."""
        at = self.disk_measured_at
        return at is None or self.clock() - at > seconds

    def observe_copy(self, nbytes: int, seconds: float) -> None:
        if nbytes > 0 and seconds > 1e-6:
            with self._lock:
                self.copy_bps.observe(nbytes / seconds)

    def observe_prefill(self, tokens: int, seconds: float) -> None:
        if tokens > 0 and seconds > 1e-6:
            with self._lock:
                self.step_s.observe(seconds)
                if tokens >= 16:
                    self.prefill_tps.observe(tokens / seconds)

    def snapshot(self) -> dict[str, float | int | None]:
        return {
            "chunk_tokens": self.chunk_tokens,  # the spec's effective chunk, which every estimate is per
            "prefill_tps": self.prefill_tps.value,
            "prefill_samples": self.prefill_tps.samples,
            "disk_bps": self.disk_bps.value,
            "disk_samples": self.disk_bps.samples,
            "copy_bps": self.copy_bps.value,
            "copy_samples": self.copy_bps.samples,
            "step_s": self.step_s.value,
        }

    # ---- decision -------------------------------------------------------------------------------------------
    def rates(self) -> Rates:
        """The rates as measured so far (the priors where nothing is)."""
        return Rates(self.chunk_bytes, self.chunk_tokens, self.disk_bps.value or 1e9, self.copy_bps.value or 4e9,
                     self.prefill_tps.value)  # fmt: skip

    def disk_s(self, nbytes: int) -> float:
        return self.rates().disk_s(nbytes)

    def finish_in_step(self, remaining_bytes: int, running: int, step_s: float) -> bool:
        """``load_mode: auto``: finish a reached request's remaining disk reads (``remaining_bytes``, the queue
        ahead of them included) inside this step, or park it? The rule is `kvprefetch.loadplan.finish_in_step`,
        on the measured disk rate, shared with the simulator."""
        return finish_in_step(self.disk_s(remaining_bytes), running, step_s)

    def expected_step_s(self, last_step_tokens: int) -> float:
        """How long the step now being scheduled will take, predicted from the last one (0 tokens: idle)."""
        if last_step_tokens <= 0:
            return 0.0
        step = self.step_s.value
        tps = self.prefill_tps.value
        if tps:
            est = last_step_tokens / tps
            return min(est, step) if step else est
        return step or 0.0

    def plan(self, on_disk: Sequence[bool], first: int = 0, queue_bytes: int = 0, async_s: float | None = None) -> Plan:
        """on_disk[i]: chunk i must come up from disk (False: already in DRAM). Chunks < first need no load.

        queue_bytes: disk reads queued ahead of this request's first disk chunk. async_s: a prefix that reaches
        below DRAM is loaded asynchronously and costs at least this long (None: loads are synchronous).
        The rule itself is `kvprefetch.loadplan.plan`, shared with the simulator.
        """
        return plan(on_disk, self.rates(), first, queue_bytes, async_s, self.margin)
