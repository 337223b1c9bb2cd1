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

from pydantic import Field

from kvprefetch.bench import plotting
from kvprefetch.bench.rounds import find_row, paired
from kvprefetch.results import Row, View

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


class PairRatio(View):
    """One pair of `PAIRS` at one level: `rounds.paired`'s ratio of mode a's figure to mode b's."""

    a: str
    b: str
    key: str
    concurrency: int
    ratio: float
    min: float
    max: float
    n: int
    verdict: str

    def text(self) -> str:
        return f"c={self.concurrency}: {self.ratio:.2f} ({self.min:.2f}-{self.max:.2f})"


class NodeCell(Row):
    """A two-node cell: `Row`, and what a turn on the other node found there (local-only's figure)."""

    cross_node_found_ratio: float | None = None


class FaultRequest(View):
    """One request of the fault run (`kvprefetch.bench.two_node_run`), times in seconds since it started."""

    sid: Any = None  # its conversation
    arrival: float
    first_token: float | None = None
    error: Any = None
    wrong: bool | None = None
    cached_external: int | None = None  # prompt tokens found in the pool

    @property
    def from_pool(self) -> bool:
        return int(self.cached_external or 0) > 0

    @property
    def ttft(self) -> float | None:
        return None if self.first_token is None else self.first_token - self.arrival

    @property
    def written(self) -> float | None:
        """When the request's chunks went to the pool: the connector saves a prompt's chunks in the step that
        computes them, its prefill, which ends with the first token (the write-through follows at once)."""
        return self.first_token


class FaultEvent(View):
    """One fault: its kind ("link": the nodes' links down; "pool": the pool's server killed) and its window."""

    kind: str
    down_s: float
    up_s: float | None = None


class FaultRun(View):
    """The fault run's part of the two_node section: its requests, its faults and how it was run."""

    records: list[FaultRequest] = Field(default_factory=list)
    events: list[FaultEvent] = Field(default_factory=list)
    pool_retry_after_s: float = 1.0
    concurrency: Any = None
    passes: Any = None
    wall_s: float = 0


class Link(View):
    """The nodes' link to the pool: as shaped (sentence, bytes_per_s) and as measured from node-a."""

    sentence: str | None = "-"
    bytes_per_s: float | None = None
    measured_read_bps: float | None = None
    reader_cpu_s_per_mib: float | None = None
    reader: str = "redis-py, pipelines of 8"  # what read the pool in the measurement


class TwoNode(View):
    """results.json's two_node section, as the report reads it."""

    link: Link = Link()
    backend: str = "redis"
    node_disk: Any = None
    pool_retry_after_s: Any = None
    pool_timeout_s: Any = None
    wrong_tokens: dict[str, Any] = Field(default_factory=dict)  # per mode: tokens that differ from recompute's
    faults: FaultRun | None = None
    leftovers: list[str] | None = None  # what the run left behind (None: not checked)

    @classmethod
    def of(cls, results: dict) -> TwoNode | None:
        section = results.get("two_node")
        return cls.model_validate(section) if section else None


class Goal(View):
    """One of the issue's goals: met (None: not measured, or shown and not judged) and its figures."""

    goal: str
    met: bool | None
    figures: str


class Window(FaultEvent):
    """One fault's window (`fault_windows`): the fault, the requests that arrived during it, and after it."""

    requests: int
    failed: int
    wrong: int
    from_pool: int
    ttft_p50_during_s: float | None
    ttft_p50_before_s: float | None
    could_hit_after: int
    missed_after: int
    recovery_s: float | None
    first_hit_after_s: float | None


def levels_of(rows: list[dict]) -> list[int]:
    return sorted({r.concurrency for r in _ok(rows)})


def _ok(rows: list[dict]) -> list[NodeCell]:
    return [NodeCell.model_validate(r) for r in rows if r.get("status") == "ok"]


def comparisons(rows: list[dict]) -> list[dict]:
    """Every pair of `PAIRS` at every level both modes measured: the paired ratio with its range."""
    return [x.model_dump() for x in _comparisons(rows)]


