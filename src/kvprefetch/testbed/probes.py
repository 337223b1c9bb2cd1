"""What the simulator needs measured in a benchmark engine, apart from the cells themselves: each step's batch and
timing (`StepRecorder`), the engine's prefill and decode speeds (`calibrate`), and the CPU time other processes
and the connector's own threads took (`CpuMeter`, `HelperCpuMeter`). The engine child
(`kvprefetch.testbed.engine_proc`) runs them; they reach the engine only through the `Host` it passes in.
"""

from __future__ import annotations

import os
import random
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import numpy as np

CpuReader = Callable[[str], "float | None"]  # "own" | "helper" -> CPU seconds of the engine's processes


class Host(Protocol):
    """What the probes need of the engine child."""

    driver: Any  # kvprefetch.testbed.engine_proc.Driver

    def flush(self) -> bool: ...
    def reset_prefix_cache(self) -> bool: ...
    def cpu_s(self, kind: str) -> float | None: ...


def local_cpu_s(kind: str) -> float | None:
    """This process's CPU seconds (``own``) or its connector threads' (``helper``)."""
    return _own_cpu_s() if kind == "own" else _helper_cpu_s()


class StepRecorder:
    """What each engine step ran and how long it took: the batch (per request, tokens scheduled and tokens
    already computed), the scheduler's share of the step, and how many requests were left waiting. The
    simulator's step model is checked against these (`kvprefetch.sim.stepcheck`): it separates an error in
    step costs from one in scheduling."""

    def __init__(self, engine):
        self.records: list[dict] | None = None
        self.available = False
        self._last: tuple[Any, float, int] | None = None
        sched = getattr(getattr(getattr(engine, "engine_core", None), "engine_core", None), "scheduler", None)
        if sched is None:  # not vLLM's in-process engine core: nothing to record
            return
        schedule = sched.schedule

        def timed(*args, **kwargs):
            if self.records is None:  # not recording: the plain call
                return schedule(*args, **kwargs)
            t = time.perf_counter()
            out = schedule(*args, **kwargs)
            self._last = (out, time.perf_counter() - t, len(sched.waiting))
            return out

        sched.schedule = timed
        self.available = True

    def step_done(self, start: float, seconds: float) -> None:
        """Record the step that just ran (`start` on the cell's clock)."""
        if self.records is None or self._last is None:
            return
        out, sched_s, waiting = self._last
        self._last = None
        try:
            n = out.num_scheduled_tokens
            batch = [[n.get(r.req_id, 0), r.num_computed_tokens] for r in out.scheduled_new_reqs]
            cached = out.scheduled_cached_reqs
            batch += [
                [n.get(rid, 0), done] for rid, done in zip(cached.req_ids, cached.num_computed_tokens, strict=True)
            ]
        except (
            AttributeError,
            TypeError,
            ValueError,
        ):  # another vLLM's scheduler output: a diagnostic, never a failure
            self.records, self.available = None, False
            return
        if batch:
            self.records.append({"t": start, "s": seconds, "sched_s": sched_s, "waiting": waiting, "batch": batch})


def random_prompt(n: int, vocab: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(4, vocab) for _ in range(n)]


def calibrate(host: Host, prompt_tokens: int, repeats: int, decode_tokens: int, vocab: int, seed: int = 0) -> dict:
    """Prefill and decode speeds of this engine, as the simulator's calibration needs them.

    - prefill of a fresh prompt, alone (``prefill_tokens_per_s``);
    - prefill of 256 new tokens on that prompt, now in the engine's prefix cache (``extend_s``): with the first,
      it separates the per-token cost from the attention cost;
    - the time to first token of a 16-token prompt (``request_floor_s``): the per-request cost outside the model;
    - the time to first token of that prompt once more, its KV now only in the DRAM tier (``reload_s``, the
      engine's prefix cache reset): the connector's load path into the engine, end to end;
    - one decode step of a short sequence alone (``decode_step_s``), of sixteen short ones together
      (``decode_wide_step_s``: the per-sequence cost of a step) and of four long ones together
      (``decode_batch_step_s``: with the others, the time to read the batch's KV).

    `seed` picks the prompts: an engine whose store holds another engine's calibration (a mode's engine on a copy
    of the populated disk tier) needs prompts of its own, or its "fresh" prefill is a load.

    Every sample starts once the previous one's KV is saved (the store flushed), so no write-back runs beside it.
    The fastest sample is the estimate: on a shared machine other processes only ever slow a sample down, and
    the CPU time they took during the calibration is reported next to it (``foreign_cpu_cores``).
    """
    cpu0 = CpuMeter(host.cpu_s)
    extend_tokens, wide, batch = 256, 16, 4
    pre = _prefill_samples(host, prompt_tokens, extend_tokens, repeats, vocab, seed)
    floors = _request_floors(host.driver, repeats, vocab, seed)
    steps = _decode_steps(host.driver, decode_tokens, vocab, seed)
    wide_itl = _batch_step_s(host.driver, "decw", wide, 256, decode_tokens, vocab, seed + 950)
    batch_itl = _batch_step_s(host.driver, "decb", batch, prompt_tokens, decode_tokens, vocab, seed + 3000)
    reload_s, reload_tokens = min(pre.reloads) if pre.reloads else (None, None)
    return {
        "prefill_tokens_per_s": max(pre.speeds) if pre.speeds else None,
        "prefill_samples": pre.speeds,
        "prefill_not_fresh": pre.not_fresh,  # samples dropped: the prompt was already cached (see `seed`)
        "prompt_tokens": prompt_tokens,
        "extend_tokens": extend_tokens,
        "extend_offset": prompt_tokens,
        "extend_s": min(pre.extends) if pre.extends else None,
        "extend_samples": pre.extends,
        "request_floor_s": min(floors) if floors else None,
        "request_floor_samples": floors,
        "decode_step_s": min(steps) if steps else None,
        "decode_step_samples": steps,
        "decode_step_ctx": 256,
        "decode_batch": batch,
        "decode_batch_ctx": prompt_tokens,
        "decode_batch_step_s": batch_itl,
        "decode_wide": wide,
        "decode_wide_step_s": wide_itl,
        "reload_s": reload_s,
        "reload_tokens": reload_tokens,
        "reload_samples": [t for t, _ in pre.reloads],
        "foreign_cpu_cores": cpu0.foreign_cores(),
    }


