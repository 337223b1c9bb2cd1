"""The agent workload's part of the report: warm-ups and leases against arrival-only prefetch and all-in-DRAM,
DRAM held by leases against their budget, and where the warm-ups' reads ended up (issue 39's goals)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from kvprefetch.bench import plotting
from kvprefetch.bench.rounds import find_row, paired
from kvprefetch.results import Row, View

PAIRS = (("warm", "dram"), ("warm", "prefetch"), ("lease", "prefetch"), ("lease", "dram"), ("prefetch", "dram"),
         ("warm", "recompute"), ("prefetch", "ondemand-sync"))  # fmt: skip
"""(mode, baseline) ratios the report prints, TTFT p50 and p90, paired round by round."""

GOALS = (("warm", "dram", 1.10, None), ("warm", "prefetch", 0.60, 1), ("lease", "prefetch", 0.75, 1))
"""(mode, baseline, largest TTFT p50 ratio, the one level it is judged at or None for every level)."""


class ModeRatio(View):
    """One pair of `PAIRS` at one level: `rounds.paired`'s ratio of the mode's figure to the baseline's."""

    concurrency: int
    mode: str
    baseline: str
    key: str
    ratio: float
    min: float
    max: float
    n: int
    verdict: str


class AgentGoal(View):
    """One of issue 39's goals, its paired medians and whether it was met."""

    goal: str
    measured: str
    met: bool


class LeaseCell(Row):
    """A cell that measured leases: DRAM slots reserved and pinned against the budget, and its warm-ups' reads."""

    lease_budget_keys: int | float | None = None
    lease_peak_reserved_keys: int | float | None = None
    lease_peak_pinned_keys: int | float | None = None
    lease_mean_pinned_keys: float | None = None
    lease_within_budget: bool | None = None
    lease_samples: list[list[float]] | None = None  # (seconds into the cell, slots pinned, ...), first round
    hints: int | float | None = 0  # warm-ups
    hint_reads: int | float | None = 0
    hint_in_time: int | float | None = 0
    hint_late: int | float | None = 0
    hint_wasted: int | float | None = 0
    pressure_dropped_chunks: int | float | None = None


def ratios(rows: list[dict]) -> list[dict]:
    """Every pair of `PAIRS` at every level both ran: median of the rounds' ratios, range and verdict."""
    return [x.model_dump() for x in _ratios(rows)]


def _ratios(rows: list[dict]) -> list[ModeRatio]:
    out = []
    for c in sorted({r.concurrency for r in _ok(rows)}):
        for mode, base in PAIRS:
            a, b = find_row(rows, mode, c), find_row(rows, base, c)
            if a is None or b is None:
                continue
            for key in ("ttft_p50_s", "ttft_p90_s"):
                if (p := paired(a, b, key)) is not None:
                    out.append(ModeRatio.model_validate({"concurrency": c, "mode": mode, "baseline": base, "key": key}
                                                        | p))  # fmt: skip
    return out


def goals(rows: list[dict]) -> list[dict]:
    """Issue 39's targets on TTFT p50's paired medians; a tie with all-in-DRAM counts as met (nothing left to
    hide), a tie with prefetch never counts as a gain."""
    return [g.model_dump() for g in _goals(rows)]


def _goals(rows: list[dict]) -> list[AgentGoal]:
    by = {(x.mode, x.baseline, x.concurrency): x for x in _ratios(rows) if x.key == "ttft_p50_s"}
    out = []
    for mode, base, limit, level in GOALS:
        got = [(c, x) for (m, b, c), x in sorted(by.items()) if (m, b) == (mode, base) and level in (None, c)]
        if not got:
            continue

        def met(x: ModeRatio, base: str = base, limit: float = limit) -> bool:
            return x.ratio <= limit or (base == "dram" and x.verdict == "tie")

        text = ", ".join(f"c={c} {x.ratio:.2f} ({x.min:.2f}-{x.max:.2f}, {x.verdict})" for c, x in got)
        where = f" at c={level}" if level else ""
        out.append(AgentGoal(goal=f"{mode} / {base} TTFT p50 <= {limit:.2f}{where}", measured=text,
                             met=all(met(x) for _, x in got)))  # fmt: skip
    return out


def lease_rows(rows: list[dict]) -> list[dict]:
    return [r for r in rows if r.get("status") == "ok" and "lease_budget_keys" in r]


def _ok(rows: list[dict]) -> list[LeaseCell]:
    return [LeaseCell.model_validate(r) for r in rows if r.get("status") == "ok"]


def has_leases(rows: list[dict]) -> bool:
    """Whether any cell measured leases (the agent workload, or the lease and warm modes on another)."""
    return any("lease_budget_keys" in r for r in rows)