def _comparisons(rows: list[dict]) -> list[PairRatio]:
    out = []
    for c in levels_of(rows):
        for a, b, key in PAIRS:
            ra, rb = find_row(rows, a, c), find_row(rows, b, c)
            if ra is None or rb is None:
                continue
            p = paired(ra, rb, key)
            if p is not None:
                out.append(PairRatio.model_validate({"a": a, "b": b, "key": key, "concurrency": c} | p))
    return out


def _ratio(comp: list[PairRatio], a: str, b: str, c: int, key: str = "ttft_p50_s") -> PairRatio | None:
    return next((x for x in comp if (x.a, x.b, x.key, x.concurrency) == (a, b, key, c)), None)


def goals(rows: list[dict], section: dict) -> list[dict]:
    """The issue's goals, each {"goal", "met" (True/False/None: not measured), "figures"}."""
    return [g.model_dump() for g in _goals(rows, TwoNode.model_validate(section))]


def _goals(rows: list[dict], two: TwoNode) -> list[Goal]:
    return [*_ratio_goals(rows), _local_goal(rows), *_run_goals(two)]


def _ratio_goals(rows: list[dict]) -> list[Goal]:
    """The goals on the pairs' ratios: prefetch against sync, routing, recompute."""
    comp, levels = _comparisons(rows), levels_of(rows)

    def goal(text: str, ratios: list[PairRatio | None], ok, more: str = "") -> Goal:
        have = [r for r in ratios if r is not None]
        met = None if not have or len(have) < len(ratios) else all(ok(r) for r in have)
        return Goal(goal=text, met=met, figures=(", ".join(r.text() for r in have) or "not measured") + more)

    top = levels[-2:]
    cells = {x.mode: x for x in _ok(rows) if levels and x.concurrency == levels[-1]}
    alone, routed = cells.get("recompute"), cells.get("same-node")
    # what a perfectly routed turn reached: the most any KV path could here
    bound = f"; recompute / same-node {alone.ttft_p50_s / routed.ttft_p50_s:.2f}" if alone and routed else ""
    return [
        goal(f"pool-prefetch / pool-sync TTFT p50 <= {PREFETCH_VS_SYNC} at the two highest levels",
             [_ratio(comp, "pool-prefetch", "pool-sync", c) for c in top], lambda r: r.ratio <= PREFETCH_VS_SYNC),
        goal(f"pool-prefetch / same-node TTFT p50 <= {OTHER_NODE_COST} at every level >= 8",
             [_ratio(comp, "pool-prefetch", "same-node", c) for c in levels if c >= 8],
             lambda r: r.ratio <= OTHER_NODE_COST),
        goal(f"recompute / pool-prefetch TTFT p50 >= {RECOMPUTE_FACTOR:g}x at the highest level",
             [_ratio(comp, "recompute", "pool-prefetch", c) for c in levels[-1:]],
             lambda r: r.ratio >= RECOMPUTE_FACTOR, bound),
    ]  # fmt: skip


def _local_goal(rows: list[dict]) -> Goal:
    """local-only, shown: what a turn on the other node found there, and its TTFT against pool-prefetch's."""
    comp = _comparisons(rows)
    local = {r.concurrency: r for r in _ok(rows) if r.mode == "local-only"}
    vs = {c: _ratio(comp, "local-only", "pool-prefetch", c) for c in local}
    return Goal(goal="local-only: what a turn on the other node finds there (shown, not judged)", met=None,
                figures=", ".join(
                    f"c={c}: {100 * (r.cross_node_found_ratio or 0.0):.0f}% of its prompt found"
                    + (f", TTFT p50 {x.ratio:.2f}x pool-prefetch's" if (x := vs.get(c)) else "")
                    for c, r in local.items()) or "not measured")  # fmt: skip


