"""The two-node scenario's report (issue 41): pure functions of results.json's rows and `two_node` section.

* `comparisons`: the paired ratios the issue's goals name, per level (`kvprefetch.bench.rounds.paired`: each
  round's ratio of two modes measured minutes apart, median and range; a range across 1 is a tie).
* `goals`: each goal with its figures and whether it was met.
* `fault_windows`: per fault, the requests that arrived while it lasted (failed, wrong, served from the pool) and
  how long after its end the pool's hits came back (the first token of the first request served from the pool).
* `markdown_lines` and `plots`: report.md's section and its two plots.
"""

from __future__ import annotations

import statistics
from pathlib import Path
from typing import Any

from kvprefetch.bench import plotting
from kvprefetch.bench.rounds import find_row, paired

PAIRS = (
    ("pool-prefetch", "pool-sync", "ttft_p50_s"),
    ("local-only", "pool-prefetch", "ttft_p50_s"),
    ("pool-prefetch", "same-node", "ttft_p50_s"),
    ("recompute", "pool-prefetch", "ttft_p50_s"),
    ("pool-prefetch", "pool-sync", "output_tok_s"),
)
PREFETCH_VS_SYNC = 0.74  # the whitepaper's -26% TTFT p50, over the network
OTHER_NODE_COST = 1.25  # a turn on the other node at most 25% slower than a perfectly routed one
RECOMPUTE_FACTOR = 5.0  # recompute / pool-prefetch at the highest level
RECOVERY_S = 5.0  # hits back within this of the link or the server returning


def levels_of(rows: list[dict]) -> list[int]:
    return sorted({r["concurrency"] for r in rows if r.get("status") == "ok"})


def comparisons(rows: list[dict]) -> list[dict]:
    """Every pair of `PAIRS` at every level both modes measured: the paired ratio with its range."""
    out = []
    for c in levels_of(rows):
        for a, b, key in PAIRS:
            ra, rb = find_row(rows, a, c), find_row(rows, b, c)
            if ra is None or rb is None:
                continue
            p = paired(ra, rb, key)
            if p is not None:
                out.append({"a": a, "b": b, "key": key, "concurrency": c} | p)
    return out


def _ratio(comp: list[dict], a: str, b: str, c: int, key: str = "ttft_p50_s") -> dict | None:
    return next((x for x in comp if (x["a"], x["b"], x["key"], x["concurrency"]) == (a, b, key, c)), None)


def goals(rows: list[dict], section: dict) -> list[dict]:
    """The issue's goals, each {"goal", "met" (True/False/None: not measured), "figures"}."""
    comp, levels = comparisons(rows), levels_of(rows)
    out = []

    def goal(text: str, ratios: list[dict | None], ok) -> None:
        have = [r for r in ratios if r is not None]
        met = None if not have or len(have) < len(ratios) else all(ok(r) for r in have)
        figures = ", ".join(f"c={r['concurrency']}: {r['ratio']:.2f} ({r['min']:.2f}-{r['max']:.2f})" for r in have)
        out.append({"goal": text, "met": met, "figures": figures or "not measured"})

    top = levels[-2:]
    goal(f"pool-prefetch / pool-sync TTFT p50 <= {PREFETCH_VS_SYNC} at the two highest levels",
         [_ratio(comp, "pool-prefetch", "pool-sync", c) for c in top], lambda r: r["ratio"] <= PREFETCH_VS_SYNC)
    goal(f"pool-prefetch / same-node TTFT p50 <= {OTHER_NODE_COST} at every level >= 8",
         [_ratio(comp, "pool-prefetch", "same-node", c) for c in levels if c >= 8],
         lambda r: r["ratio"] <= OTHER_NODE_COST)
    goal(f"recompute / pool-prefetch TTFT p50 >= {RECOMPUTE_FACTOR:g}x at the highest level",
         [_ratio(comp, "recompute", "pool-prefetch", c) for c in levels[-1:]],
         lambda r: r["ratio"] >= RECOMPUTE_FACTOR)  # fmt: skip
    bound = [(c, ra["ttft_p50_s"] / rb["ttft_p50_s"]) for c in levels[-1:]
             if (ra := find_row(rows, "recompute", c)) and (rb := find_row(rows, "same-node", c))]  # fmt: skip
    if bound:  # what a perfectly routed turn reached: the most any KV path could here
        out[-1]["figures"] += f"; recompute / same-node {bound[0][1]:.2f}"
    local = {r["concurrency"]: r for r in rows if r.get("mode") == "local-only" and r.get("status") == "ok"}
    vs = {c: _ratio(comp, "local-only", "pool-prefetch", c) for c in local}
    out.append({"goal": "local-only: what a turn on the other node finds there (shown, not judged)", "met": None,
                "figures": ", ".join(
                    f"c={c}: {100 * (r.get('cross_node_found_ratio') or 0.0):.0f}% of its prompt found"
                    + (f", TTFT p50 {vs[c]['ratio']:.2f}x pool-prefetch's" if vs.get(c) else "")
                    for c, r in local.items()) or "not measured"})  # fmt: skip
    wrong = section.get("wrong_tokens", {})
    out.append({"goal": "every mode's tokens = recompute's", "met": None if not wrong else not any(wrong.values()),
                "figures": ", ".join(f"{m}: {n} differ" for m, n in wrong.items()) or "not measured"})  # fmt: skip
    faults = section.get("faults") or {}
    windows = fault_windows(faults)
    if windows:
        failed = sum(1 for r in faults["records"] if r.get("error"))
        wrong_f = sum(1 for r in faults["records"] if r.get("wrong"))
        slow = [w for w in windows if w["recovery_s"] is None or w["recovery_s"] > RECOVERY_S]
        out.append({"goal": f"faults: 0 failed, exact tokens, pool hits back within {RECOVERY_S:g} s",
                    "met": failed == 0 and wrong_f == 0 and not slow,
                    "figures": f"{failed} failed, {wrong_f} wrong of {len(faults['records'])}; " + "; ".join(
                        _window_text(w) for w in windows)})  # fmt: skip
    left = section.get("leftovers")
    out.append({"goal": "nothing left behind (namespaces, interfaces, qdiscs, pool server)", "met": None if left is None
                else not left, "figures": ", ".join(left or []) or "none"})  # fmt: skip
    return out


