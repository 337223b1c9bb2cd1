"""kvprefetch's stats in vLLM's connector-stats API, without an engine: deltas, sums, the log line, Prometheus."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

pytest.importorskip("vllm")

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from kvprefetch.io.stats import IOStats
from kvprefetch.tiers.errors import ErrorKind, ErrorTally
from kvprefetch.vllm.compat import CacheHitSource
from kvprefetch.vllm.metrics import ConnectorCounters
from kvprefetch.vllm.stats import KVPrefetchPromMetrics, KVPrefetchStats, StatsTracker, vllm_hit_sources


def _io(nbytes: int, ops: int, seconds: float) -> dict:
    return {"io": {"disk/prefetch": {"bytes": nbytes, "ops": ops, "busy_seconds": seconds, "errors": 0}}}




def test_tracker_reports_what_moved_since_its_last_report():
    counters = ConnectorCounters("scheduler")
    io = IOStats()
    t = StatsTracker(counters, io.totals)
    assert t.take() is None  # nothing moved: vLLM sends nothing
    counters.inc("prefetched_chunks", 3)
    counters.inc("hit_tokens_dram", 512)
    for _ in range(3):
        io.queued("disk", "prefetch", +1)
        io.started("disk", "prefetch")
        io.finished("disk", "prefetch", 1 << 20, 0.01, ok=True)
    first = t.take()
    assert first.data["counters"] == {"prefetched_chunks": 3, "hit_tokens_dram": 512}
    assert first.data["io"]["disk/prefetch"] == {"bytes": 3 << 20, "ops": 3, "busy_seconds": pytest.approx(0.03)}
    counters.inc("prefetched_chunks", 1)
    io.queued("disk", "prefetch", +1)
    io.dropped("disk", "prefetch", "cancelled")
    second = t.take()
    assert second.data == {
        "counters": {"prefetched_chunks": 1}, "io": {"disk/prefetch": {"cancelled": 1}}, "errors": {},
    }  # fmt: skip
    assert t.take() is None


def test_tracker_reports_the_stores_failures_by_tier_and_kind():
    counters = ConnectorCounters("worker")
    errors = ErrorTally()
    t = StatsTracker(counters, None, errors.totals)
    errors.add("disk", ErrorKind.CORRUPT, 3)
    errors.add("remote", ErrorKind.UNAVAILABLE)
    assert t.take().data["errors"] == {"disk/corrupt": 3, "remote/unavailable": 1}
    errors.add("disk", ErrorKind.CORRUPT)
    assert t.take().data == {"counters": {}, "io": {}, "errors": {"disk/corrupt": 1}}
    assert t.take() is None


def test_a_closed_store_reports_counters_only():
    counters = ConnectorCounters("worker")

    def closed():
        raise ValueError("store closed")

    counters.inc("worker_saved_chunks", 2)
    got = StatsTracker(counters, closed, closed).take().data
    assert got == {"counters": {"worker_saved_chunks": 2}, "io": {}, "errors": {}}


def test_stats_from_scheduler_and_workers_add_up_and_reduce_to_the_log_line():
    sched = KVPrefetchStats(data={"counters": {"prefetched_chunks": 4, "loaded_chunks": 4}} | _io(4 << 20, 4, 0.04))
    w0 = KVPrefetchStats(data={"counters": {"worker_loaded_chunks": 4, "hit_tokens_disk": 1024}, "io": {}})
    w1 = KVPrefetchStats(data={"counters": {"worker_loaded_chunks": 4}} | _io(1 << 20, 1, 0.01))
    total = sched.aggregate(w0).aggregate(w1).aggregate(KVPrefetchStats())
    assert total.data["counters"] == {
        "prefetched_chunks": 4, "loaded_chunks": 4, "worker_loaded_chunks": 8, "hit_tokens_disk": 1024,
    }  # fmt: skip
    assert total.data["io"]["disk/prefetch"] == {"bytes": 5 << 20, "ops": 5, "busy_seconds": 0.05, "errors": 0}
    line = total.reduce()
    assert line["prefetched"] == 4 and line["loaded"] == 4 and line["hit_tokens_disk"] == 1024
    assert line["disk_read_MB"] == round((5 << 20) / 1e6, 1)
    assert line["disk_read_ms"] == 10.0
    assert not total.is_empty() and KVPrefetchStats().is_empty()
    w0.aggregate(KVPrefetchStats(data={"counters": {}, "errors": {"disk/corrupt": 2}}))
    assert KVPrefetchStats(data={"errors": {"disk/corrupt": 1}}).aggregate(w0).data["errors"] == {"disk/corrupt": 3}
    assert KVPrefetchStats(data={"errors": {"disk/no_space": 1}}).reduce()["errors_disk_no_space"] == 1
    # The front end rebuilds the object from the dict vLLM sent it.
    assert KVPrefetchStats(data=total.to_dict()).reduce() == line


def test_hit_sources_name_vllms_tiers_and_must_add_up():
    assert vllm_hit_sources({"dram": 256, "disk": 512}, 768) == {CacheHitSource.HOST: 256, CacheHitSource.DISK: 512}
    assert vllm_hit_sources({"remote": 256}, 256) == {CacheHitSource.EXTERNAL_UNSPECIFIED: 256}
    assert vllm_hit_sources({"dram": 256}, 300) == {CacheHitSource.EXTERNAL_UNSPECIFIED: 300}
    assert vllm_hit_sources({}, 0) == {}


def _metric_types(registry: CollectorRegistry) -> dict:
    def bound(cls):
        class Bound(cls):
            def __init__(self, *a, **kw):
                kw.pop("multiprocess_mode", None)
                super().__init__(*a, registry=registry, **kw)

        return Bound

    return {Gauge: bound(Gauge), Counter: bound(Counter), Histogram: bound(Histogram)}


def test_prometheus_series_exist_at_zero_and_count_what_vllm_observes():
    registry = CollectorRegistry()
    extra = {"tiers": ["dram", "disk"], "disk": {"path": "/nonexistent/kvp"}}
    config = SimpleNamespace(kv_transfer_config=SimpleNamespace(kv_connector_extra_config=extra))
    prom = KVPrefetchPromMetrics(config, _metric_types(registry), ["model_name", "engine"], {0: ["m", "0"]})
    labels = {"model_name": "m", "engine": "0"}
    assert registry.get_sample_value("vllm:kvprefetch_prefetch_late_total", labels) == 0
    assert registry.get_sample_value("vllm:kvprefetch_hit_tokens_total", labels | {"tier": "disk"}) == 0
    assert registry.get_sample_value("vllm:kvprefetch_io_errors_total", labels | {"tier": "disk", "cls": "demand"}) == 0
    data = {"counters": {"prefetch_late": 2, "hit_tokens_dram": 256}} | _io(1 << 20, 1, 0.5)
    prom.observe(data, 0)
    prom.observe(data, 0)
    assert registry.get_sample_value("vllm:kvprefetch_prefetch_late_total", labels) == 4
    assert registry.get_sample_value("vllm:kvprefetch_hit_tokens_total", labels | {"tier": "dram"}) == 512
    io_labels = labels | {"tier": "disk", "cls": "prefetch"}
    assert registry.get_sample_value("vllm:kvprefetch_io_bytes_total", io_labels) == 2 << 20
    assert registry.get_sample_value("vllm:kvprefetch_io_seconds_total", io_labels) == 1.0
    for tier in ("dram", "disk"):  # every tier the config enables, every kind, from the start
        for kind in ErrorKind:
            want = labels | {"tier": tier, "kind": kind.value}
            assert registry.get_sample_value("vllm:kvprefetch_tier_errors_total", want) == 0
    prom.observe({"errors": {"disk/corrupt": 2, "disk/missing": 1}}, 0)
    err = labels | {"tier": "disk"}
    assert registry.get_sample_value("vllm:kvprefetch_tier_errors_total", err | {"kind": "corrupt"}) == 2
    assert registry.get_sample_value("vllm:kvprefetch_tier_errors_total", err | {"kind": "missing"}) == 1