def _run_goals(two: TwoNode) -> list[Goal]:
    """The goals on the run as a whole: exact tokens, the faults, nothing left behind."""
    wrong = two.wrong_tokens
    out = [Goal(goal="every mode's tokens = recompute's", met=None if not wrong else not any(wrong.values()),
                figures=", ".join(f"{m}: {n} differ" for m, n in wrong.items()) or "not measured")]  # fmt: skip
    faults = two.faults or FaultRun()
    windows = _fault_windows(faults)
    if windows:
        failed = sum(1 for r in faults.records if r.error)
        wrong_f = sum(1 for r in faults.records if r.wrong)
        slow = [w for w in windows if w.recovery_s is None or w.recovery_s > RECOVERY_S]
        out.append(Goal(goal=f"faults: 0 failed, exact tokens, pool hits back within {RECOVERY_S:g} s",
                        met=failed == 0 and wrong_f == 0 and not slow,
                        figures=f"{failed} failed, {wrong_f} wrong of {len(faults.records)}; " + "; ".join(
                            _window_text(w) for w in windows)))  # fmt: skip
    left = two.leftovers
    out.append(Goal(goal="nothing left behind (namespaces, interfaces, qdiscs, pool server)",
                    met=None if left is None else not left, figures=", ".join(left or []) or "none"))  # fmt: skip
    return out


# ---- faults -------------------------------------------------------------------------------------------------------
def pool_holds(r: FaultRequest, recs: list[FaultRequest], events: list[FaultEvent], retry_s: float = 1.0) -> bool:
    """Whether the pool held a prefix of r's prompt when r arrived: the prelude was seeded before the run and no
    restart of the pool's server has lost it since, or an earlier request of r's conversation (every turn shares
    its head) computed it after the last restart, while the pool was reachable, and wrote it. A node tries the
    pool again `retry_s` after its last failure: a write sooner after the restart may not have been tried."""
    restarts = [e.up_s for e in events if e.kind == "pool" and e.up_s is not None and e.down_s <= r.arrival]
    if not restarts:
        return True
    since = max(restarts) + retry_s
    down = [(e.down_s, (e.up_s if e.up_s is not None else float("inf")) + retry_s) for e in events]
    return any(q.sid == r.sid and (t := q.written) is not None and since < t < r.arrival
               and not any(a <= t < b for a, b in down) for q in recs)  # fmt: skip


def fault_windows(faults: dict) -> list[dict]:
    """Per fault event: the requests that arrived while it lasted, and how soon after its end every request that
    could find its prefix in the pool (`pool_holds`) did, among those served before the next fault began.
    `recovery_s` is when the last such request that still missed arrived, after the end (0: none missed; None: no
    request could tell)."""
    return [w.model_dump() for w in _fault_windows(FaultRun.model_validate(faults))]


def _fault_windows(run: FaultRun) -> list[Window]:
    recs, events, out = run.records, run.events, []
    for n, ev in enumerate(events):
        down, up = ev.down_s, ev.up_s
        nxt = events[n + 1].down_s if n + 1 < len(events) else float("inf")
        during = [r for r in recs if up is not None and down <= r.arrival < up]
        before = [t for r in recs if r.arrival < down and (t := r.ttft) is not None and r.from_pool]
        could = [r for r in recs if up is not None and up <= r.arrival and not r.error
                 and (r.first_token or 0.0) < nxt and pool_holds(r, recs, events, run.pool_retry_after_s)]  # fmt: skip
        missed = [r.arrival - up for r in could if not r.from_pool]
        first = sorted(r.first_token for r in could if r.from_pool and r.first_token is not None)
        out.append(Window(
            kind=ev.kind, down_s=down, up_s=up, requests=len(during),
            failed=sum(1 for r in during if r.error),
            wrong=sum(1 for r in during if r.wrong),
            from_pool=sum(1 for r in during if r.from_pool),
            ttft_p50_during_s=_median([r.ttft for r in during]),
            ttft_p50_before_s=statistics.median(before) if before else None,
            could_hit_after=len(could), missed_after=len(missed),
            recovery_s=(max(missed) if missed else 0.0) if could else None,
            first_hit_after_s=first[0] - up if first else None,
        ))  # fmt: skip
    return out


def _median(xs: list[float | None]) -> float | None:
    vals = [x for x in xs if x is not None]
    return statistics.median(vals) if vals else None


