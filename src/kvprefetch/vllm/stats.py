"""kvprefetch's counters through vLLM's own connector-stats API: vLLM's ``/metrics`` and its periodic log line.

vLLM (0.32) collects connector stats in two places and carries them to its front end, where the Prometheus
logger and the log line live (the API server process, which has no connector of its own):

* each step, every worker's ``get_kv_connector_stats()`` rides back in the model runner's output (the workers'
  objects are summed with ``aggregate``), and the scheduler adds its own connector's ``get_kv_connector_stats()``;
* the sum's ``to_dict()`` travels in ``SchedulerStats.kv_connector_stats`` (msgpack: plain dicts, str keys);
* the front end rebuilds it with the connector class's ``build_kv_connector_stats(data)`` for the log line
  (``reduce()``, "KV Transfer metrics: ..."), and feeds the raw dict to the ``KVConnectorPromMetrics`` that
  ``build_prom_metrics`` registered in vLLM's Prometheus registry.

So every connector instance reports *deltas*: what its counters and its store's I/O moved since its last report
(`StatsTracker`). Summing deltas from the scheduler and every worker is exact; nothing is counted twice
because each process counts only what it did (the scheduler its prefetches, a worker its copies and saves).

Metric names (all labelled with vLLM's ``model_name`` and ``engine``; counters get ``_total``):

* ``vllm:kvprefetch_<counter>`` for every counter in `kvprefetch.vllm.metrics.COUNTERS` (prefetched / in time /
  late / evicted / cancelled, loaded / recomputed-because-slower chunks, load errors, saves);
* ``vllm:kvprefetch_untiered_requests{reason}``: requests served without the tiers because their identity (a
  LoRA adapter, multimodal items, ...) could not be keyed (`kvprefetch.vllm.identity.UNTIERED_REASONS`);
* ``vllm:kvprefetch_saves_skipped{reason}``: whole chunks not saved, by why (``save_policy`` and the request's
  own wish: `kvprefetch.vllm.admission.SKIP_REASONS`);
* ``vllm:kvprefetch_hit_tokens{tier}``: prompt tokens the engine loaded from each tier (dram, disk, remote);
  vLLM's own ``vllm:prompt_tokens_cached_by_source{source=host|disk|external_unspecified}`` gets the same split
  (``get_external_cache_hit_sources``);
* ``vllm:kvprefetch_io_bytes`` / ``_io_ops`` / ``_io_seconds`` / ``_io_errors`` / ``_io_cancelled``
  ``{tier, cls}``: the store's I/O per tier and class (demand, prefetch, writeback); mean latency is
  ``rate(io_seconds) / rate(io_ops)``;
* ``vllm:kvprefetch_tier_errors{tier, kind}``: every failure the store met, by the tier it asked and why
  (`kvprefetch.tiers.errors.ErrorKind`: corrupt, missing, no_space, unavailable, rejected, io); each was a miss.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from kvprefetch.io.engine import IOClass
from kvprefetch.tiers.errors import ErrorKind
from kvprefetch.vllm.admission import SKIP_REASONS
from kvprefetch.vllm.compat import CacheHitSource, KVConnectorPromMetrics, KVConnectorStats, PromMetric, PromMetricT
from kvprefetch.vllm.identity import UNTIERED_REASONS
from kvprefetch.vllm.metrics import (
    COUNTERS,
    HIT_TIERS,
    ConnectorCounters,
    hit_counter,
    saves_skipped_counter,
    untiered_counter,
)
from kvprefetch.vllm.settings import parse_extra_config

PREFIX = "vllm:kvprefetch_"
IO_FIELDS: dict[str, tuple[str, str]] = {
    # field in kvprefetch.io.stats snapshots -> (metric suffix, help)
    "bytes": ("io_bytes", "Bytes the store moved, per tier and I/O class."),
    "ops": ("io_ops", "I/O operations the store finished, per tier and I/O class."),
    "busy_seconds": ("io_seconds", "Seconds the store's I/Os took, per tier and class (/ io_ops = mean latency)."),
    "errors": ("io_errors", "I/Os that failed, per tier and class (each a miss, recomputed)."),
    "cancelled": ("io_cancelled", "Queued I/Os dropped before they started (prefetch of a request that ended)."),
}
VLLM_SOURCE: dict[str, CacheHitSource] = {
    "dram": CacheHitSource.HOST,
    "disk": CacheHitSource.DISK,
    "remote": CacheHitSource.EXTERNAL_UNSPECIFIED,
}
# Counters exported as one labelled metric each (`KVPrefetchPromMetrics`): counter name -> label value.
_HIT_NAMES = {hit_counter(t): t for t in HIT_TIERS}
_UNTIERED_NAMES = {untiered_counter(r): r for r in UNTIERED_REASONS}
_SKIPPED_NAMES = {saves_skipped_counter(r): r for r in SKIP_REASONS}
_LABELLED = _HIT_NAMES.keys() | _UNTIERED_NAMES.keys() | _SKIPPED_NAMES.keys()
# The log line's short names, in order (hit tokens per tier and read bytes per tier follow them).
SECTIONS = ("counters", "io", "errors")
LOG_KEYS: tuple[tuple[str, str], ...] = (
    ("prefetched_chunks", "prefetched"),
    ("prefetch_in_time", "in_time"),
    ("prefetch_late", "late"),
    ("prefetch_cancelled_chunks", "cancelled"),
    ("loaded_chunks", "loaded"),
    ("recomputed_slower_chunks", "recomputed_slower"),
    ("load_error_chunks", "load_errors"),
    ("saved_chunks", "saved"),
)


@dataclass
class KVPrefetchStats(KVConnectorStats):
    """One interval's deltas: ``{"counters": {name: n}, "io": {"tier/cls": {field: x}}, "errors": {"tier/kind":
    n}}`` (only non-zero)."""

    def __post_init__(self) -> None:
        for section in SECTIONS:
            self.data.setdefault(section, {})

    def reset(self) -> None:
        self.data = {section: {} for section in SECTIONS}

    def is_empty(self) -> bool:
        return not any(self.data[section] for section in SECTIONS)

    def aggregate(self, other: KVConnectorStats) -> KVConnectorStats:
        if other.is_empty():
            return self
        mine, theirs = self.data, KVPrefetchStats(data=dict(other.data)).data
        for name, n in theirs["counters"].items():
            mine["counters"][name] = mine["counters"].get(name, 0) + n
        for key, fields in theirs["io"].items():
            acc = mine["io"].setdefault(key, {})
            for f, x in fields.items():
                acc[f] = acc.get(f, 0) + x
        for key, n in theirs["errors"].items():
            mine["errors"][key] = mine["errors"].get(key, 0) + n
        return self

    def reduce(self) -> dict[str, int | float]:
        """The interval as vLLM's log line shows it ("KV Transfer metrics: prefetched=..., ...")."""
        c = self.data["counters"]
        out: dict[str, int | float] = {short: int(c.get(name, 0)) for name, short in LOG_KEYS}
        for tier in HIT_TIERS:
            if c.get(hit_counter(tier)):
                out[f"hit_tokens_{tier}"] = int(c[hit_counter(tier)])
        read_bytes: dict[str, float] = {}
        read_s: dict[str, float] = {}
        read_ops: dict[str, float] = {}
        for key, fields in self.data["io"].items():
            tier, _, cls = key.partition("/")
            if cls == "writeback":
                continue
            read_bytes[tier] = read_bytes.get(tier, 0) + fields.get("bytes", 0)
            read_s[tier] = read_s.get(tier, 0) + fields.get("busy_seconds", 0)
            read_ops[tier] = read_ops.get(tier, 0) + fields.get("ops", 0)
        for tier in sorted(read_bytes):
            if read_ops[tier]:
                out[f"{tier}_read_MB"] = round(read_bytes[tier] / 1e6, 1)
                out[f"{tier}_read_ms"] = round(1e3 * read_s[tier] / read_ops[tier], 2)
        for key, n in sorted(self.data["errors"].items()):
            out["errors_" + key.replace("/", "_")] = int(n)
        return out


