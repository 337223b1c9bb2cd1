"""`kvprefetch bench --scenario two-node`, short form (`make test-long`), as a user runs it: two real vLLM CPU engines
per mode, each in a network namespace of its own, reading a real redis-server in a pool namespace over tbf-shaped
veth links; one level, one round, one fault (the links down for 10 s). Then nothing of it is left on the machine."""

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


def _redis_pids() -> set[int]:
    out = subprocess.run(["pgrep", "-x", "redis-server"], capture_output=True, text=True).stdout
    return {int(p) for p in out.split()}


def _inside(tag: str) -> list[int]:
    """Processes whose command line names one of the run's namespaces (its engines' specs carry their node's)."""
    out = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                if f"{netns.PREFIX}{tag}-".encode() in f.read():
                    out.append(int(pid))
        except OSError:
            continue
    return out


def _pools() -> set[str]:
    return {p for p in os.listdir("/dev/shm") if p.startswith("kvprefetch-kvb-")}


def test_two_node_short_form(tmp_path):
    redis_before, pools_before = _redis_pids(), _pools()
    out = tmp_path / "out"
    proc = subprocess.Popen(
        [str(Path(sys.executable).with_name("kvprefetch")), "bench", "--scenario", "two-node", "--quick",
         "--concurrency", "8", "--repeats", "1", "-m", "recompute,pool-prefetch", "--faults", "link", "--out", str(out),
         "--cache-dir", str(tmp_path / "cache")],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )  # fmt: skip
    try:
        output, _ = proc.communicate(timeout=900)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0, output[-5000:]
    tag = f"{proc.pid:x}"  # what its fabric named its namespaces and interfaces after
    results = json.loads((out / "results.json").read_text())
    rows = {r["mode"]: r for r in results["rows"]}
    assert set(rows) == {"recompute", "pool-prefetch"}
    for r in rows.values():
        assert r["status"] == "ok" and r["errors"] == 0 and r["completed"] == r["requests"] > 0, r
        assert r["requests_per_engine"][0] > 0 and r["requests_per_engine"][1] > 0  # both nodes served
    tn = results["two_node"]
    assert tn["wrong_tokens"] == {"recompute": 0, "pool-prefetch": 0}  # tokens read over the link = recomputed
    # every measured turn ran on the other node than its prelude: pool-prefetch found the context in the pool
    assert rows["pool-prefetch"]["cross_node_found_ratio"] > 0.9
    assert rows["recompute"]["cross_node_found_ratio"] < 0.05
    assert tn["link"]["measured_read_bps"] < 1.1 * tn["link"]["bytes_per_s"]  # the shaping holds

    from kvprefetch.bench.two_node_report import fault_windows

    faults = tn["faults"]
    (window,) = fault_windows(faults)
    assert window["kind"] == "link" and window["up_s"] - window["down_s"] >= 10.0
    assert not any(r["error"] for r in faults["records"])  # the pool is a miss, never an error
    assert not any(r["wrong"] for r in faults["records"])
    assert window["requests"] > 0 and window["from_pool"] < window["requests"]  # it bit: those recomputed
    assert window["recovery_s"] is not None and window["recovery_s"] <= 5.0  # hits back after the link
    report = (out / "report.md").read_text()
    assert "## Two nodes, one pool" in report and "| link |" in report
    assert (out / "two_node_faults.png").stat().st_size > 0

    # nothing left behind: namespaces, their interfaces and qdiscs, the pool's server, the nodes' DRAM pools
    assert tn["leftovers"] == []
    assert [ns for ns in netns.namespaces() if ns.startswith(f"{netns.PREFIX}{tag}-")] == []
    links = subprocess.run(["ip", "-o", "link", "show"], capture_output=True, text=True).stdout
    assert f"k{tag}x" not in links
    assert _redis_pids() <= redis_before
    assert _pools() <= pools_before
    assert _inside(tag) == []  # no engine (or anything) started for a node or the pool lives on
