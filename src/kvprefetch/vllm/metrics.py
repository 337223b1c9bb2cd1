"""The connector's counters: Prometheus export and a one-line log summary.

Each connector instance (scheduler side, every worker) counts into a `ConnectorCounters`. Export:

* ``metrics_port``: the scheduler process serves ``/metrics`` (prometheus_client) on that port with the sum
  of every process's counters plus the store's bytes/latency per tier and I/O class.
* ``metrics_dir``: every process writes its snapshot there (JSON, atomically, every ``log_interval_s`` and at
  shutdown); the exporter sums the files, which is how worker-side counters reach the scheduler's port.
"""

from __future__ import annotations

import json
import logging
import os
import threading
import time
import weakref
from collections.abc import Callable
from pathlib import Path
from typing import Any

from kvprefetch.vllm.admission import SKIP_REASONS
from kvprefetch.vllm.identity import UNTIERED_REASONS

log = logging.getLogger("kvprefetch.vllm")

COUNTERS: dict[str, str] = {
    "prefetched_chunks": "Chunks whose disk->DRAM read started on request arrival (or on demand, prefetch off).",
    "prefetch_in_time": "Requests whose prefetched chunks were all in DRAM when the scheduler reached them.",
    "prefetch_late": "Requests the scheduler reached while their prefetch was still in flight.",
    "prefetch_evicted": "Requests whose prefetched chunks had left DRAM again by the time the scheduler reached them.",
    "prefetch_cancelled_chunks": "Prefetch reads cancelled because their request finished first.",
    "demand_reads": "Requests whose disk reads started only when the scheduler reached them.",
    "loaded_chunks": "Chunks planned for loading into the engine (sync and async).",
    "sync_loads": "Requests loaded inside the forward pass (layer by layer).",
    "async_loads": "Requests loaded between steps (chunks had to come up from disk).",
    "finished_in_step": "Requests reached with chunks below DRAM whose reads load_mode auto finished in the step.",
    "layer_load_waits": "Times an attention layer waited on the connector for its layer's KV (layer-wise loads).",
    "worker_loaded_chunks": "Chunks copied into the engine's paged KV by the workers.",
    "load_error_chunks": "Chunks that failed to load (reported to vLLM, recomputed).",
    "load_error_blocks": "KV blocks reported to vLLM as failed loads.",
    "recomputed_slower_chunks": "Hit chunks recomputed because loading them was estimated slower.",
    "disk_probe_chunks": "Chunks the rule recomputed that were read in the background to measure the disk again.",
    "saved_chunks": "Whole chunks planned for saving to the store.",
    "worker_saved_chunks": "Chunks copied out of the engine into the store by the workers.",
    "save_errors": "Save jobs that failed (the chunks are simply not cached).",
    **{f"saves_skipped_{reason}": f"Whole chunks not saved because {why}."
       for reason, why in SKIP_REASONS.items()},
    "window_unsaved_chunks": "Chunks not saved because a sliding-window group's blocks a hit ending there needs "
    "were already freed (their tokens came from vLLM's own prefix cache, which keeps only the window).",
    "leases_granted": "Leases granted (lease on finish, warm-up calls).",
    "leases_used": "Leases ended early because a request that loads all of their chunks arrived.",
    "leases_expired": "Leases that reached their ttl unused.",
    "leases_evicted": "Leases ended early to make room in the lease budget for newer ones.",
    "lease_pinned_chunks": "Chunk pins taken for leases (minus lease_unpinned_chunks: chunks leases hold now).",
    "lease_unpinned_chunks": "Chunk pins leases dropped (ended, expired, used or evicted).",
    "warm_calls": "Warm-up calls (POST /v1/kvprefetch/warm, or SchedulerSide.warm).",
    "warm_read_chunks": "Chunks a warm-up call started reading into DRAM.",
    "joined_saves": "Requests that waited for a save of their own prefix still in flight instead of recomputing.",
    "reasked_unparked": "Requests vLLM asked about again after their async load failed: loaded what DRAM held in "
    "the step and computed the rest (parked again, vLLM would reserve their blocks twice: issue 59).",
    "stalls_released": "Requests that waited for KV past their bound (twice their prefix's recompute time, within a "
    "few seconds) and computed their prefix instead: a parked load unfinished, or never admitted while the engine "
    "computed nothing (the watchdog; its cause is logged once per episode).",
    "hit_tokens_dram": "Prompt tokens loaded into the engine from the DRAM tier.",
    "hit_tokens_disk": "Prompt tokens loaded into the engine from the disk tier (read up through DRAM).",
    "hit_tokens_remote": "Prompt tokens loaded into the engine from the remote tier (read up through DRAM).",
    **{f"untiered_requests_{reason}": f"Requests served without the tiers because {why}."
       for reason, why in UNTIERED_REASONS.items()},
}
HIT_TIERS = ("dram", "disk", "remote")