class StatsTracker:
    """What one connector instance reports to vLLM: its counters' and its store's growth since the last report."""

    def __init__(
        self,
        counters: ConnectorCounters,
        io_totals: Callable[[], Mapping[str, Mapping[str, float]]] | None,
        error_totals: Callable[[], Mapping[str, int]] | None = None,
    ):
        """`io_totals`: the store's cumulative I/O per "tier/cls" (`kvprefetch.io.stats.IOStats.totals`);
        `error_totals`: its failures per "tier/kind" (`kvprefetch.tiers.errors.ErrorTally.totals`)."""
        self.counters = counters
        self.io_totals = io_totals
        self.error_totals = error_totals
        self._lock = threading.Lock()
        self._last_counters: dict[str, int] = dict.fromkeys(COUNTERS, 0)
        self._last_io: dict[str, dict[str, float]] = {}
        self._last_errors: dict[str, int] = {}

    def _io_now(self) -> dict[str, dict[str, float]]:
        if self.io_totals is None:
            return {}
        try:
            totals = self.io_totals()
        except Exception:  # no store yet, or one closed mid-shutdown: report counters only
            return {}
        return {key: {f: float(st.get(f, 0)) for f in IO_FIELDS} for key, st in totals.items()}

    def _errors_now(self) -> dict[str, int]:
        if self.error_totals is None:
            return {}
        try:
            return dict(self.error_totals())
        except Exception:  # no store yet, or one closed mid-shutdown
            return {}

    def take(self) -> KVPrefetchStats | None:
        """The deltas since the last call (None when nothing moved: vLLM then sends nothing)."""
        with self._lock:
            now = self.counters.snapshot()
            counters = _moved(now, self._last_counters)
            self._last_counters = now
            io_now = self._io_now()
            io = {key: d for key, fields in io_now.items() if (d := _moved(fields, self._last_io.get(key, {})))}
            if io_now:
                self._last_io = io_now
            errors_now = self._errors_now()
            errors = _moved(errors_now, self._last_errors)
            if errors_now:
                self._last_errors = errors_now
        if not counters and not io and not errors:
            return None
        return KVPrefetchStats(data={"counters": counters, "io": io, "errors": errors})


