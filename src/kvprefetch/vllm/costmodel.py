"""Load-or-recompute: load a hit only where loading it is faster than recomputing it.

Measured, not configured: the disk tier's read throughput (from the prefetches this process drives), the
DRAM -> engine copy throughput and the engine's prefill speed (both reported by the workers each step) feed
exponential moving averages. Until a rate has been measured its prior is used (optimistic for loads: a fresh
engine has nothing measured yet, and a load from DRAM is ~100x faster than any prefill).

Per request the hit is a run of leading chunks, each in some tier. Loading chunk i costs l_i (its queueing
plus transfer time); recomputing it costs r (chunk_tokens / prefill speed). Because a load must be a prefix,
the plan loads the k leading chunks that maximise sum_{i<k} (r - l_i) and recomputes the rest: a slow or
overloaded tier degrades to recompute, never below it.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from dataclasses import dataclass


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


@dataclass
class Plan:
    load_chunks: int  # leading chunks to load (counting from 0; chunks below `first` are already on the engine)
    skipped_slower: int  # hit chunks not loaded because recomputing them is faster
    est_load_s: float
    est_recompute_s: float


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
    ):
        self.chunk_bytes = chunk_bytes
        self.chunk_tokens = chunk_tokens
        self.disk_bps = Ema(disk_bps)
        self.copy_bps = Ema(copy_bps)
        self.prefill_tps = Ema(prefill_tps)
        self.margin = margin  # load only if load_time * margin <= recompute_time
        self._lock = threading.Lock()

    # ---- measurements ---------------------------------------------------------------------------------------
    def observe_disk(self, nbytes: int, seconds: float) -> None:
        if nbytes > 0 and seconds > 1e-6:
            with self._lock:
                self.disk_bps.observe(nbytes / seconds)

    def observe_copy(self, nbytes: int, seconds: float) -> None:
        if nbytes > 0 and seconds > 1e-6:
            with self._lock:
                self.copy_bps.observe(nbytes / seconds)

    def observe_prefill(self, tokens: int, seconds: float) -> None:
        if tokens >= 16 and seconds > 1e-6:
            with self._lock:
                self.prefill_tps.observe(tokens / seconds)

    # ---- decision -------------------------------------------------------------------------------------------
    def chunk_load_s(self, on_disk: bool) -> float:
        t = self.chunk_bytes / (self.copy_bps.value or 4e9)
        if on_disk:
            t += self.chunk_bytes / (self.disk_bps.value or 1e9)
        return t

    def recompute_s(self, tokens: int) -> float | None:
        tps = self.prefill_tps.value
        return None if not tps else tokens / tps

    def plan(self, on_disk: Sequence[bool], first: int = 0, queue_bytes: int = 0) -> Plan:
        """on_disk[i]: chunk i must come up from disk (False: already in DRAM). Chunks < first need no load."""
        n = len(on_disk)
        if n <= first:
            return Plan(n, 0, 0.0, 0.0)
        r = self.recompute_s(self.chunk_tokens)
        costs = []
        queue_s = queue_bytes / (self.disk_bps.value or 1e9)
        for i in range(first, n):
            c = self.chunk_load_s(on_disk[i])
            if on_disk[i] and queue_s:
                c += queue_s  # the first disk chunk waits behind the tier's queue
                queue_s = 0.0
            costs.append(c)
        if r is None:  # nothing measured yet: loads pay (DRAM copy >> prefill speed on every engine we know)
            return Plan(n, 0, sum(costs), float("nan"))
        best_k, best_gain, gain = first, 0.0, 0.0
        for j, c in enumerate(costs):
            gain += r - c * self.margin
            if gain > best_gain:
                best_gain, best_k = gain, first + j + 1
        return Plan(best_k, n - best_k, sum(costs[: best_k - first]), r * (n - first))