# ---- faults -------------------------------------------------------------------------------------------------------
def _from_pool(r: dict) -> bool:
    return int(r.get("cached_external") or 0) > 0


def _ttft(r: dict) -> float | None:
    return None if r.get("first_token") is None else r["first_token"] - r["arrival"]


def _written(r: dict) -> float | None:
    """When a request's chunks went to the pool: the connector saves a prompt's chunks in the step that computes
    them, its prefill, which ends with the first token (the write-through follows at once)."""
    return r.get("first_token")


def pool_holds(r: dict, recs: list[dict], events: list[dict], retry_s: float = 1.0) -> bool:
    """Whether the pool held a prefix of r's prompt when r arrived: the prelude was seeded before the run and no
    restart of the pool's server has lost it since, or an earlier request of r's conversation (every turn shares
    its head) computed it after the last restart, while the pool was reachable, and wrote it. A node tries the
    pool again `retry_s` after its last failure: a write sooner after the restart may not have been tried."""
    restarts = [e["up_s"] for e in events if e["kind"] == "pool" and e.get("up_s") is not None
                and e["down_s"] <= r["arrival"]]  # fmt: skip
    if not restarts:
        return True
    since = max(restarts) + retry_s
    down = [(e["down_s"], (e["up_s"] if e.get("up_s") is not None else float("inf")) + retry_s) for e in events]
    return any(q["sid"] == r["sid"] and (t := _written(q)) is not None and since < t < r["arrival"]
               and not any(a <= t < b for a, b in down) for q in recs)  # fmt: skip


def fault_windows(faults: dict) -> list[dict]:
    """Per fault event: the requests that arrived while it lasted, and how soon after its end every request that
    could find its prefix in the pool (`pool_holds`) did, among those served before the next fault began.
    `recovery_s` is when the last such request that still missed arrived, after the end (0: none missed; None: no
    request could tell)."""
    recs, events, out = faults.get("records", []), faults.get("events", []), []
    retry_s = float(faults.get("pool_retry_after_s", 1.0))
    for n, ev in enumerate(events):
        down, up = ev["down_s"], ev.get("up_s")
        nxt = events[n + 1]["down_s"] if n + 1 < len(events) else float("inf")
        during = [r for r in recs if up is not None and down <= r["arrival"] < up]
        before = [t for r in recs if r["arrival"] < down and (t := _ttft(r)) is not None and _from_pool(r)]
        could = [r for r in recs if up is not None and up <= r["arrival"] and not r.get("error")
                 and (r.get("first_token") or 0.0) < nxt and pool_holds(r, recs, events, retry_s)]  # fmt: skip
        missed = [r["arrival"] - up for r in could if not _from_pool(r)]
        first = sorted(r["first_token"] for r in could if _from_pool(r) and r.get("first_token") is not None)
        out.append({
            "kind": ev["kind"], "down_s": down, "up_s": up, "requests": len(during),
            "failed": sum(1 for r in during if r.get("error")),
            "wrong": sum(1 for r in during if r.get("wrong")),
            "from_pool": sum(1 for r in during if _from_pool(r)),
            "ttft_p50_during_s": _median([_ttft(r) for r in during]),
            "ttft_p50_before_s": statistics.median(before) if before else None,
            "could_hit_after": len(could), "missed_after": len(missed),
            "recovery_s": (max(missed) if missed else 0.0) if could else None,
            "first_hit_after_s": first[0] - up if first else None,
        })  # fmt: skip
    return out