def _window_text(w: Window) -> str:
    what = {"link": "links down", "pool": "pool server killed"}.get(w.kind, w.kind)
    rec = f"within {w.recovery_s:.1f} s" if w.recovery_s is not None else "not shown"
    return (f"{what} {w.down_s:.1f}-{w.up_s:.1f} s: {w.requests} requests arrived, {w.from_pool} served "
            f"from the pool, {w.wrong} wrong; after it {w.could_hit_after - w.missed_after} of "
            f"{w.could_hit_after} requests whose prefix the pool held found it, hits back {rec}")  # fmt: skip


# ---- report.md -----------------------------------------------------------------------------------------------------
def _f(x: float | None, unit: str = "s") -> str:
    return "-" if x is None else f"{x:.3f} {unit}"


POOL_SERVER = {"redis": "redis-server",
               "mooncake": "a Mooncake Store: mooncake_master and a process holding the pool's memory, at one address "
                           "each node routes to over its own link; the nodes lend it none"}  # fmt: skip


def markdown_lines(results: dict) -> list[str]:
    two = TwoNode.of(results)
    if two is None:
        return []
    rows = results.get("rows", [])
    link = two.link
    disk = "and a local disk tier" if two.node_disk else "no local disk, as the whitepaper's GPU servers"
    server = POOL_SERVER.get(two.backend, two.backend)
    lines = ["", "## Two nodes, one pool", "",
             f"Three network namespaces made by the run: the pool ({server}, the whitepaper's shared array) and "
             "two nodes, each one vLLM engine on a core of its own with the kvprefetch connector and a DRAM tier "
             f"({disk}), the pool below it over the node's own veth link. Turns alternate nodes (session i's turn k "
             "on node (i + k) mod 2) but in same-node (session i on node i mod 2). No added delay: netem is not "
             "available here, so a link has a rate (tbf) and no distance.", "",
             f"- Link: {link.sentence}."]  # fmt: skip
    if link.measured_read_bps:
        cpu = link.reader_cpu_s_per_mib
        cpu_text = "" if cpu is None else (
            f", {cpu * 1e3:.2f} ms of the node's core per MiB received: "
            f"{100 * cpu * link.bytes_per_s / (1 << 20):.0f}% of the link's time per MiB, which a node that is "
            "one core cannot overlap with its model")  # fmt: skip
        lines.append(f"- Measured from node-a: {link.measured_read_bps / 1e6:,.0f} MB/s (1 MiB values, "
                     f"{link.reader}){cpu_text}.")  # fmt: skip
    lines += [f"- The pool's retry pause {two.pool_retry_after_s} s and call timeout "
              f"{two.pool_timeout_s} s (the product's defaults: 5 s and 2 s).", ""]  # fmt: skip
    lines += [*_pair_lines(rows), "", "| goal | met | figures |", "|---|---|---|"]
    for g in _goals(rows, two):
        met = {True: "yes", False: "**no**", None: "-"}[g.met]
        lines.append(f"| {g.goal} | {met} | {g.figures} |")
    lines += ["", "![two nodes](two_node_ttft.png)"]
    lines += _fault_lines(two.faults or FaultRun())
    return lines


def _pair_lines(rows: list[dict]) -> list[str]:
    """The table of `PAIRS`' paired ratios, a column per level."""
    levels = levels_of(rows)
    lines = ["| pair | metric | " + " | ".join(f"c={c}" for c in levels) + " |", "|---|---|" + "---:|" * len(levels)]
    comp = _comparisons(rows)
    for a, b, key in PAIRS:
        cells = [_ratio(comp, a, b, c, key) for c in levels]
        lines.append(f"| {a} / {b} | {key} | " + " | ".join(
            "-" if x is None else f"{x.ratio:.2f} ({x.min:.2f}-{x.max:.2f}, {x.verdict})"
            for x in cells) + " |")  # fmt: skip
    return lines


