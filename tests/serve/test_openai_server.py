"""The vLLM user's path, end to end: vLLM's OpenAI server with the connector, driven by vLLM's own benchmark
client (`vllm.benchmarks.serve`, dataset `prefix_repetition`).

One server for the module (the client imports vLLM meanwhile). Asserted: every request completes; kvprefetch's
counters reach vLLM's /metrics and move (chunks saved, written back, loaded into the engine, vLLM's own
per-source hit counter); the Grafana dashboard queries only metrics that server exposes; SIGTERM shuts the
connector down cleanly (write-back drained, pool pins released). The same server without the connector, side by
side, is `kvprefetch bench-serve`'s (TTFT is timing on a shared machine: not a test's to assert).
"""

from __future__ import annotations

import json
import re
import signal
import uuid
from pathlib import Path

import pytest

pytest.importorskip("vllm")

from kvprefetch.testbed.server import (
    PrefixWorkload,
    compare_servers,
    metric_sum,
    server_argv,
    tiny_model_dir,
    tiny_server_args,
)
from kvprefetch.tiers.disk import DiskTier
from kvprefetch.tiers.dram import SharedChunkPool
from kvprefetch.vllm import transfer_config

pytestmark = pytest.mark.slow

DASHBOARD = Path(__file__).parents[2] / "dashboards" / "kvprefetch-vllm.json"
WORKLOAD = PrefixWorkload(num_prompts=8, prefix_len=1024, suffix_len=256, num_prefixes=4, output_len=4, concurrency=2)
# The engine's own KV holds 2048 tokens (8 MiB at 4 KiB a token): under two of the workload's 1280-token prompts
# at once. A round's 8 prompts cycle through it, so when a round repeats, the first prompts' blocks are long gone
# from vLLM's prefix cache; kvprefetch's DRAM tier (64 MiB) holds all 24 of the workload's chunks.
ENGINE_ARGS = [*tiny_server_args(8 << 20, 1536, 2), "--shutdown-timeout", "30"]


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    work = tmp_path_factory.mktemp("serve")
    model = str(tiny_model_dir(work / "model"))
    pool = "kvpt-serve-" + uuid.uuid4().hex[:10]
    disk = work / "disk"
    extra = {
        "chunk_tokens": 256,
        # keep_idle_s null: the pool outlives the server, so the test can read what its shutdown left there
        "dram": {"capacity_bytes": 64 << 20, "pool_name": pool, "keep_idle_s": None},
        "disk": {"path": str(disk), "capacity_bytes": 1 << 30},
        # Load every hit: whether loading beats recomputing on this machine is the cost model's call (and its
        # tests'); here a warm hit must reach the engine so that the load counters have something to count.
        "load_policy": "always",
        "log_interval_s": 0,
    }
    servers = {"kvprefetch": server_argv(model, transfer_config(extra), ENGINE_ARGS)}
    try:
        result = compare_servers(servers, model, WORKLOAD, work)
        # After SIGTERM: what the connector left in the node's DRAM pool and on disk.
        with SharedChunkPool.attach(pool) as p:
            result.pool_after = {"reaped": p.reaped_at_attach, **p.stats()}
        result.disk_after = DiskTier(disk, 1 << 30).stats()
        yield result
    finally:
        for f in Path("/dev/shm").glob(f"*{pool}*"):
            f.unlink(missing_ok=True)


def test_every_request_completes(served):
    assert set(served.rounds) == {"kvprefetch-cold", "kvprefetch-warm"}
    for name, r in served.rounds.items():
        assert (r.completed, r.failed) == (WORKLOAD.num_prompts, 0), name
        assert r.result["total_input_tokens"] == WORKLOAD.num_prompts * (WORKLOAD.prefix_len + WORKLOAD.suffix_len)


def test_kvprefetch_counters_move_in_vllms_metrics(served):
    before, after = served.metrics_before["kvprefetch"], served.metrics_after["kvprefetch"]

    def moved(name: str, **labels: str) -> float:
        return metric_sum(after, name, **labels) - metric_sum(before, name, **labels)

    # The cold round computes every prompt: each whole chunk is saved, copied out by the worker, written back.
    # (A worker reports with each engine step, so its last saves may be missing from /metrics until the next
    # step: > 0, not equal to what the scheduler planned.)
    assert moved("vllm:kvprefetch_saved_chunks_total") > 0
    assert moved("vllm:kvprefetch_worker_saved_chunks_total") > 0
    assert moved("vllm:kvprefetch_io_bytes_total", tier="disk", cls="writeback") > 0
    # The warm round repeats prompts vLLM's own cache has evicted: kvprefetch loads them into the engine.
    loaded_tokens = moved("vllm:kvprefetch_hit_tokens_total")
    assert loaded_tokens > 0
    assert moved("vllm:kvprefetch_loaded_chunks_total") > 0
    assert moved("vllm:kvprefetch_worker_loaded_chunks_total") > 0
    assert moved("vllm:kvprefetch_load_error_chunks_total") == 0
    # vLLM's own split of cached prompt tokens by source names our tiers (DRAM -> host, disk -> disk); vLLM
    # leaves out requests it had preempted, so it may count fewer tokens than the connector loaded, never more.
    by_source = sum(moved("vllm:prompt_tokens_cached_by_source_total", source=s) for s in ("host", "disk"))
    assert 0 < by_source <= loaded_tokens
    assert moved("vllm:prompt_tokens_cached_by_source_total", source="external_unspecified") == 0


def _queried_metrics(dashboard: dict) -> set[str]:
    exprs = [t["expr"] for panel in dashboard["panels"] for t in panel.get("targets", [])]
    assert exprs, "the dashboard queries nothing"
    exprs += [v["definition"] for v in dashboard["templating"]["list"] if v.get("type") == "query"]
    return {m for e in exprs for m in re.findall(r"vllm:[A-Za-z0-9_:]+", e)}


def test_every_metric_the_dashboard_queries_is_in_the_servers_metrics(served):
    dashboard = json.loads(DASHBOARD.read_text())
    names = _queried_metrics(dashboard)
    assert any(n.startswith("vllm:kvprefetch_") for n in names)
    exposed = {name for name, _ in served.metrics_after["kvprefetch"]}
    assert sorted(names - exposed) == []


def test_sigterm_drains_the_write_back_and_releases_the_pool(served):
    # The server stopped on its own within the grace period, never SIGKILLed past it: 0, or -SIGTERM when
    # uvicorn re-raises the signal it caught after its graceful shutdown (which of the two is a race).
    assert set(served.exit_codes) == {"kvprefetch"}
    assert all(rc in (0, -signal.SIGTERM) for rc in served.exit_codes.values()), served.exit_codes
    pool = served.pool_after
    # Every process detached itself on shutdown: nothing left for the next process to reap, no pins.
    assert pool["reaped"] == 0
    assert pool["slots_pinned"] == 0
    assert pool["processes"] == 1  # this test's own attachment
    # The pool never filled (no eviction), so every chunk in DRAM was put there, and drained write-back put
    # each one on disk too.
    assert pool["slots_ready"] > 0
    assert served.disk_after["chunks"] == pool["slots_ready"]