def _median(xs: list[float | None]) -> float | None:
    vals = [x for x in xs if x is not None]
    return statistics.median(vals) if vals else None


def _window_text(w: dict) -> str:
    what = {"link": "links down", "pool": "pool server killed"}.get(w["kind"], w["kind"])
    rec = f"within {w['recovery_s']:.1f} s" if w["recovery_s"] is not None else "not shown"
    return (f"{what} {w['down_s']:.1f}-{w['up_s']:.1f} s: {w['requests']} requests arrived, {w['from_pool']} served "
            f"from the pool, {w['wrong']} wrong; after it {w['could_hit_after'] - w['missed_after']} of "
            f"{w['could_hit_after']} requests whose prefix the pool held found it, hits back {rec}")  # fmt: skip


# ---- report.md -----------------------------------------------------------------------------------------------------
def _f(x: float | None, unit: str = "s") -> str:
    return "-" if x is None else f"{x:.3f} {unit}"


def markdown_lines(results: dict) -> list[str]:
    section = results.get("two_node")
    if not section:
        return []
    rows = results.get("rows", [])
    link = section.get("link", {})
    disk = "and a local disk tier" if section.get("node_disk") else "no local disk, as the whitepaper's GPU servers"
    lines = ["", "## Two nodes, one pool", "",
             "Three network namespaces made by the run: the pool (redis-server, the whitepaper's shared array) and "
             "two nodes, each one vLLM engine on a core of its own with the kvprefetch connector and a DRAM tier "
             f"({disk}), the pool below it over the node's own veth link. Turns alternate nodes (session i's turn k "
             "on node (i + k) mod 2) but in same-node (session i on node i mod 2). No added delay: netem is not "
             "available here, so a link has a rate (tbf) and no distance.", "",
             f"- Link: {link.get('sentence', '-')}."]  # fmt: skip
    if link.get("measured_read_bps"):
        cpu = link.get("reader_cpu_s_per_mib")
        cpu_text = "" if cpu is None else (
            f", {cpu * 1e3:.2f} ms of the node's core per MiB received: "
            f"{100 * cpu * link['bytes_per_s'] / (1 << 20):.0f}% of the link's time per MiB, which a node that is "
            "one core cannot overlap with its model")  # fmt: skip
        lines.append(f"- Measured from node-a: {link['measured_read_bps'] / 1e6:,.0f} MB/s (1 MiB values, redis-py, "
                     f"pipelines of 8){cpu_text}.")  # fmt: skip
    lines += [f"- The pool's retry pause {section.get('pool_retry_after_s')} s and call timeout "
              f"{section.get('pool_timeout_s')} s (the product's defaults: 5 s and 2 s).", ""]
    lines += ["| pair | metric | " + " | ".join(f"c={c}" for c in levels_of(rows)) + " |",
              "|---|---|" + "---:|" * len(levels_of(rows))]  # fmt: skip
    comp = comparisons(rows)
    for a, b, key in PAIRS:
        cells = [_ratio(comp, a, b, c, key) for c in levels_of(rows)]
        lines.append(f"| {a} / {b} | {key} | " + " | ".join(
            "-" if x is None else f"{x['ratio']:.2f} ({x['min']:.2f}-{x['max']:.2f}, {x['verdict']})"
            for x in cells) + " |")  # fmt: skip
    lines += ["", "| goal | met | figures |", "|---|---|---|"]
    for g in goals(rows, section):
        met = {True: "yes", False: "**no**", None: "-"}[g["met"]]
        lines.append(f"| {g['goal']} | {met} | {g['figures']} |")
    lines += ["", "![two nodes](two_node_ttft.png)"]
    lines += _fault_lines(section.get("faults") or {})
    return lines