def agent_lines(results: dict) -> list[str]:
    rows = results.get("rows", [])
    w = results.get("workload", {})
    if w.get("kind") != "agent":
        lines = ["## Leases and warm-ups", "", "The lease and warm modes against arrival-only prefetch on this "
                 "workload (the warm mode's client names each turn's known head, the last prompt and its answer, when "
                 "the turn before it finished)."]  # fmt: skip
    else:
        life = results.get("config", {}).get("dram_life_s")
        lines = ["## Agent workload: warm the next turn", ""]
        lines.append(f"Sessions of {w.get('measured_turns')} turns from a {w.get('task_tokens')}-token task context "
                     f"(on disk from the prelude); each turn adds a {w.get('answer_tokens')}-token answer and a "
                     f"{w.get('tool_tokens')}-token tool result; a tool call of "
                     f"{w.get('gap_min_s')}-{w.get('gap_max_s')} s (uniform) before every turn. vLLM runs without its "
                     "prefix cache (on a busy server other sessions hold the accelerator's memory by the next turn) "
                     "and, but in `dram`, the DRAM tier keeps an unpinned chunk "
                     f"{life} s after its last use (other engines' traffic on the node, "
                     "`kvprefetch.testbed.pressure`): a head nobody leases is on disk by its next turn.")  # fmt: skip
    lines += [*_ratio_lines(rows), *_goal_lines(rows), *_lease_lines(rows)]
    return [*lines, ""]


def _ratio_lines(rows: list[dict]) -> list[str]:
    """Each pair's TTFT p50 and p90 ratios, paired by round."""
    lines = ["", "| conc | mode / baseline | TTFT p50 ratio | range | verdict | TTFT p90 ratio | range |",
             "|---:|---|---:|---:|---|---:|---:|"]  # fmt: skip
    rs = _ratios(rows)
    p90s = {(y.mode, y.baseline, y.concurrency): y for y in reversed(rs) if y.key == "ttft_p90_s"}
    for x in (x for x in rs if x.key == "ttft_p50_s"):
        p90 = p90s.get((x.mode, x.baseline, x.concurrency))
        p90_text = f"{p90.ratio:.2f} | {p90.min:.2f}-{p90.max:.2f}" if p90 else "- | -"
        lines.append(f"| {x.concurrency} | {x.mode} / {x.baseline} | {x.ratio:.2f} | "
                     f"{x.min:.2f}-{x.max:.2f} | {x.verdict} | {p90_text} |")  # fmt: skip
    return lines


def _goal_lines(rows: list[dict]) -> list[str]:
    """Issue 39's goals, met or not (nothing where none was measured)."""
    g = _goals(rows)
    if not g:
        return []
    return ["", "### Goals (issue 39), on this run's paired medians", "", "| goal | measured | met |", "|---|---|---|",
            *(f"| {x.goal} | {x.measured} | {'yes' if x.met else '**no**'} |" for x in g)]  # fmt: skip


def _lease_lines(rows: list[dict]) -> list[str]:
    """Each leasing cell's DRAM against its budget, and where its warm-ups' reads ended up."""
    lr = [LeaseCell.model_validate(r) for r in lease_rows(rows)]
    if not lr:
        return []
    lines = ["", "### DRAM held by leases, and the warm-ups' reads", "",
             "Keys are DRAM slots (a chunk per rank). `reserved`: what leases hold or will hold once their reads "
             "land (what the budget bounds), peak over the cell; `pinned`: what they hold, peak and mean. Warm-up "
             "reads: chunks read disk -> DRAM for a warm-up; `in time` were in DRAM when the turn arrived, "
             "`late` were still being read, `wasted` belonged to a lease that ended first. `dropped`: chunks the "
             "DRAM pressure took.", "",
             "| mode | conc | budget | peak reserved | peak pinned | mean pinned | within | warm-ups | reads | "
             "in time | late | wasted | dropped |",
             "|---|---:|---:|---:|---:|---:|---|---:|---:|---:|---:|---:|---:|"]  # fmt: skip
    for r in lr:
        lines.append(f"| {r.mode} | {r.concurrency} | {r.lease_budget_keys} | "
                     f"{r.lease_peak_reserved_keys} | {r.lease_peak_pinned_keys} | "
                     f"{r.lease_mean_pinned_keys:.1f} | {'yes' if r.lease_within_budget else '**NO**'} | "
                     f"{r.hints} | {r.hint_reads} | {r.hint_in_time} | "
                     f"{r.hint_late} | {r.hint_wasted} | "
                     f"{r.pressure_dropped_chunks or 0} |")  # fmt: skip
    return [*lines, "", "![DRAM held by leases](lease_dram.png)"]


def lease_plot(results: dict, out: Path) -> list[str]:
    """DRAM slots pinned by leases over each cell's first round, against the budget."""
    lr = [c for c in map(LeaseCell.model_validate, lease_rows(results.get("rows", []))) if c.lease_samples]
    if not lr:
        return []
    fig, ax = plotting.figure()
    budget: Any = None
    for r in lr:
        if r.mode not in ("lease", "warm"):
            continue
        pts = r.lease_samples or []
        ax.plot([p[0] for p in pts], [p[1] for p in pts], label=f"{r.mode} c={r.concurrency}")
        budget = r.lease_budget_keys
    if budget is not None:
        ax.axhline(budget, color="red", linestyle="--", linewidth=1, label="budget")
    ax.set_xlabel("seconds into the cell")
    ax.set_ylabel("DRAM slots pinned by leases")
    ax.set_title("DRAM held by leases (first round of each cell)")
    return [plotting.save(fig, ax, out / "lease_dram.png", fontsize=8)]
