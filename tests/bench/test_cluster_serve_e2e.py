"""`kvprefetch bench --scenario cluster-serve`, short form (`make test-long`), as a user runs it: two `kvprefetch serve`
nodes (real vLLM OpenAI servers with the connector), each in a network namespace of its own over a tbf-shaped link to
a real redis-server pool, a real vllm-router in front; one mode pair (round-robin and kv-tiers, on the same nodes),
one level, one round. Then nothing of it is left on the machine."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from kvprefetch.testbed import netns

pytest.importorskip("vllm")

pytestmark = [pytest.mark.slow, pytest.mark.engine, pytest.mark.long,
              pytest.mark.skipif(netns.available() is not None, reason=str(netns.available()))]  # fmt: skip


def _pools() -> set[str]:
    return {p for p in os.listdir("/dev/shm") if p.startswith("kvprefetch-kvb-")}


def _running(name: str) -> set[int]:
    out = subprocess.run(["pgrep", "-f", name], capture_output=True, text=True).stdout
    return {int(p) for p in out.split()}


def test_cluster_serve_short_form(tmp_path):
    from kvprefetch.bench.modes import router_available

    if not router_available():
        pytest.fail("vllm-router is not installed: `make setup` installs the router extra")
    before = {"pools": _pools(), "routers": _running("vllm-router"), "redis": _running("redis-server"),
              "namespaces": set(netns.namespaces())}  # fmt: skip
    out = tmp_path / "out"
    run = subprocess.run(
        [str(Path(sys.executable).with_name("kvprefetch")), "bench", "--scenario", "cluster-serve", "--quick",
         "--concurrency", "4", "--repeats", "1", "-m", "round-robin,kv-tiers", "--no-node-loss", "--turns", "3",
         "--system-tokens", "256", "--history-tokens", "512", "--user-tokens", "64", "--out", str(out),
         "--cache-dir", str(tmp_path / "cache")],
        capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert run.returncode == 0, run.stdout[-5000:] + run.stderr[-3000:]
    results = json.loads((out / "results.json").read_text())
    rows = {r["mode"]: r for r in results["runs"]}
    assert set(rows) == {"round-robin", "kv-tiers"}
    for r in rows.values():
        assert r["status"] == "ok" and r["errors"] == 0 and r["completed"] == r["requests"] > 0, r
        assert all(n > 0 for n in r["requests_per_node"]), r  # both nodes served, as the router sent them
        assert r["same_node_turns"] + r["other_node_turns"] > 0  # every answer named its node, through the router
        assert r["share_computed"] < 1.0  # the nodes' counters were read: some prompt tokens were found
    # kv_aware looked each turn up in the index it built from both nodes' events, across their namespaces ...
    lookups = {k: v for k, v in rows["kv-tiers"]["router"].items() if k.startswith("kv_placement_lookups")}
    assert lookups.get("kv_placement_lookups{result=hit}", 0) > 0, rows["kv-tiers"]["router"]
    assert rows["round-robin"]["router"] == {}  # ... round robin has no index
    section = results["cluster_serve"]
    assert section["leftovers"] == [] and section["router_version"]
    assert "## Behind a KV-aware router (cluster-serve)" in (out / "report.md").read_text()
    # nothing left: no namespace, no DRAM pool, no router, no pool server, no node server
    assert set(netns.namespaces()) <= before["namespaces"]
    assert _pools() <= before["pools"]
    assert _running("vllm-router") <= before["routers"] and _running("redis-server") <= before["redis"]
    assert not _running(str(tmp_path / "cache"))
