"""The engine-memory sweep's report (`kvprefetch bench --engine-kv`, issue 44: the whitepaper's R5): pure
functions of results.json's rows.

Every mode ran at every engine KV size, the rounds interleaved across modes and sizes, so each figure here is a
**paired ratio** against vLLM alone (`recompute`) at the full size in the same round (`kvprefetch.bench.rounds
.paired`): median and range over the rounds; a range across the threshold is not a pass.

* `points`: per mode and size, the medians, their ranges and the paired ratios to vLLM alone at full size;
* `give_back`: the smallest size at which `prefetch` keeps `GIVE_BACK_SHARE` of that throughput;
* `goals`: the issue's goals at `GOAL_SHARE`;
* `markdown_lines`, `terminal_lines` and `plots`: report.md's section, the terminal's summary and
  engine_memory.png.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from kvprefetch.bench import plotting
from kvprefetch.bench.rounds import find_row, paired
from kvprefetch.results import Paired, Row
from kvprefetch.sim.engine_memory import GIVE_BACK_SHARE, GOAL_TTFT  # the simulator's projection reads them alike

BASELINE = "recompute"  # vLLM alone
GOAL_SHARE = 0.25  # the issue's goals are judged at this share of the full size
RECOMPUTE_LOSS = 0.30  # vLLM alone there must lose at least this share of its throughput (else: no pressure)
MODE_ORDER = ("recompute", "prefetch", "dram")


def is_sweep(rows: list[dict]) -> bool:
    """Whether the rows come from an engine-memory sweep (more than one engine KV size)."""
    return len({r.get("engine_kv_bytes") for r in rows if r.get("engine_kv_bytes") is not None}) > 1


def full_bytes(rows: list[dict]) -> int | None:
    """The full size: the size whose share is 1 (the sweep always measures it)."""
    return next((r.engine_kv_bytes for r in map(Row.model_validate, rows) if r.engine_kv_share == 1), None)


@dataclass(frozen=True)
class Measure:
    """One figure of a point: the cell's median, its rounds' min-max (None for one round: no spread) and its
    paired ratio to vLLM alone at full size, round by round (None where either was not measured)."""

    median: float | None = None
    range: tuple[float, float] | None = None
    vs_full: Paired | None = None


def full_size_rows(rows: list[dict]) -> list[dict]:
    """The rows of a run at its full size: what the usual sections of the report show (all rows but a sweep's)."""
    full = full_bytes(rows)
    if not is_sweep(rows) or full is None:
        return rows
    return [r for r in rows if r.get("engine_kv_bytes") == full]


@dataclass(frozen=True)
class SizePoint:
    """One mode at one size and concurrency: its throughput (output tok/s) and TTFT p50, each with its range and
    its ratio to vLLM alone at full size, and its hit ratio (figures None where the cell did not run)."""

    mode: str
    concurrency: int
    kv_bytes: int
    share: float
    tokens: int | None
    status: str
    throughput: Measure
    ttft: Measure
    hit_ratio: float | None


def _range(lo: float | None, hi: float | None, repeats: int) -> tuple[float, float] | None:
    """The min-max of a figure over the cell's rounds (None for one round: no spread)."""
    return (lo, hi) if lo is not None and hi is not None and repeats > 1 else None


def points(rows: list[dict], bytes_per_token: int | None = None) -> list[SizePoint]:
    """Every (mode, size, concurrency) row of the sweep as a point, sizes largest first."""
    full = full_bytes(rows)
    sized = [(r, x) for r in rows if (x := Row.model_validate(r)).engine_kv_bytes is not None]
    out = []
    for r, x in sorted(sized, key=lambda rx: (rx[1].concurrency, _mode_rank(rx[1].mode), -rx[1].engine_kv_bytes)):
        base = find_row(rows, BASELINE, x.concurrency, kv_bytes=full) if full is not None else None
        ok = r.get("status") == "ok"
        out.append(SizePoint(
            mode=x.mode, concurrency=x.concurrency, kv_bytes=x.engine_kv_bytes,
            share=0.0 if x.engine_kv_share is None else x.engine_kv_share,
            tokens=x.engine_kv_bytes // bytes_per_token if bytes_per_token else None,
            status=r.get("status", "?"),
            throughput=Measure(x.output_tok_s, _range(x.output_tok_s_min, x.output_tok_s_max, x.repeats),
                               Paired.of(paired(r, base, "output_tok_s")) if base else None) if ok else Measure(),
            ttft=Measure(x.ttft_p50_s, _range(x.ttft_p50_s_min, x.ttft_p50_s_max, x.repeats),
                         Paired.of(paired(r, base, "ttft_p50_s")) if base else None) if ok else Measure(),
            hit_ratio=x.hit_ratio if ok else None))  # fmt: skip
    return out


def _mode_rank(mode: str) -> int:
    return MODE_ORDER.index(mode) if mode in MODE_ORDER else len(MODE_ORDER)


def give_back(pts: list[SizePoint], concurrency: int, mode: str = "prefetch") -> SizePoint | None:
    """The smallest size at which `mode` keeps `GIVE_BACK_SHARE` of vLLM alone's full-size throughput (the
    paired median, as the issue reads it; the report prints the rounds' range beside it); None if at no size."""
    ours = [p for p in pts if p.mode == mode and p.concurrency == concurrency and p.throughput.vs_full is not None]
    keeps = [p for p in ours if p.throughput.vs_full.ratio >= GIVE_BACK_SHARE]
    return min(keeps, key=lambda p: p.kv_bytes, default=None)


def _at(pts: list[SizePoint], mode: str, c: int, share: float) -> SizePoint | None:
    return next((p for p in pts if p.mode == mode and p.concurrency == c and abs(p.share - share) < 1e-6), None)


def goals(pts: list[SizePoint], concurrency: int) -> list[dict]:
    """The issue's goals at `GOAL_SHARE` of the full size, each {"goal", "met" (True/False/None: not measured),
    "figure"}; met only where the paired ratios' whole range passes, not their median alone."""
    return [g.as_dict() for g in _goals(pts, concurrency)]


def _goals(pts: list[SizePoint], concurrency: int) -> list[MemoryGoal]:
    ours, alone = _at(pts, "prefetch", concurrency, GOAL_SHARE), _at(pts, BASELINE, concurrency, GOAL_SHARE)
    share = f"{GOAL_SHARE:g} of the engine KV"
    return [
        MemoryGoal.judge(f"prefetch at {share}: throughput >= {GIVE_BACK_SHARE:.0%} of vLLM alone at full size",
                         ours and ours.throughput.vs_full, lambda x: x >= GIVE_BACK_SHARE),
        MemoryGoal.judge(f"prefetch at {share}: TTFT p50 <= {GOAL_TTFT:g}x vLLM alone's at full size",
                         ours and ours.ttft.vs_full, lambda x: x <= GOAL_TTFT),
        MemoryGoal.judge(f"the workload presses on memory: vLLM alone at {share} loses >= {RECOMPUTE_LOSS:.0%} of its "
                         "throughput", alone and alone.throughput.vs_full, lambda x: x <= 1 - RECOMPUTE_LOSS),
    ]  # fmt: skip


@dataclass(frozen=True)
class MemoryGoal:
    """One of the issue's goals: met where every round passes (None: not judged), and whether the median does."""

    goal: str
    met: bool | None
    figure: str
    median_met: bool | None = None  # None where not judged

    @classmethod
    def judge(cls, goal: str, ratio: Paired | None, passes: Callable[[float], bool]) -> MemoryGoal:
        if ratio is None or ratio.n < 2:  # one round has no spread to judge by: never a pass
            return cls(goal, None, _ratio_text(ratio) if ratio else "not measured")
        worst = passes(ratio.min) and passes(ratio.max)
        return cls(goal, bool(worst), _ratio_text(ratio), bool(passes(ratio.ratio)))

    def as_dict(self) -> dict:
        judged = {} if self.median_met is None else {"median_met": self.median_met}
        return {"goal": self.goal, "met": self.met, **judged, "figure": self.figure}


def _ratio_text(r: Paired | None) -> str:
    if r is None:
        return "-"
    return f"{r.ratio:.2f} ({r.min:.2f}-{r.max:.2f}, {r.n} rounds)"


def _mib(n: int) -> str:
    return f"{n / 2**20:,.0f} MiB"


def _num(x: float | None, f: str) -> str:
    return "-" if x is None else format(x, f)


def _span(r: tuple[float, float] | None, f: str) -> str:
    return "-" if r is None else f"{r[0]:{f}}-{r[1]:{f}}"


def table_lines(pts: list[SizePoint]) -> list[str]:
    out = ["| mode | conc | engine KV | share | tokens | out tok/s | min-max | vs vLLM alone at full | TTFT p50 s "
           "| min-max | vs vLLM alone at full | hit |",
           "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]  # fmt: skip
    for p in pts:
        if p.status != "ok":
            out.append(f"| {p.mode} | {p.concurrency} | {_mib(p.kv_bytes)} | {p.share:.3g} | "
                       f"{_num(p.tokens, ',')} | {p.status} | | | | | | |")  # fmt: skip
            continue
        tput, ttft = p.throughput, p.ttft
        out.append(f"| {p.mode} | {p.concurrency} | {_mib(p.kv_bytes)} | {p.share:.3g} | {_num(p.tokens, ',')} | "
                   f"{_num(tput.median, '.1f')} | {_span(tput.range, '.1f')} | {_ratio_text(tput.vs_full)} | "
                   f"{_num(ttft.median, '.3f')} | {_span(ttft.range, '.3f')} | {_ratio_text(ttft.vs_full)} | "
                   f"{_num(p.hit_ratio and 100 * p.hit_ratio, '.0f')}% |")  # fmt: skip
    return out


def summary_lines(pts: list[SizePoint], concurrency: int) -> list[str]:
    """The memory kvprefetch gives back, and the goals, at one level."""
    full = next((p for p in pts if p.mode == BASELINE and p.concurrency == concurrency and p.share == 1), None)
    found = give_back(pts, concurrency)
    out = []
    if full is not None and full.throughput.median is not None:
        out.append(f"- vLLM alone at full size ({_mib(full.kv_bytes)}): {full.throughput.median:.1f} output tok/s, "
                   f"TTFT p50 {full.ttft.median:.3f} s (medians).")  # fmt: skip
    if found is None:
        out.append(f"- **Memory given back at c={concurrency}: none**: prefetch keeps {GIVE_BACK_SHARE:.0%} of that "
                   "throughput at no size below the full one.")  # fmt: skip
    else:
        freed = full.kv_bytes - found.kv_bytes if full else 0
        kept = found.throughput.vs_full
        out.append(f"- **Memory given back at c={concurrency}: {1 - found.share:.0%} of the engine's KV "
                   f"({_mib(freed)} of {_mib(full.kv_bytes) if full else '?'})**: the smallest size at which prefetch "
                   f"keeps >= {GIVE_BACK_SHARE:.0%} of vLLM alone's full-size throughput (paired median) is "
                   f"{found.share:g} ({_mib(found.kv_bytes)}): throughput {_ratio_text(kept)}, "
                   f"TTFT p50 {_ratio_text(found.ttft.vs_full)} of vLLM alone at full size; "
                   f"{'every round' if kept.min >= GIVE_BACK_SHARE else 'not every round'} kept "
                   f"{GIVE_BACK_SHARE:.0%} there.")  # fmt: skip
    for g in _goals(pts, concurrency):
        verdict = {True: "met", False: "NOT met", None: "not judged (fewer than 2 rounds)"}[g.met]
        if g.figure == "not measured":
            verdict = "not measured"
        if g.met is False and g.median_met:
            verdict = "NOT met in every round (the median passes)"
        out.append(f"- Goal ({g.goal}): {g.figure}: **{verdict}**")
    return out


def markdown_lines(results: dict) -> list[str]:
    """report.md's engine-memory section ([] unless the run swept engine sizes)."""
    rows = results.get("rows", [])
    if not is_sweep(rows):
        return []
    bpt = results.get("model", {}).get("bytes_per_token")
    pts = points(rows, bpt)
    levels = sorted({p.concurrency for p in pts})
    out = ["## Engine memory (the whitepaper's R5)", "",
           "Every mode at every engine KV size on the same workload, the rounds interleaved across modes and sizes; "
           "ratios are paired with vLLM alone (`recompute`) at the full size in the same round: median (min-max).",
           ""]  # fmt: skip
    w = results.get("workload", {})
    if w.get("prelude_turns") == 0:
        out += [f"Workload: {w.get('name')}, each conversation's {w.get('measured_turns')} turns inside the cell "
                "(nothing stored before it, each round's prompts new): a turn's prefix is what its own conversation "
                "computed seconds before, which vLLM alone keeps only while its KV cache holds every active "
                "conversation.", ""]  # fmt: skip
    for c in levels:
        out += [*summary_lines(pts, c), ""]
    out += [*table_lines(pts), "", "![engine memory](engine_memory.png)", ""]
    return out


def terminal_lines(results: dict) -> list[str]:
    rows = results.get("rows", [])
    if not is_sweep(rows):
        return []
    pts = points(rows, results.get("model", {}).get("bytes_per_token"))
    return [line.removeprefix("- ").replace("**", "") for c in sorted({p.concurrency for p in pts})
            for line in summary_lines(pts, c)]  # fmt: skip


def plots(results: dict, out: Path) -> list[str]:
    """engine_memory.png: output throughput and TTFT p50 against the engine's KV size, a line per mode with
    its rounds' range, the 90% line of vLLM alone at full size and the size given back."""
    rows = results.get("rows", [])
    if not is_sweep(rows):
        return []
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    every = points(rows)
    pts = [p for p in every if p.status == "ok"]
    c = max((p.concurrency for p in pts), default=None)
    pts = [p for p in pts if p.concurrency == c]
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(7, 7), sharex=True)
    for mode in dict.fromkeys(p.mode for p in pts):
        mine = sorted((p for p in pts if p.mode == mode), key=lambda p: p.kv_bytes)
        xs = [p.kv_bytes / 2**20 for p in mine]
        for ax, measures in ((top, [p.throughput for p in mine]), (bottom, [p.ttft for p in mine])):
            ys = [m.median for m in measures]
            lo = [y - (m.range or (y, y))[0] for m, y in zip(measures, ys, strict=True)]
            hi = [(m.range or (y, y))[1] - y for m, y in zip(measures, ys, strict=True)]
            ax.errorbar(xs, ys, yerr=[lo, hi], marker="o", capsize=3, label=_label(mode))
    full = next((p for p in pts if p.mode == BASELINE and p.share == 1), None)
    if full is not None and full.throughput.median:
        top.axhline(GIVE_BACK_SHARE * full.throughput.median, color="gray", linestyle=":", linewidth=1,
                    label=f"{GIVE_BACK_SHARE:.0%} of vLLM alone at full size")  # fmt: skip
    if c is not None and (found := give_back(every, c)) is not None:
        for ax in (top, bottom):
            ax.axvline(found.kv_bytes / 2**20, color="green", linestyle="--", linewidth=1)
    _axes(top, bottom, c, sorted({p.kv_bytes: p.share for p in pts}.items()))
    plotting.save(fig, bottom, out / "engine_memory.png", legend=False)
    return ["engine_memory.png"]


def _axes(top, bottom, c: int | None, sizes: list[tuple[int, float]]) -> None:
    """engine_memory.png's labels, and its x axis: the sizes measured, in MiB with their share."""
    top.set_ylabel("output tokens/s")
    top.set_title(f"Throughput and TTFT against the engine's KV cache (c={c})")
    bottom.set_ylabel("TTFT p50 (s)")
    bottom.set_xlabel("engine KV cache, MiB (share of the full size)")
    for ax in (top, bottom):
        ax.set_xscale("log", base=2)
        ax.set_xticks([b / 2**20 for b, _ in sizes], [f"{b / 2**20:,.0f}\n({share:g})" for b, share in sizes])
        ax.minorticks_off()
    top.grid(True, alpha=0.3)
    top.legend(fontsize=8)


def _label(mode: str) -> str:
    return {"recompute": "recompute (vLLM alone)", "dram": "dram (all in DRAM)"}.get(mode, mode)