def _moved(now: Mapping[str, float], last: Mapping[str, float]) -> dict[str, Any]:
    """What moved between two readings of cumulative values, by key (keys that did not move left out)."""
    return {k: v - last.get(k, 0) for k, v in now.items() if v != last.get(k, 0)}


def vllm_hit_sources(tier_tokens: Mapping[str, int], num_external_tokens: int) -> dict[CacheHitSource, int]:
    """A load's tokens per tier in vLLM's terms (they must sum to what vLLM counted, or vLLM files them as
    external_unspecified itself)."""
    out: dict[CacheHitSource, int] = {}
    for tier, n in tier_tokens.items():
        if n:
            src = VLLM_SOURCE.get(tier, CacheHitSource.EXTERNAL_UNSPECIFIED)
            out[src] = out.get(src, 0) + int(n)
    if sum(out.values()) != num_external_tokens:
        return {CacheHitSource.EXTERNAL_UNSPECIFIED: num_external_tokens} if num_external_tokens else {}
    return out


def _io_tiers(vllm_config: Any) -> list[str]:
    """The tiers below DRAM that the connector's config enables (the I/O engine's tiers)."""
    try:
        extra = vllm_config.kv_transfer_config.kv_connector_extra_config
        tiers = parse_extra_config(extra).store.tiers
    except Exception:  # the connector itself reports a bad config; metrics fall back to the default tiers
        tiers = ["dram", "disk"]
    return [str(getattr(t, "value", t)) for t in tiers if str(getattr(t, "value", t)) != "dram"]