def hit_counter(tier: str) -> str:
    """The counter of prompt tokens loaded from `tier` (the tier that held each chunk when its load was planned)."""
    return f"hit_tokens_{tier}"


def saves_skipped_counter(reason: str) -> str:
    """The counter of whole chunks not saved for `reason` (`kvprefetch.vllm.admission.SKIP_REASONS`)."""
    return f"saves_skipped_{reason}"


def untiered_counter(reason: str) -> str:
    """The counter of requests served without the tiers for `reason` (`kvprefetch.vllm.identity.UNTIERED_REASONS`)."""
    return f"untiered_requests_{reason}"


_live: weakref.WeakSet[ConnectorCounters] = weakref.WeakSet()


class ConnectorCounters:
    def __init__(self, role: str):
        self.role = role
        self._lock = threading.Lock()
        self._values = dict.fromkeys(COUNTERS, 0)
        _live.add(self)

    def inc(self, name: str, n: int = 1) -> None:
        if name not in COUNTERS:
            raise KeyError(name)
        with self._lock:
            self._values[name] += n

    def snapshot(self) -> dict[str, int]:
        with self._lock:
            return dict(self._values)


RANK_COUNTERS: dict[str, str] = {
    "prefetched_chunks": "(scheduler) Reads of this rank's chunks started into DRAM (on arrival, or on demand).",
    "reached_hit_chunks": "(scheduler) This rank's hit chunks when the scheduler first reached their request.",
    "reached_in_dram_chunks": "(scheduler) ... of which already in DRAM then (the prefetch was in time).",
    "loaded_chunks": "(worker) Chunks this rank copied into the engine.",
    "loaded_bytes": "(worker) Bytes this rank copied into the engine.",
    "saved_chunks": "(worker) Chunks this rank copied out of the engine into the store.",
    "saved_bytes": "(worker) Bytes this rank saved.",
}


class RankCounters:
    """Counters per tensor-parallel rank, kept by the scheduler side: its own per-rank prefetch and lookup
    counts, and the workers' load/save counts, which arrive with each step's output (`KVPrefetchWorkerMeta`)."""

    def __init__(self, tp_size: int):
        self._lock = threading.Lock()
        self._values = {r: dict.fromkeys(RANK_COUNTERS, 0) for r in range(tp_size)}

    def inc(self, rank: int, name: str, n: int = 1) -> None:
        if name not in RANK_COUNTERS:
            raise KeyError(name)
        with self._lock:
            self._values[rank][name] += n

    def merge(self, per_rank: dict[int, dict[str, int]]) -> None:
        for rank, values in per_rank.items():
            for name, n in values.items():
                self.inc(rank, name, n)

    def snapshot(self) -> dict[int, dict[str, int]]:
        with self._lock:
            return {r: dict(v) for r, v in self._values.items()}


def snapshot_all() -> dict[str, int]:
    """Sum of every live connector's counters in this process (scheduler and worker sides)."""
    total = dict.fromkeys(COUNTERS, 0)
    for c in list(_live):
        for k, v in c.snapshot().items():
            total[k] += v
    return total


def summary_line(values: dict[str, int]) -> str:
    keys = [
        ("prefetched_chunks", "prefetched"),
        ("prefetch_in_time", "in_time"),
        ("prefetch_late", "late"),
        ("prefetch_evicted", "evicted"),
        ("prefetch_cancelled_chunks", "cancelled"),
        ("loaded_chunks", "loaded"),
        ("recomputed_slower_chunks", "recomputed_slower"),
        ("load_error_chunks", "load_errors"),
        ("saved_chunks", "saved"),
    ]
    return "kvprefetch: " + " ".join(f"{short}={values.get(k, 0)}" for k, short in keys)


