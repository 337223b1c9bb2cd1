"""The cluster-serve scenario's figures (`kvprefetch.bench.cluster_report`): where turns went, where prompts came
from, the router's KV metrics, the node-loss run, the goals; from records and Prometheus samples as the run takes
them."""

from __future__ import annotations

from kvprefetch.bench import cluster_report as R


def _rec(sid: str, turn: int, node: str | None, **kw) -> dict:
    return {"sid": sid, "turn": turn, "node": node, "arrival": 0.0, "error": None} | kw


def test_each_later_turn_is_counted_on_the_same_node_as_its_sessions_turn_before_or_on_the_other():
    recs = [_rec("a", 0, "n1"), _rec("a", 1, "n1"), _rec("a", 2, "n2"),
            _rec("b", 0, "n2"), _rec("b", 1, "n2"), _rec("c", 0, None), _rec("c", 1, "n1")]  # fmt: skip
    f = R.request_figures(recs, ["n1", "n2"])
    # a1 same, a2 other, b1 same; c1's turn before failed before a node answered: not counted
    assert (f["same_node_turns"], f["other_node_turns"]) == (2, 1)
    assert f["requests_per_node"] == [3, 3] and f["max_node_share"] == 0.5


def _samples(prompt: float, engine: float, **tiers: float) -> dict:
    labels = (("engine", "0"), ("model_name", "m"))
    out = {("vllm:prompt_tokens_total", labels): prompt, ("vllm:prefix_cache_hits_total", labels): engine}
    for tier, n in tiers.items():
        out[("vllm:kvprefetch_hit_tokens_total", (*labels, ("tier", tier)))] = n
    return out


def test_prompt_tokens_are_split_by_source_over_the_cell_summed_across_the_nodes():
    before = [_samples(100, 10, dram=0, disk=0, remote=0), _samples(50, 0)]
    after = [_samples(1100, 410, dram=200, disk=100, remote=0), _samples(1050, 0, dram=0, disk=0, remote=100)]
    s = R.source_shares(before, after)
    assert s["node_prompt_tokens"] == 2000
    assert (s["share_engine"], s["share_dram"], s["share_disk"], s["share_pool"]) == (0.2, 0.1, 0.05, 0.05)
    assert abs(s["share_computed"] - 0.6) < 1e-9
    assert R.source_shares(before, before) == {}  # nothing served: no shares


def test_the_routers_kv_metrics_are_kept_by_result_and_its_other_metrics_dropped():
    m = {("vllm_router_kv_placement_lookups_total", (("result", "hit"),)): 7.0,
         ("vllm_router_kv_placement_lookups_total", (("result", "miss"),)): 0.0,
         ("vllm_router_kv_routing_inputs_total", (("result", "token_ids"), ("worker", "x"))): 9.0,
         ("vllm_router_requests_total", ()): 20.0}  # fmt: skip
    assert R.router_figures(m) == {"kv_placement_lookups{result=hit}": 7.0, "kv_routing_inputs{result=token_ids}": 9.0}


def test_node_loss_counts_the_requests_in_flight_at_the_kill_and_when_the_node_served_again():
    killed = "tiers-node-b"
    recs = [
        _rec("a", 0, killed, arrival=1.0, finish=4.0),  # before the kill
        _rec("b", 0, killed, arrival=4.0, finish=5.5, error="RemoteProtocolError"),  # in flight at the kill (5 s)
        _rec("c", 0, "tiers-node-a", arrival=4.5, finish=6.0),  # in flight, on the other node: served
        _rec("d", 0, killed, arrival=31.0, finish=32.0, cached_tokens=0),  # back 1 s after ready (30 s)
        _rec("e", 0, killed, arrival=33.0, finish=34.0, cached_tokens=512),  # found its prefix there
        _rec("f", 1, "tiers-node-a", arrival=35.0, finish=36.0, wrong=False),
    ]
    loss = R.NodeLoss.model_validate({"killed": killed, "events": {"kill": 5.0, "restart": 20.0, "ready": 30.0},
                                      "records": recs})  # fmt: skip
    f = R.node_loss(loss)
    assert (f["in_flight_at_kill"], f["failed"], f["wrong"], f["checked"]) == (2, 1, 0, 1)
    assert (f["served_after_ready_s"], f["first_turn_found_after_ready_s"]) == (1.0, 3.0)
    (goal,) = R._loss_goals(loss)
    assert goal["met"] is True


def _row(mode: str, c: int, ttfts: list[float], **kw) -> dict:
    rounds = {str(k): t for k, t in enumerate(ttfts)}
    return {"mode": mode, "concurrency": c, "status": "ok", "ttft_p50_s": sorted(ttfts)[len(ttfts) // 2],
            "by_round": {"ttft_p50_s": rounds}} | kw  # fmt: skip


def test_goals_are_judged_on_paired_round_ratios_and_unmeasured_ones_say_so():
    rows = [_row("kv-tiers", 8, [1.0, 1.1, 0.9]), _row("kv-gpu", 8, [2.0, 1.2, 1.0]),
            _row("kv-tiers-lease", 8, [1.0, 1.0, 1.0], max_node_share=0.55),
            _row("pinned", 8, [1.0, 1.0, 1.0])]  # fmt: skip
    g = {x["goal"]: x for x in R.goals(rows, {"wrong_tokens": {"kv-tiers": 0}, "leftovers": []})}
    tiers_gpu = g["kv-tiers / kv-gpu TTFT p50 <= 0.8"]
    assert tiers_gpu["met"] is False and tiers_gpu["figures"] == "c=8: 0.90 (0.50-0.92)"  # the median round
    assert g["kv-tiers-lease / pinned TTFT p50 <= 1.1"]["met"] is True
    assert g["kv-tiers / cache-aware TTFT p50 <= 0.85"] == {"goal": "kv-tiers / cache-aware TTFT p50 <= 0.85",
                                                            "met": None, "figures": "not measured"}  # fmt: skip
    assert g["kv-tiers-lease: no node serves more than 60% of the requests"]["met"] is True
    assert g["every answer = recompute's"]["met"] is True
    assert g["nothing left behind (namespaces, interfaces, servers, router)"]["met"] is True