class KVPrefetchPromMetrics(KVConnectorPromMetrics):
    """kvprefetch's metrics in vLLM's Prometheus registry (the front-end process), fed from `KVPrefetchStats`."""

    def __init__(
        self,
        vllm_config: Any,
        metric_types: dict[type[PromMetric], type[PromMetricT]],
        labelnames: list[str],
        per_engine_labelvalues: dict[int, list[object]],
    ):
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
        self._counters = {
            name: self._counter_cls(name=PREFIX + name, documentation=doc, labelnames=labelnames)
            for name, doc in COUNTERS.items()
            if name not in _LABELLED
        }
        self._hits = self._counter_cls(
            name=PREFIX + "hit_tokens",
            documentation="Prompt tokens the engine loaded from each kvprefetch tier (instead of computing them).",
            labelnames=[*labelnames, "tier"],
        )
        self._untiered = self._counter_cls(
            name=PREFIX + "untiered_requests",
            documentation="Requests served without kvprefetch's tiers (no load, no save), by why their identity "
            "could not be keyed.",
            labelnames=[*labelnames, "reason"],
        )
        self._skipped = self._counter_cls(
            name=PREFIX + "saves_skipped",
            documentation="Whole chunks kvprefetch did not save, by why: unseen (save_policy seen, the first time "
            "their prefix was seen), request (kv_transfer_params save false).",
            labelnames=[*labelnames, "reason"],
        )
        self._io = {
            f: self._counter_cls(name=PREFIX + suffix, documentation=doc, labelnames=[*labelnames, "tier", "cls"])
            for f, (suffix, doc) in IO_FIELDS.items()
        }
        self._errors = self._counter_cls(
            name=PREFIX + "tier_errors",
            documentation="Failures the store met, by the tier it asked and why (corrupt, missing, no_space, "
            "unavailable, rejected, io); each was a miss, recomputed.",
            labelnames=[*labelnames, "tier", "kind"],
        )
        # Every series exists from the start (at 0), so dashboards and alerts see them before the first event.
        io_series = [(tier, c.label) for tier in _io_tiers(vllm_config) for c in IOClass]
        for values in per_engine_labelvalues.values():
            for c in self._counters.values():
                c.labels(*values)
            for tier in HIT_TIERS:
                self._hits.labels(*values, tier)
            for reason in UNTIERED_REASONS:
                self._untiered.labels(*values, reason)
            for reason in SKIP_REASONS:
                self._skipped.labels(*values, reason)
            for metric in self._io.values():
                for tier, cls in io_series:
                    metric.labels(*values, tier, cls)
            for tier in ["dram", *_io_tiers(vllm_config)]:
                for kind in ErrorKind:
                    self._errors.labels(*values, tier, kind.value)

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0) -> None:
        values = self.per_engine_labelvalues[engine_idx]
        stats = KVPrefetchStats(data=dict(transfer_stats_data))
        for name, n in stats.data["counters"].items():
            if n <= 0:
                continue
            if name in _HIT_NAMES:
                self._hits.labels(*values, _HIT_NAMES[name]).inc(n)
            elif name in _UNTIERED_NAMES:
                self._untiered.labels(*values, _UNTIERED_NAMES[name]).inc(n)
            elif name in _SKIPPED_NAMES:
                self._skipped.labels(*values, _SKIPPED_NAMES[name]).inc(n)
            elif name in self._counters:
                self._counters[name].labels(*values).inc(n)
        for key, fields in stats.data["io"].items():
            tier, _, cls = key.partition("/")
            for f, x in fields.items():
                if f in self._io and x > 0:
                    self._io[f].labels(*values, tier, cls).inc(x)
        for key, n in stats.data["errors"].items():
            tier, _, kind = key.partition("/")
            if n > 0:
                self._errors.labels(*values, tier, kind).inc(n)