class Reporter:
    """Periodic summary line, snapshot files and (scheduler side) the Prometheus endpoint."""

    def __init__(
        self,
        counters: ConnectorCounters,
        store_stats: Callable[[], dict[str, Any]] | None,
        *,
        interval_s: float,
        metrics_dir: str | None,
        metrics_port: int | None,
        serve: bool,
    ):
        self.counters = counters
        self.store_stats = store_stats
        self.interval_s = interval_s
        self.dir = Path(metrics_dir) if metrics_dir else None
        self._last = time.monotonic()
        self._file = None
        if self.dir is not None:
            self.dir.mkdir(parents=True, exist_ok=True)
            self._file = self.dir / f"kvprefetch-{counters.role}-{os.getpid()}-{id(self):x}.json"
        self.registry = None
        if serve:
            self.registry = self._make_registry()
            if metrics_port:
                from prometheus_client import start_http_server

                start_http_server(metrics_port, registry=self.registry)
                log.info("kvprefetch: Prometheus metrics on port %d", metrics_port)

    # -- periodic ---------------------------------------------------------------------------------------------
    def tick(self, force: bool = False) -> None:
        now = time.monotonic()
        if not force and (self.interval_s <= 0 or now - self._last < self.interval_s):
            return
        self._last = now
        if self._file is not None:
            self._write_snapshot()
        if self.registry is not None and self.interval_s > 0:
            log.info(summary_line(self.aggregate()))

    def _write_snapshot(self) -> None:
        assert self._file is not None
        data = {"counters": self.counters.snapshot(), "store": self._store_stats()}
        tmp = self._file.with_suffix(".tmp")
        tmp.write_text(json.dumps(data))
        os.replace(tmp, self._file)

    def close(self) -> None:
        try:
            if self._file is not None:
                self._write_snapshot()
        except OSError:
            pass

    def _store_stats(self) -> dict[str, Any]:
        if self.store_stats is None:
            return {}
        try:
            return self.store_stats()
        except Exception:
            return {}

    # -- aggregation + export ---------------------------------------------------------------------------------
    def aggregate(self) -> dict[str, int]:
        """This process's counters, plus the other processes' snapshot files when metrics_dir is set."""
        total = snapshot_all()
        if self.dir is not None:
            for f in self.dir.glob("kvprefetch-*.json"):
                if str(os.getpid()) in f.name.split("-"):
                    continue  # this process's live counters are already in
                try:
                    other = json.loads(f.read_text())["counters"]
                except (OSError, ValueError, KeyError):
                    continue
                for k, v in other.items():
                    if k in total:
                        total[k] += int(v)
        return total

    def _make_registry(self):
        from prometheus_client import CollectorRegistry
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

        reporter = self

        class _Collector:
            def collect(self):
                for name, value in reporter.aggregate().items():
                    c = CounterMetricFamily(f"kvprefetch_{name}", COUNTERS[name])
                    c.add_metric([], value)
                    yield c
                io = (reporter._store_stats() or {}).get("io") or {}
                b = CounterMetricFamily(
                    "kvprefetch_store_io_bytes", "Bytes moved per tier and class.", labels=["tier", "cls"]
                )
                s = CounterMetricFamily(
                    "kvprefetch_store_io_busy_seconds", "I/O time per tier and class.", labels=["tier", "cls"]
                )
                q = GaugeMetricFamily(
                    "kvprefetch_store_io_queued", "Queued I/Os per tier and class.", labels=["tier", "cls"]
                )
                lat = GaugeMetricFamily(
                    "kvprefetch_store_io_latency_p50_seconds", "Recent median latency.", labels=["tier", "cls"]
                )
                for key, st in io.items():
                    tier, _, cls = key.partition("/")
                    b.add_metric([tier, cls], float(st.get("bytes", 0)))
                    s.add_metric([tier, cls], float(st.get("busy_seconds", 0)))
                    q.add_metric([tier, cls], float(st.get("queued", 0)))
                    lat.add_metric([tier, cls], float(st.get("latency_p50_s", 0)))
                yield from (b, s, q, lat)

        registry = CollectorRegistry(auto_describe=False)
        registry.register(_Collector())
        return registry