@dataclass
class _PrefillSamples:
    """`calibrate`'s samples of a fresh prompt: its prefill, its extension, and its reload from the DRAM tier."""

    speeds: list[float] = field(default_factory=list)  # prompt tokens / TTFT, of the prompts no cache held
    extends: list[float] = field(default_factory=list)  # TTFT of the prompt and 256 new tokens
    reloads: list[tuple[float, int]] = field(default_factory=list)  # (TTFT, tokens the connector loaded)
    not_fresh: int = 0  # prompts found in a cache: a load, not a prefill


def _prefill_samples(
    host: Host, prompt_tokens: int, extend_tokens: int, repeats: int, vocab: int, seed: int
) -> _PrefillSamples:
    """Per repeat, a fresh prompt's prefill, then that prompt extended, then (the engine's prefix cache reset, if
    it can be) that prompt once more from the DRAM tier; the store flushed after each."""
    driver, out = host.driver, _PrefillSamples()
    for k in range(repeats):
        prompt = random_prompt(prompt_tokens, vocab, seed + 1000 + k)
        rec = _first_token(driver, f"cal{k}", prompt)
        if rec is not None and rec.get("cached_tokens"):  # found in a cache: a load, not a prefill
            out.not_fresh += 1
        elif rec is not None:
            out.speeds.append(prompt_tokens / (rec["first_token"] - rec["arrival"]))
        host.flush()
        ttft = _ttft(driver, f"ext{k}", prompt + random_prompt(extend_tokens, vocab, seed + 2000 + k))
        if ttft is not None:
            out.extends.append(ttft)
        host.flush()
        if host.reset_prefix_cache():
            rec = _first_token(driver, f"rel{k}", prompt)
            if rec is not None and rec.get("cached_external"):
                out.reloads.append((rec["first_token"] - rec["arrival"], int(rec["cached_external"])))
    return out


def _request_floors(driver: Any, repeats: int, vocab: int, seed: int) -> list[float]:
    """Time to first token of a 16-token prompt, per repeat (the failed ones left out)."""
    floors = []
    for k in range(repeats):
        ttft = _ttft(driver, f"floor{k}", random_prompt(16, vocab, seed + 4000 + k))
        if ttft is not None:
            floors.append(ttft)
    return floors


