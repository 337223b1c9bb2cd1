"""`metrics.py`: the connector's counters and their Prometheus export."""

from __future__ import annotations

from kvprefetch.vllm.metrics import ConnectorCounters, Reporter


def test_counters_export_to_prometheus(tmp_path):
    from prometheus_client import generate_latest

    c = ConnectorCounters("scheduler")
    c.inc("prefetched_chunks", 3)
    c.inc("load_error_chunks")
    other = tmp_path / "kvprefetch-worker-1-abc.json"  # another process's snapshot
    other.write_text('{"counters": {"worker_loaded_chunks": 5}, "store": {}}')
    io = {"io": {"disk/prefetch": {"bytes": 10, "busy_seconds": 0.5, "queued": 1, "latency_p50_s": 0.1}}}
    r = Reporter(c, lambda: io, interval_s=0, metrics_dir=str(tmp_path), metrics_port=None, serve=True)
    text = generate_latest(r.registry).decode()
    assert "kvprefetch_prefetched_chunks_total" in text
    assert 'kvprefetch_store_io_bytes_total{cls="prefetch",tier="disk"} 10.0' in text
    agg = r.aggregate()
    assert agg["worker_loaded_chunks"] >= 5 and agg["prefetched_chunks"] >= 3
    r.close()
    assert any(p.name.startswith("kvprefetch-scheduler-") for p in tmp_path.iterdir())
