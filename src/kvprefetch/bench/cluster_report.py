"""The cluster-serve scenario's figures and report (issue 61): pure functions of requests' records, the nodes' and
the router's Prometheus samples, and results.json.

* a cell's figures, as its row carries them: `request_figures` (where each turn went: the node that served it,
  the same node as its session's last turn or the other one, each node's share), `source_shares` (where the
  prompts' tokens came from: the engine's own prefix cache, kvprefetch's DRAM, disk and pool, or computed, from
  the nodes' counters over the cell), `router_figures` (vllm-router's KV-routing metrics: they move only when
  the events reach it);
* `comparisons` and `goals`: the issue's paired ratios per level (`kvprefetch.bench.rounds.paired`);
* `node_loss`: what the node-loss run shows (failed against in flight at the kill, wrong, back after the restart);
* `markdown_lines`: report.md's section.
"""

from __future__ import annotations

from typing import Any

from pydantic import Field

from kvprefetch.bench.rounds import find_row, paired
from kvprefetch.results import Row, View
from kvprefetch.testbed.server import metric_sum

LOSS_RECORD_KEYS = ("pass", "sid", "turn", "node", "arrival", "first_token", "finish", "prompt_tokens",
                    "cached_tokens", "error")  # fmt: skip
"""What results.json keeps of each request of the node-loss run."""
SOURCES = {"engine": None, "dram": "dram", "disk": "disk", "pool": "remote"}  # share -> kvprefetch's hit tier
GOALS = (  # (a, b, goal on a / b's TTFT p50, "<=" or ">=")
    ("kv-tiers", "kv-gpu", 0.80, "<="),
    ("kv-tiers", "cache-aware", 0.85, "<="),
    ("kv-tiers-lease", "pinned", 1.10, "<="),
    ("kv-tiers", "round-robin", 0.70, "<="),
    ("recompute", "kv-tiers", 3.0, ">="),
)
MAX_NODE_SHARE = 0.60  # kv-tiers-lease: neither node serves more than this share of the requests
BACK_WITHIN_S = 30.0  # node loss: the restarted node serves again within this of being ready


# ---- a cell's figures ----------------------------------------------------------------------------------------------
def request_figures(recs: list[dict], nodes: list[str]) -> dict[str, Any]:
    """Where the cell's requests went: per node (in `nodes`' order), the busiest node's share, and each later turn
    on the same node as its session's turn before or on the other."""
    by_turn = {(r["sid"], r["turn"]): r.get("node") for r in recs}
    served = [r.get("node") for r in recs if r.get("node") is not None]
    per_node = [served.count(n) for n in nodes]
    later = [(node, by_turn.get((sid, turn - 1))) for (sid, turn), node in by_turn.items() if turn > 0]
    known = [(now, before) for now, before in later if now is not None and before is not None]
    same = sum(1 for now, before in known if now == before)
    return {"requests_per_node": per_node, "max_node_share": max(per_node) / len(served) if served else None,
            "same_node_turns": same, "other_node_turns": len(known) - same,
            "same_node_ratio": same / len(known) if known else None}  # fmt: skip


def source_shares(before: list[dict], after: list[dict]) -> dict[str, Any]:
    """The prompt tokens the nodes took in over the cell by where each came from (the nodes' own counters:
    vLLM's prompt tokens and prefix-cache hits, kvprefetch's hit tokens per tier); computed is the rest."""

    def moved(name: str, **labels: str) -> float:
        pairs = zip(before, after, strict=True)
        return sum(metric_sum(a, name, **labels) - metric_sum(b, name, **labels) for b, a in pairs)

    prompt = moved("vllm:prompt_tokens_total")
    if prompt <= 0:
        return {}
    shares = {f"share_{k}": (moved("vllm:prefix_cache_hits_total") if tier is None else
                             moved("vllm:kvprefetch_hit_tokens_total", tier=tier)) / prompt
              for k, tier in SOURCES.items()}  # fmt: skip
    return shares | {"share_computed": max(0.0, 1.0 - sum(shares.values())), "node_prompt_tokens": prompt}


def router_figures(metrics: dict) -> dict[str, float]:
    """vllm-router's KV-routing samples (its Prometheus port), by name and result: its inputs (token ids or
    rejected), index lookups (hit, miss) and decisions."""
    out: dict[str, float] = {}
    for (name, labels), value in metrics.items():
        if name.startswith("vllm_router_kv_") and value:
            tag = ",".join(f"{k}={v}" for k, v in labels if k in ("result", "reason", "medium", "decision"))
            key = name.removeprefix("vllm_router_").removesuffix("_total") + (f"{{{tag}}}" if tag else "")
            out[key] = out.get(key, 0.0) + value
    return out


