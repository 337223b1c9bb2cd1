"""The two-node scenario's routing, node settings and report (`kvprefetch.bench.two_node_report`): pure functions
checked on hand-made rows and fault records."""

from __future__ import annotations

import itertools
from pathlib import Path

import pytest

from kvprefetch.bench.modes import TWO_NODE_MODES, StoreSizing, node_transfer_config, route
from kvprefetch.bench.options import TwoNodeOptions
from kvprefetch.bench.two_node_report import fault_windows, goals, markdown_lines
from kvprefetch.testbed.cluster import node_placement


def test_turns_alternate_nodes_but_pinned_sessions_stay():
    # session i's turn k on node (i + k) mod 2: every turn on another node than the one before it (the prelude,
    # turn -1, included), and the nodes share each turn's load
    for i in range(4):
        nodes = [route("pool-prefetch", i, k) for k in range(-1, 4)]
        assert all(a != b for a, b in itertools.pairwise(nodes))
    assert sorted(route("pool-prefetch", i, 0) for i in range(4)) == [0, 0, 1, 1]
    assert {route("same-node", 3, k) for k in range(-1, 4)} == {1}
    assert {route("same-node", 2, k) for k in range(-1, 4)} == {0}


def test_node_placement_splits_the_cores():
    assert node_placement(0, 2, [0, 1]).model_cpus == [0]
    one = node_placement(1, 2, [0, 1])
    assert one.host_cpus == one.model_cpus == [1] and one.inproc  # a node that is one core: no worker process
    four = node_placement(1, 2, list(range(8)))
    assert (four.model_cpus, four.host_cpus, four.inproc) == ([4, 5, 6], [7], False)
    with pytest.raises(ValueError, match="2 nodes need 2 cores"):
        node_placement(0, 2, [0])


def test_node_transfer_config_tiers():
    sizing = StoreSizing(chunk_tokens=256, dram_bytes=64 << 20, disk_bytes=1 << 30)
    remote = {"backend": "redis", "redis": {"url": "redis://10.231.1.1:6379/1"}}
    assert node_transfer_config("recompute", sizing, "p", remote=None) is None
    local = node_transfer_config("local-only", sizing, "p", remote=None)["kv_connector_extra_config"]
    assert local["tiers"] == ["dram"] and "disk" not in local and "remote" not in local
    sync = node_transfer_config("pool-sync", sizing, "p", remote=remote)["kv_connector_extra_config"]
    assert sync["tiers"] == ["dram", "remote"] and sync["load_mode"] == "sync" and not sync["prefetch"]
    pf = node_transfer_config("pool-prefetch", sizing, "p", remote=remote, disk_dir=Path("/tmp/d"))
    assert pf["kv_connector_extra_config"]["tiers"] == ["dram", "disk", "remote"]
    with pytest.raises(ValueError, match="needs the pool"):
        node_transfer_config("same-node", sizing, "p", remote=None)
    with pytest.raises(ValueError, match="not a two-node mode"):
        node_transfer_config("prefetch", sizing, "p", remote=remote)
    assert TWO_NODE_MODES == ("recompute", "local-only", "pool-sync", "pool-prefetch", "same-node")


def test_unknown_fault_is_refused():
    with pytest.raises(ValueError, match="unknown fault"):
        TwoNodeOptions(faults=("link", "disk"))