def _decode_steps(driver: Any, decode_tokens: int, vocab: int, seed: int) -> list[float]:
    """Median gap between tokens of a 256-token sequence decoding alone, twice."""
    steps = []
    for k in range(2):
        d = _one_turn(f"dec{k}", random_prompt(256, vocab, seed + 900 + k), decode_tokens)
        itl = sorted(driver.run([d], 1, 600, f"dec{k}")["records"][0]["itl"])
        if itl:
            steps.append(itl[len(itl) // 2])
    return steps


def _batch_step_s(driver: Any, tag: str, n: int, ctx: int, decode_tokens: int, vocab: int, seed: int) -> float | None:
    """Median step of `n` sequences of `ctx` tokens decoding together (`_together_itl`)."""
    sessions = [_one_turn(f"{tag}{k}", random_prompt(ctx, vocab, seed + k), decode_tokens) for k in range(n)]
    return _together_itl(driver.run(sessions, n, 600, tag)["records"])


def _one_turn(sid: str, tokens: list[int], max_tokens: int) -> dict:
    """A session of one turn, due at once."""
    return {"sid": sid, "arrival_s": 0.0, "turns": [{"tokens": tokens, "max_tokens": max_tokens}]}


def _first_token(driver: Any, sid: str, tokens: list[int]) -> dict | None:
    """The record of one prompt run alone for one token (None if it failed)."""
    r = driver.run([_one_turn(sid, tokens, 1)], 1, 600, sid)["records"][0]
    return None if r["first_token"] is None else r


def _ttft(driver: Any, sid: str, tokens: list[int]) -> float | None:
    """Time to first token of one prompt run alone (None if it failed)."""
    r = _first_token(driver, sid, tokens)
    return None if r is None else r["first_token"] - r["arrival"]


def _together_itl(recs: list[dict]) -> float | None:
    """Median gap between tokens over the steps where every sequence of a batch was decoding (after the last
    prefill)."""
    start = max((r["first_token"] or 0.0) for r in recs)
    gaps = sorted(
        x
        for r in recs
        if r["first_token"] is not None
        for x, end in zip(r["itl"], r["first_token"] + np.cumsum(r["itl"]), strict=True)
        if end - x >= start
    )
    return gaps[len(gaps) // 2] if gaps else None


class CpuMeter:
    """CPU time other processes took on this machine since creation, in cores (0 = the machine was ours)."""

    def __init__(self, cpu_s: CpuReader = local_cpu_s):
        self.cpu_s = cpu_s  # the engine's own processes (this one and its workers)
        self.t0 = time.monotonic()
        self.busy0 = _machine_busy_s()
        self.own0 = cpu_s("own")

    def foreign_cores(self) -> float | None:
        busy, own = _machine_busy_s(), self.cpu_s("own")
        dt_s = time.monotonic() - self.t0
        if busy is None or own is None or self.busy0 is None or self.own0 is None or dt_s <= 0:
            return None
        return max(0.0, ((busy - self.busy0) - (own - self.own0)) / dt_s)


def _machine_busy_s() -> float | None:
    try:
        fields = Path("/proc/stat").read_text().splitlines()[0].split()[1:]
    except (OSError, IndexError):
        return None
    vals = [int(x) for x in fields]
    busy = sum(vals[:8]) - vals[3] - (vals[4] if len(vals) > 4 else 0)  # all but idle and iowait
    return busy / os.sysconf("SC_CLK_TCK")


def _own_cpu_s() -> float | None:
    """The process's CPU seconds, its ended threads included: the scheduler's exact runtime (the same clock as
    `_thread_cpu_s`; ``os.times()`` is tick-sampled and scaled, and its difference from the threads' sum could
    exceed what it measures on a busy machine)."""
    try:
        return time.process_time()
    except OSError:
        return None


class HelperCpuMeter:
    """CPU seconds the connector's own threads took since creation: its loads, saves and storage I/O.

    That is the process's CPU less the main thread's and the native threads' (the model's OpenMP workers) and
    the other Python threads': threads that ended meanwhile (each step's loader) are counted too. On a CPU
    engine whose threads share the model's cores (the ``shared`` topology) this is time the model did not get;
    the simulator charges it, per byte moved, to the steps. The
    threads are read one after another while they run, so a reading is good to a few hundredths of a second.
    """

    def __init__(self, cpu_s: CpuReader = local_cpu_s):
        self.cpu_s = cpu_s
        self.start = cpu_s("helper")

    def seconds(self) -> float | None:
        now = self.cpu_s("helper")
        return None if now is None or self.start is None else round(max(0.0, now - self.start), 3)


def _helper_cpu_s() -> float | None:
    """Process CPU seconds not spent by the main thread, by native threads or by Python threads not ours."""
    total = _own_cpu_s()
    if total is None:
        return None
    try:
        tids = os.listdir("/proc/self/task")
    except OSError:  # no /proc: a diagnostic that is missing, never a failed cell
        return None
    ours = {t.native_id for t in threading.enumerate() if t.name.startswith("kvprefetch")}
    others = 0.0
    for tid in tids:
        if int(tid) not in ours:  # includes the main thread
            others += _thread_cpu_s(tid)
    return total - others


def _thread_cpu_s(tid: str) -> float:
    """One thread's CPU seconds: its exact runtime from schedstat (nanoseconds), else its utime + stime ticks."""
    try:
        return int(Path(f"/proc/self/task/{tid}/schedstat").read_text().split()[0]) / 1e9
    except (OSError, IndexError, ValueError):
        pass
    try:
        fields = Path(f"/proc/self/task/{tid}/stat").read_text().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return 0.0  # the thread ended between the listing and the read
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime, stime