def wrong_answer(rec: dict, reference: dict) -> bool | None:
    """Whether a request's answer differs from recompute's (None: failed, or no reference for it)."""
    key = (rec["sid"], rec["turn"])
    if rec.get("error") is not None or key not in reference:
        return None
    return reference[key] != rec.get("output_text")


# ---- results.json's views ------------------------------------------------------------------------------------------
class ClusterCell(Row):
    """A cluster-serve cell: `Row`, and the cluster's figures."""

    same_node_ratio: float | None = None
    max_node_share: float | None = None
    requests_per_node: list[int] | None = None
    share_dram: float | None = None
    share_disk: float | None = None
    share_pool: float | None = None
    router: dict[str, float] | None = None
    wrong_tokens: int | None = None


class LossRecord(View):
    sid: str
    turn: int
    node: str | None = None
    arrival: float
    first_token: float | None = None
    finish: float | None = None
    cached_tokens: int | None = None
    error: str | None = None
    wrong: bool | None = None


class NodeLoss(View):
    killed: str = ""
    concurrency: int = 0
    passes: int = 0
    events: dict[str, float] = Field(default_factory=dict)
    records: list[LossRecord] = Field(default_factory=list)
    router: dict[str, float] = Field(default_factory=dict)


class ClusterSection(View):
    link: dict[str, Any] = Field(default_factory=dict)
    router_version: str | None = None
    node_kv_bytes: int | None = None
    node_dram_bytes: int | None = None
    pool: bool = True
    wrong_tokens: dict[str, int] = Field(default_factory=dict)
    node_loss: NodeLoss = Field(default_factory=NodeLoss)
    leftovers: list[str] | None = None


def _cells(rows: list[dict]) -> list[ClusterCell]:
    return [ClusterCell.model_validate(r) for r in rows if r.get("status") == "ok"]


def levels_of(rows: list[dict]) -> list[int]:
    return sorted({r.concurrency for r in _cells(rows)})


def comparisons(rows: list[dict]) -> list[dict]:
    """`GOALS`' pairs at every level both modes measured: the paired TTFT p50 ratio, its range and verdict."""
    out = []
    for c in levels_of(rows):
        for a, b, _bound, _op in GOALS:
            ra, rb = find_row(rows, a, c), find_row(rows, b, c)
            p = paired(ra, rb, "ttft_p50_s") if ra is not None and rb is not None else None
            if p is not None:
                out.append({"a": a, "b": b, "concurrency": c} | p)
    return out


def goals(rows: list[dict], section: dict) -> list[dict]:
    """The issue's goals, each {"goal", "met" (True/False/None: not measured), "figures"}."""
    comp, out = comparisons(rows), []
    for a, b, bound, op in GOALS:
        have = [x for x in comp if (x["a"], x["b"]) == (a, b)]
        met = None if not have else all(x["ratio"] <= bound if op == "<=" else x["ratio"] >= bound for x in have)
        figures = ", ".join(f"c={x['concurrency']}: {x['ratio']:.2f} ({x['min']:.2f}-{x['max']:.2f})" for x in have)
        out.append({"goal": f"{a} / {b} TTFT p50 {op} {bound:g}", "met": met, "figures": figures or "not measured"})
    lease = [x for x in _cells(rows) if x.mode == "kv-tiers-lease" and x.max_node_share is not None]
    out.append({"goal": f"kv-tiers-lease: no node serves more than {MAX_NODE_SHARE:.0%} of the requests",
                "met": None if not lease else all(x.max_node_share <= MAX_NODE_SHARE for x in lease),  # type: ignore
                "figures": ", ".join(f"c={x.concurrency}: {x.max_node_share:.0%}" for x in lease) or "not measured"})
    cs = ClusterSection.model_validate(section or {})
    wrong = cs.wrong_tokens
    out.append({"goal": "every answer = recompute's", "met": None if not wrong else not any(wrong.values()),
                "figures": ", ".join(f"{m}: {n} differ" for m, n in wrong.items()) or "not measured"})
    out += _loss_goals(cs.node_loss)
    out.append({"goal": "nothing left behind (namespaces, interfaces, servers, router)",
                "met": None if cs.leftovers is None else not cs.leftovers,
                "figures": ", ".join(cs.leftovers or []) or "none"})
    return out


