"""The load-or-recompute rule: which leading chunks of a request's hit to load, and which to compute again.

One pure function of what is known when the scheduler reaches the request, so that the connector
(`kvprefetch.vllm.costmodel.CostModel.plan`, on its measured rates) and the simulator (`kvprefetch.sim.engine`,
on its modelled tiers) decide alike: the simulator exists to predict the connector.

The rule. A hit is a run of leading chunks, each in some tier. Loading the first k chunks is done when the last
of them is in the engine (`ready[k-1]`); computing them again costs `recompute[k-1]`. A load must be a prefix
(the engine computes what follows it), so the plan loads the k that maximise ``recompute[k-1] - margin *
ready[k-1]``, and nothing (k = 0: recompute everything) unless some k gains: a slow or overloaded tier degrades
to recomputing, never below it, and a split (load the head, compute the rest) happens when only the head pays.
A tie recomputes. `margin` > 1 makes loading more reluctant.

Where `ready` comes from (`ready_times`): storage is a pipe, so a chunk on disk arrives after everything queued
ahead of it (`queue_bytes`) and the request's own disk chunks before it, then is copied into the engine; a chunk
already in DRAM costs only its copy. An asynchronous load (one that reaches below DRAM while the connector's
`load_mode` is async) also costs the rest of the engine step being scheduled (`async_s`): vLLM schedules the
request only in a step after its load is reported done. The simulator brings its own `ready` (its tiers are
pipes with latencies and parallelism) and its own `recompute` (its step cost model) to the same decision.

The second rule (`finish_in_step`, `load_mode: auto`): a request whose reads are still running when the scheduler
reaches it either waits for them inside the step (the batch waits too) or is parked; connector and simulator
decide it alike.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class Plan:
    load_chunks: int  # leading chunks to load (counting from 0; chunks below `first` are already on the engine)
    skipped_slower: int  # hit chunks not loaded because recomputing them is faster
    est_load_s: float
    est_recompute_s: float


@dataclass(frozen=True)
class Rates:
    """What one load costs, measured or assumed: per-chunk sizes, throughputs and the engine's prefill speed."""

    chunk_bytes: int
    chunk_tokens: int
    disk_bps: float
    copy_bps: float
    prefill_tps: float | None  # None: not measured yet

    def disk_s(self, nbytes: float) -> float:
        return nbytes / self.disk_bps

    def copy_s(self) -> float:
        return self.chunk_bytes / self.copy_bps

    def recompute_s(self, tokens: int) -> float | None:
        return None if not self.prefill_tps else tokens / self.prefill_tps


def ready_times(on_disk: Sequence[bool], rates: Rates, first: int = 0, queue_bytes: int = 0,
                async_s: float | None = None) -> list[float]:  # fmt: skip
    """Seconds from now until each chunk from `first` on is in the engine, if it and those before it are loaded.

    on_disk[i]: chunk i comes up from storage (False: it is in DRAM). queue_bytes: reads queued on the storage
    tier ahead of this request's. async_s: a prefix that reaches below DRAM costs at least this long (None:
    loads finish inside the step).
    """
    ready: list[float] = []
    disk_done = rates.disk_s(queue_bytes)
    copy_done = 0.0
    floor = 0.0
    for i in range(first, len(on_disk)):
        if on_disk[i]:
            disk_done += rates.disk_s(rates.chunk_bytes)
            copy_done = max(copy_done, disk_done) + rates.copy_s()
            if async_s:
                floor = async_s
        else:
            copy_done += rates.copy_s()
        ready.append(max(copy_done, floor))
    return ready


def best_prefix(ready: Sequence[float], recompute: Sequence[float], margin: float = 1.0) -> int:
    """How many leading chunks to load: the k that maximises recompute[k-1] - margin * ready[k-1], 0 when no k
    gains anything (`ready[j]`, `recompute[j]`: seconds to load / compute the first j+1 chunks)."""
    best_k, best_gain = 0, 0.0
    for j, (t, r) in enumerate(zip(ready, recompute, strict=True)):
        gain = r - t * margin
        if gain > best_gain:
            best_gain, best_k = gain, j + 1
    return best_k


MIN_STEP_S = 0.005
"""The shortest engine step `finish_in_step` assumes: a step's scheduling and forward cost at least this much (a
decode step of the packaged tiny model on this CPU: 3-6 ms)."""


def finish_in_step(reads_s: float, running: int, step_s: float) -> bool:
    """``load_mode: auto``: finish a reached request's remaining storage reads inside this step, or park it?

    Inside the step, the reads (``reads_s``, the queue ahead of them included) stall the whole batch: this
    request and the ``running`` others each wait that long. Parked (async), only this request waits, but at
    least one step, since vLLM looks at a parked request again only at the next one: ``max(reads_s, step)``.
    Finish in the step iff ``reads_s * (1 + running) <= max(reads_s, step)``. An idle engine (nothing running)
    always reads in the step; a busy one does so only for reads shorter than a step shared by all it runs. The
    step is never taken below `MIN_STEP_S` (scheduling and a forward cost at least that).
    """
    return reads_s * (1 + max(running, 0)) <= max(reads_s, step_s, MIN_STEP_S)


def plan(on_disk: Sequence[bool], rates: Rates, first: int = 0, queue_bytes: int = 0,
         async_s: float | None = None, margin: float = 1.0) -> Plan:  # fmt: skip
    """The connector's plan for a hit of `len(on_disk)` chunks, the first `first` already on the engine.

    Recomputing costs the same per chunk (tokens / prefill speed). Before any prefill has been measured, every
    hit loads: a DRAM copy beats the prefill of every engine we know.
    """
    n = len(on_disk)
    if n <= first:
        return Plan(n, 0, 0.0, 0.0)
    ready = ready_times(on_disk, rates, first, queue_bytes, async_s)
    r = rates.recompute_s(rates.chunk_tokens)
    if r is None:
        return Plan(n, 0, ready[-1], float("nan"))
    k = best_prefix(ready, [r * (j + 1) for j in range(len(ready))], margin)
    return Plan(first + k, n - first - k, ready[k - 1] if k else 0.0, r * (n - first))