def _fault_lines(faults: FaultRun) -> list[str]:
    windows = _fault_windows(faults)
    if not windows:
        return []
    recs = faults.records
    lines = ["", f"### Faults (pool-prefetch at c={faults.concurrency}, {faults.passes} passes of the "
             f"level, {faults.wall_s:.0f} s, {len(recs)} requests, "
             f"{sum(1 for r in recs if r.error)} failed, {sum(1 for r in recs if r.wrong)} wrong)", "",
             "| fault | down at | up at | requests during | from the pool | wrong | TTFT p50 before | during | after: "
             "could hit | missed | hits back within | first hit after |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]  # fmt: skip
    for w in windows:
        lines.append(f"| {w.kind} | {w.down_s:.1f} s | {w.up_s:.1f} s | {w.requests} | {w.from_pool} "
                     f"| {w.wrong} | {_f(w.ttft_p50_before_s)} | {_f(w.ttft_p50_during_s)} | "
                     f"{w.could_hit_after} | {w.missed_after} | {_f(w.recovery_s)} | "
                     f"{_f(w.first_hit_after_s)} |")  # fmt: skip
    lines += ["", "A request could hit after a fault when the pool held a prefix of its prompt: the prelude seeded "
              "before the run (lost when the pool's server restarts empty), or its conversation's chunks written "
              "after the restart by an earlier request whose prefill ended while the pool was reachable (and the "
              "node's retry pause had passed). \"Hits back within\" is when the last such request that still "
              "missed arrived, after the fault's end.", ""]  # fmt: skip
    lines.append("![faults](two_node_faults.png)")
    return lines


# ---- plots ---------------------------------------------------------------------------------------------------------
def plots(results: dict, out: Path) -> list[str]:
    two = TwoNode.of(results)
    if two is None:
        return []
    written = []
    rows = _ok(results.get("rows", []))
    fig, ax = plotting.figure()
    for m in dict.fromkeys(r.mode for r in rows):
        pts = sorted((r.concurrency, r.ttft_p50_s, r.ttft_p50_s_min, r.ttft_p50_s_max)
                     for r in rows if r.mode == m and r.ttft_p50_s is not None)  # fmt: skip
        if pts:
            lo = [p[1] - (p[2] if p[2] is not None else p[1]) for p in pts]
            hi = [(p[3] if p[3] is not None else p[1]) - p[1] for p in pts]
            ax.errorbar([p[0] for p in pts], [p[1] for p in pts], yerr=[lo, hi], marker="o", capsize=3, label=m)
    ax.set_xlabel("concurrency")
    ax.set_ylabel("TTFT p50 (s), median of rounds, min-max")
    ax.set_yscale("log")
    ax.set_title(f"Two nodes, one pool ({results.get('workload', {}).get('kind', '')})")
    written.append(plotting.save(fig, ax, out / "two_node_ttft.png"))
    faults = two.faults or FaultRun()
    if faults.records:
        written.append(_fault_plot(faults, out / "two_node_faults.png"))
    return written


def _fault_plot(faults: FaultRun, path: Path) -> str:
    fig, ax = plotting.figure()
    recs = [r for r in faults.records if r.ttft is not None]
    colors = {"link": "tab:red", "pool": "tab:purple"}
    for ev in faults.events:
        if ev.up_s is not None:
            ax.axvspan(ev.down_s, ev.up_s, color=colors.get(ev.kind, "gray"), alpha=0.15, label=f"{ev.kind} down")
    for hit, label, marker in ((True, "served from the pool", "o"), (False, "recomputed", "x")):
        pts = [(r.arrival, r.ttft) for r in recs if r.from_pool is hit]
        if pts:
            ax.scatter([p[0] for p in pts], [p[1] for p in pts], s=10, marker=marker, label=label)
    failed = [r.arrival for r in faults.records if r.error]
    if failed:
        ax.scatter(failed, [0] * len(failed), s=30, marker="v", color="black", label="failed")
    ax.set_xlabel("arrival (s since the fault run started)")
    ax.set_ylabel("TTFT (s)")
    ax.set_title(f"Faults during pool-prefetch at c={faults.concurrency}")
    return plotting.save(fig, ax, path, fontsize=8)


def summary(results: dict) -> dict[str, Any]:
    """The goals' verdicts for a terminal or a test: {goal: met}."""
    two = TwoNode.model_validate(results.get("two_node") or {})
    return {g.goal: g.met for g in _goals(results.get("rows", []), two)}