# ---- node loss -----------------------------------------------------------------------------------------------------
def node_loss(loss: NodeLoss) -> dict[str, Any]:
    """The node-loss run's figures: requests in flight at the kill, failed, wrong, and how soon after the killed
    node was ready again it served a request, and one that found its prefix cached there (its disk tier)."""
    ev, recs = loss.events, loss.records
    kill, ready = ev.get("kill"), ev.get("ready")
    in_flight = [r for r in recs if kill is not None and r.arrival <= kill <= (r.finish or kill)]
    back = [r for r in recs if ready is not None and r.node == loss.killed and r.error is None
            and r.arrival >= ready]  # fmt: skip
    first_back = min((r.arrival for r in back), default=None)
    found = min((r.arrival for r in back if (r.cached_tokens or 0) > 0 and r.turn == 0), default=None)
    return {"requests": len(recs), "in_flight_at_kill": len(in_flight), "failed": sum(1 for r in recs if r.error),
            "wrong": sum(1 for r in recs if r.wrong), "checked": sum(1 for r in recs if r.wrong is not None),
            "served_after_ready_s": None if first_back is None or ready is None else first_back - ready,
            "first_turn_found_after_ready_s": None if found is None or ready is None else found - ready,
            "served_by_killed_after_ready": len(back),
            "restart_to_ready_s": None if ready is None or "restart" not in ev else ready - ev["restart"]}  # fmt: skip


def _loss_goals(loss: NodeLoss) -> list[dict]:
    if not loss.records:
        return []
    f = node_loss(loss)
    back = f["served_after_ready_s"]
    return [{"goal": f"node lost: 0 wrong, failed <= in flight at the kill, routed back within {BACK_WITHIN_S:g} s",
             "met": f["wrong"] == 0 and f["failed"] <= f["in_flight_at_kill"] and back is not None
             and back <= BACK_WITHIN_S,
             "figures": f"{f['failed']} failed of {f['requests']} ({f['in_flight_at_kill']} in flight at the kill), "
                        f"{f['wrong']} wrong of {f['checked']} checked; {loss.killed} restarted "
                        f"{_s(f['restart_to_ready_s'])} before it was ready, served again {_s(back)} after that, "
                        f"a first turn found its prefix there {_s(f['first_turn_found_after_ready_s'])} after"}]


def _s(x: float | None) -> str:
    return "never" if x is None else f"{x:.1f} s"


# ---- report.md -----------------------------------------------------------------------------------------------------
def markdown_lines(results: dict) -> list[str]:
    section = results.get("cluster_serve")
    if not section:
        return []
    rows = results.get("rows", [])
    cs = ClusterSection.model_validate(section)
    lines = ["", "## Behind a KV-aware router (cluster-serve)", "",
             f"Two `kvprefetch serve` nodes in network namespaces of their own (one core each, engine KV "
             f"{(cs.node_kv_bytes or 0) / 2**20:.0f} MiB, DRAM tier {(cs.node_dram_bytes or 0) / 2**20:.0f} MiB, a "
             "disk tier, " + ("the shared pool below over the node's shaped link" if cs.pool else
                              "**no shared pool**: a turn served away from its KV recomputes it") + "), vllm-router "
             f"{cs.router_version or '?'} in front; the client streams token-id prompts to the router only. "
             "Each cell starts from empty nodes, an empty pool and a router of its own.",
             *([f"- Link: {cs.link.get('sentence', '?')}."] if cs.pool else []), "",
             "| mode | c | TTFT p50 | TTFT p90 | tok/s | same node | busiest node | engine | DRAM | disk | pool | "
             "computed | router KV lookups |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|"]  # fmt: skip
    for x in _cells(rows):
        lookups = {k: v for k, v in (x.router or {}).items() if k.startswith("placement_lookups")}
        lines.append(
            f"| {x.mode} | {x.concurrency} | {_f(x.ttft_p50_s)} | {_f(x.ttft_p90_s)} | {_f(x.output_tok_s, '')} | "
            f"{_pct(x.same_node_ratio)} | {_pct(x.max_node_share)} | {_pct(x.share_engine)} | {_pct(x.share_dram)} | "
            f"{_pct(x.share_disk)} | {_pct(x.share_pool)} | {_pct(x.share_computed)} | "
            + (", ".join(f"{k.split('{')[-1].rstrip('}')} {v:.0f}" for k, v in lookups.items()) or "-") + " |")
    lines += ["", "| goal | met | figures |", "|---|---|---|"]
    for g in goals(rows, section):
        lines.append(f"| {g['goal']} | {({True: 'yes', False: '**no**', None: '-'})[g['met']]} | {g['figures']} |")
    return lines


def _f(x: float | None, unit: str = " s") -> str:
    return "-" if x is None else f"{x:.2f}{unit}"


def _pct(x: float | None) -> str:
    return "-" if x is None else f"{100 * x:.0f}%"


def summary(results: dict) -> dict[str, Any]:
    """The goals' verdicts for a terminal or a test: {goal: met}."""
    return {g["goal"]: g["met"] for g in goals(results.get("rows", []), results.get("cluster_serve") or {})}