def _fault_lines(faults: dict) -> list[str]:
    windows = fault_windows(faults)
    if not windows:
        return []
    recs = faults.get("records", [])
    lines = ["", f"### Faults (pool-prefetch at c={faults.get('concurrency')}, {faults.get('passes')} passes of the "
             f"level, {faults.get('wall_s', 0):.0f} s, {len(recs)} requests, "
             f"{sum(1 for r in recs if r.get('error'))} failed, {sum(1 for r in recs if r.get('wrong'))} wrong)", "",
             "| fault | down at | up at | requests during | from the pool | wrong | TTFT p50 before | during | after: "
             "could hit | missed | hits back within | first hit after |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]  # fmt: skip
    for w in windows:
        lines.append(f"| {w['kind']} | {w['down_s']:.1f} s | {w['up_s']:.1f} s | {w['requests']} | {w['from_pool']} "
                     f"| {w['wrong']} | {_f(w['ttft_p50_before_s'])} | {_f(w['ttft_p50_during_s'])} | "
                     f"{w['could_hit_after']} | {w['missed_after']} | {_f(w['recovery_s'])} | "
                     f"{_f(w['first_hit_after_s'])} |")  # fmt: skip
    lines += ["", "A request could hit after a fault when the pool held a prefix of its prompt: the prelude seeded "
              "before the run (lost when the pool's server restarts empty), or its conversation's chunks written "
              "after the restart by an earlier request whose prefill ended while the pool was reachable (and the "
              "node's retry pause had passed). \"Hits back within\" is when the last such request that still "
              "missed arrived, after the fault's end.", ""]
    lines.append("![faults](two_node_faults.png)")
    return lines


# ---- plots ---------------------------------------------------------------------------------------------------------
def plots(results: dict, out: Path) -> list[str]:
    section = results.get("two_node")
    if not section:
        return []
    written = []
    rows = [r for r in results.get("rows", []) if r.get("status") == "ok"]
    fig, ax = plotting.figure()
    for m in dict.fromkeys(r["mode"] for r in rows):
        pts = sorted((r["concurrency"], r["ttft_p50_s"], r.get("ttft_p50_s_min"), r.get("ttft_p50_s_max"))
                     for r in rows if r["mode"] == m and r.get("ttft_p50_s") is not None)  # fmt: skip
        if pts:
            lo = [p[1] - (p[2] if p[2] is not None else p[1]) for p in pts]
            hi = [(p[3] if p[3] is not None else p[1]) - p[1] for p in pts]
            ax.errorbar([p[0] for p in pts], [p[1] for p in pts], yerr=[lo, hi], marker="o", capsize=3, label=m)
    ax.set_xlabel("concurrency")
    ax.set_ylabel("TTFT p50 (s), median of rounds, min-max")
    ax.set_yscale("log")
    ax.set_title(f"Two nodes, one pool ({results.get('workload', {}).get('kind', '')})")
    written.append(plotting.save(fig, ax, out / "two_node_ttft.png"))
    faults = section.get("faults") or {}
    if faults.get("records"):
        written.append(_fault_plot(faults, out / "two_node_faults.png"))
    return written


def _fault_plot(faults: dict, path: Path) -> str:
    fig, ax = plotting.figure()
    recs = [r for r in faults["records"] if _ttft(r) is not None]
    colors = {"link": "tab:red", "pool": "tab:purple"}
    for ev in faults.get("events", []):
        if ev.get("up_s") is not None:
            ax.axvspan(ev["down_s"], ev["up_s"], color=colors.get(ev["kind"], "gray"), alpha=0.15,
                       label=f"{ev['kind']} down")  # fmt: skip
    for hit, label, marker in ((True, "served from the pool", "o"), (False, "recomputed", "x")):
        pts = [(r["arrival"], _ttft(r)) for r in recs if _from_pool(r) is hit]
        if pts:
            ax.scatter([p[0] for p in pts], [p[1] for p in pts], s=10, marker=marker, label=label)
    failed = [r["arrival"] for r in faults["records"] if r.get("error")]
    if failed:
        ax.scatter(failed, [0] * len(failed), s=30, marker="v", color="black", label="failed")
    ax.set_xlabel("arrival (s since the fault run started)")
    ax.set_ylabel("TTFT (s)")
    ax.set_title(f"Faults during pool-prefetch at c={faults.get('concurrency')}")
    return plotting.save(fig, ax, path, fontsize=8)


def summary(results: dict) -> dict[str, Any]:
    """The goals' verdicts for a terminal or a test: {goal: met}."""
    return {g["goal"]: g["met"] for g in goals(results.get("rows", []), results.get("two_node") or {})}