def _row(mode: str, c: int, ttfts: list[float], **extra) -> dict:
    by_round = {"ttft_p50_s": dict(enumerate(ttfts)), "output_tok_s": {k: 1 / t for k, t in enumerate(ttfts)}}
    return {"mode": mode, "concurrency": c, "status": "ok", "ttft_p50_s": sorted(ttfts)[len(ttfts) // 2],
            "output_tok_s": 1.0 / ttfts[0], "by_round": by_round} | extra  # fmt: skip


def test_goals_from_paired_rounds():
    rows = []
    for c in (8, 16, 32):
        rows += [_row("recompute", c, [2.0, 2.1, 1.9]), _row("pool-sync", c, [0.40, 0.42, 0.38]),
                 _row("pool-prefetch", c, [0.25, 0.26, 0.24]), _row("same-node", c, [0.22, 0.23, 0.21]),
                 _row("local-only", c, [1.8, 1.9, 1.7], cross_node_found_ratio=0.0)]  # fmt: skip
    section = {"wrong_tokens": {"pool-prefetch": 0, "recompute": 0}, "leftovers": []}
    met = {g["goal"]: g["met"] for g in goals(rows, section)}
    assert met["pool-prefetch / pool-sync TTFT p50 <= 0.74 at the two highest levels"] is True
    assert met["pool-prefetch / same-node TTFT p50 <= 1.25 at every level >= 8"] is True
    assert met["recompute / pool-prefetch TTFT p50 >= 5x at the highest level"] is True  # 2.0 / 0.25 = 8
    shown = next(g for g in goals(rows, section) if g["goal"].startswith("local-only"))
    assert shown["met"] is None and "c=32: 0% of its prompt found, TTFT p50 7.20x pool-prefetch's" in shown["figures"]
    assert met["every mode's tokens = recompute's"] is True
    assert met["nothing left behind (namespaces, interfaces, qdiscs, pool server)"] is True
    # one round where prefetch lost to same-node by 40% fails the goal at that level (a median over 3 rounds)
    rows[3] = _row("same-node", 8, [0.17, 0.18, 0.16])
    met = {g["goal"]: g["met"] for g in goals(rows, section | {"leftovers": ["namespace kvp1-pool"]})}
    assert met["pool-prefetch / same-node TTFT p50 <= 1.25 at every level >= 8"] is False
    assert met["nothing left behind (namespaces, interfaces, qdiscs, pool server)"] is False


def test_a_missing_mode_is_not_a_met_goal():
    rows = [_row("pool-prefetch", 8, [0.25, 0.26, 0.24])]
    met = {g["goal"]: g["met"] for g in goals(rows, {})}
    assert met["pool-prefetch / pool-sync TTFT p50 <= 0.74 at the two highest levels"] is None


def _rec(arrival: float, ttft: float, hit: bool, sid: str = "a", error: str | None = None, wrong: bool = False) -> dict:
    return {"sid": sid, "arrival": arrival, "first_token": arrival + ttft, "finish": arrival + ttft + 0.05,
            "cached_external": 2048 if hit else 0, "error": error, "wrong": wrong}  # fmt: skip


def test_fault_windows_count_the_requests_and_the_recovery():
    recs = [_rec(0.5, 0.1, True), _rec(1.0, 0.1, True, "b"),  # before: from the pool
            _rec(3.5, 0.8, False), _rec(8.0, 0.7, False, "b"),  # during the links' outage: recomputed
            _rec(13.1, 0.1, False), _rec(13.4, 0.1, True, "b"),  # after it: one still missed 0.1 s after
            _rec(20.0, 0.7, False, wrong=True),  # during the pool's outage
            _rec(24.5, 0.7, False),  # after its restart, empty: a's head is written again by this request...
            _rec(26.0, 0.7, False, "b"),  # (b's was not: nothing to find)
            _rec(27.0, 0.1, True)]  # ... and found by a's next one
    faults = {"events": [{"kind": "link", "down_s": 3.0, "up_s": 13.0}, {"kind": "pool", "down_s": 19.0,
                                                                          "up_s": 24.0}], "records": recs}  # fmt: skip
    link, pool = fault_windows(faults)
    assert (link["requests"], link["from_pool"], link["failed"], link["wrong"]) == (2, 0, 0, 0)
    assert (link["could_hit_after"], link["missed_after"]) == (2, 1)
    assert link["recovery_s"] == pytest.approx(0.1)
    assert link["ttft_p50_before_s"] == pytest.approx(0.1)
    assert (pool["requests"], pool["wrong"]) == (1, 1)
    assert (pool["could_hit_after"], pool["missed_after"], pool["recovery_s"]) == (1, 0, 0.0)
    assert pool["first_hit_after_s"] == pytest.approx(3.1)
    section = {"faults": faults | {"concurrency": 8, "passes": 3, "wall_s": 30.0}, "leftovers": []}
    g = {x["goal"]: x["met"] for x in goals([], section)}
    assert g["faults: 0 failed, exact tokens, pool hits back within 5 s"] is False  # one wrong
    text = "\n".join(markdown_lines({"rows": [], "two_node": section}))
    assert "| link | 3.0 s | 13.0 s | 2 | 0 | 0 |" in text


def test_requests_that_keep_missing_after_a_fault_fail_the_goal():
    faults = {"events": [{"kind": "link", "down_s": 3.0, "up_s": 13.0}],
              "records": [_rec(1.0, 0.1, True), _rec(14.0, 0.6, False), _rec(20.0, 0.6, False)]}  # fmt: skip
    (w,) = fault_windows(faults)
    assert w["recovery_s"] == pytest.approx(7.0)
    g = goals([], {"faults": faults})
    assert g[-2]["met"] is False and "hits back within 7.0 s" in g[-2]["figures"]
    quiet = {"events": faults["events"], "records": [_rec(1.0, 0.1, True)]}
    assert fault_windows(quiet)[0]["recovery_s"] is None  # nothing arrived after it: not shown
