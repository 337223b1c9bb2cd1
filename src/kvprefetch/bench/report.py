"""results.json, report.md, plots and the terminal table of a `kvprefetch bench` run."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from pydantic import Field

from kvprefetch.bench import engine_memory_report, plotting
from kvprefetch.bench.agent_report import agent_lines, has_leases, lease_plot
from kvprefetch.bench.modes import known_failure
from kvprefetch.bench.rounds import UNSTEADY_RATIO, find_row, paired, unsteady
from kvprefetch.bench.scenarios import SCENARIOS
from kvprefetch.bench.stats import ratio
from kvprefetch.bench.two_node_report import plots as two_node_plots
from kvprefetch.results import Paired, Row, Topology, View

# The whitepaper's figures, beside the run's against the same baselines
WHITEPAPER_TTFT_VS_NO_PREFETCH = "-26% to -32% TTFT p50 (R2, concurrency 8-32)"
WHITEPAPER_THROUGHPUT_VS_NO_PREFETCH = "+29% to +40% throughput"
WHITEPAPER_VS_RECOMPUTE = "8.6x to 20x faster than recomputing"

TABLE_COLUMNS: list[tuple[str, str, str]] = [
    # (key, header, format)
    ("mode", "mode", "s"),
    ("concurrency", "conc", "d"),
    ("completed", "reqs", "d"),
    ("ttft_p50_s", "TTFT p50 s", ".3f"),
    ("ttft_p50_s", "min-max", "range.3f"),
    ("ttft_p90_s", "p90 s", ".3f"),
    ("ttft_p99_s", "p99 s", ".3f"),
    ("itl_p50_s", "ITL p50 ms", "ms"),
    ("output_tok_s", "out tok/s", ".1f"),
    ("output_tok_s", "min-max", "range.1f"),
    ("requests_per_s", "req/s", ".2f"),
    ("hit_ratio", "hit", "%"),
    ("share_engine", "engine", "%"),
    ("share_dram", "dram", "%"),
    ("share_disk", "disk", "%"),
    ("bytes_disk_read", "disk MiB", "mib"),
    ("prefetch_in_time", "pf ok", "d"),
    ("prefetch_late", "late", "d"),
    ("prefetch_wasted_chunks", "wasted", "d"),
    ("errors", "err", "d"),
    ("helper_cpu_s", "conn CPU s", ".2f"),
    ("foreign_cpu_cores", "other CPU", ".2f"),
]


# ---- what the report reads of results.json (validated where it is read; a partial run's parts may be missing) ----
class RankBytes(View):
    """What one tensor-parallel rank's worker moved in a cell."""

    loaded_bytes: float
    saved_bytes: float
    prefetched_chunks: int | float
    reached_in_dram_chunks: int | float
    reached_hit_chunks: int | float


class Cell(Row):
    """A row as the report reads it: `Row`, its rounds (`rounds.aggregate`'s by_round: figure -> round -> value,
    keys as the run gave them), its per-rank bytes and its TTFT samples."""

    by_round: dict[str, dict[Any, Any]] = Field(default_factory=dict)
    ranks: dict[str, RankBytes] | None = None
    ttft_samples_s: list[float] | None = None


def cells(rows: list[dict]) -> list[Cell]:
    return [Cell.model_validate(r) for r in rows]


class StorageReads(View):
    """How the run's storage read: natively, the throttle's target, as measured (in parallel and one at a time)
    and as the emulated array's streams (`kvprefetch.bench.regime`); absent where the run did not measure it."""

    native_read_bps: float | None = None
    native_regime: float | None = None  # R at the native speed
    target_read_bps: float | None = None
    read_bps: float | None = None
    stream_read_bps: float | None = None  # one read stream's cap
    array_streams: float | None = None
    io_threads: int | None = None  # the parallel modes' reads in flight
    serial_read_bps: float | None = None
    measured_serial: float | None = None  # R with one read in flight


class RegimeSeen(StorageReads):
    """results.json's regime as the report reads it: what was asked (R as given, or "native"), how it was
    enforced, and what the run measured (absent in a run that stopped before measuring)."""

    asked: Any = None
    measured: int | float | None = None
    enforced_by: str | None = None
    whitepaper_r2: str | None = None
    whitepaper_storage_share: dict[str, float] | None = None  # a version-1 file's (`_whitepaper_shares`)
    prefill_tokens_per_s: float | None = None
    chunk_tokens: int | None = None
    chunk_bytes: float = 0


class TraceSample(View):
    """How a trace replay sampled its conversations (`kvprefetch.workload.sampling`'s summary)."""

    full_trace_ideal_hit_ratio: float
    sample_ideal_hit_ratio: float
    sample_lost_most_reuse: bool = False
    window_start_s: float
    conversations: int
    measured_requests: int
    prelude_prompts: int
    rule: Any = None


class Prediction(View):
    """The simulator's replay of one cell (`runner.simulator_prediction`), beside what the cell measured."""

    mode: str
    concurrency: int
    predicted: float
    measured: float | None = None
    computed_tokens_predicted: int | None = None
    computed_tokens_measured: int | None = None
    engine_cached_tokens_predicted: int | None = None
    engine_cached_tokens_measured: int | None = None


class Comparison(View):
    """Prefetch against one baseline at one level of one regime (`comparisons`): changes are ratio - 1."""

    regime: Any = None
    concurrency: int
    baseline: str
    ttft_p50_change: float | None = None
    ttft_p50_change_range: tuple[float, float] | None = None
    ttft_verdict: str | None = None
    throughput_change: float | None = None
    throughput_change_range: tuple[float, float] | None = None
    throughput_verdict: str | None = None
    ttft_speedup: float | None = None
    rounds: int = 0


class StorageShare(View):
    """Storage's share of ondemand-sync's TTFT p50 at one level (`storage_shares`), median and range."""

    concurrency: int
    share: float
    range: tuple[float, float]


class SweepPoint(View):
    """Prefetch's paired TTFT ratio to one baseline at one level of one regime of a sweep (`sweep_points`)."""

    regime: Any = None
    r: int | float | None = None  # the regime's measured R
    concurrency: int
    baseline: str
    ratio: float
    verdict: str | None = None


def fmt(value: Any, kind: str) -> str:
    if value is None:
        return "-"
    try:
        if kind == "s":
            return str(value)
        if kind == "d":
            return str(int(value))
        if kind == "%":
            return f"{100 * float(value):.0f}%"
        if kind == "ms":
            return f"{1000 * float(value):.1f}"
        if kind == "mib":
            return f"{float(value) / 2**20:.0f}"
        return format(float(value), kind)
    except (TypeError, ValueError):
        return str(value)


def row_cells(row: dict) -> list[str]:
    if row.get("status") not in (None, "ok"):
        cells = [str(row.get("mode")), str(row.get("concurrency")), str(row.get("status"))]
        return cells + ["-"] * (len(TABLE_COLUMNS) - 3)
    return [_range(row, k, f.removeprefix("range")) if f.startswith("range") else fmt(row.get(k), f)
            for k, _, f in TABLE_COLUMNS]  # fmt: skip


def _range(row: dict, key: str, kind: str) -> str:
    """The min-max of a figure over the cell's rounds ("-" for a single round)."""
    lo, hi = row.get(f"{key}_min"), row.get(f"{key}_max")
    if lo is None or hi is None or row.get("repeats", 1) < 2:
        return "-"
    return f"{fmt(lo, kind)}-{fmt(hi, kind)}"


def rich_table(rows: list[dict], title: str = "kvprefetch bench"):
    from rich.table import Table

    table = Table(title=title)
    for i, (_, header, _) in enumerate(TABLE_COLUMNS):
        table.add_column(header, justify="left" if i == 0 else "right", no_wrap=i == 0)
    for row in rows:
        table.add_row(*row_cells(row))
    return table


def _ok(rows: list[dict]) -> list[dict]:
    return [r for r in rows if r.get("status") == "ok"]


def regimes_of(rows: list[dict]) -> list[Any]:
    """The regimes a run measured, in the order it ran them (the first is the run's own)."""
    return list(dict.fromkeys(r.get("regime") for r in rows))


def own_regime(rows: list[dict]) -> list[dict]:
    """The ok rows of the run's own regime (a sweep's others left out)."""
    first = next(iter(regimes_of(rows)), None)
    return [r for r in _ok(rows) if r.get("regime") == first]


SPEED = {"lower": "faster", "higher": "slower"}  # a TTFT ratio's verdict, said of prefetch
BASELINES = ("ondemand-serial", "ondemand-sync", "ondemand", "dram", "recompute", "vllm-example", "lmcache")


def _regime_verdict(reg: RegimeSeen) -> str:
    """' Not obtained: ...' when the measured regime is more than 25% off the one asked (the disk could not
    go as fast as the throttle allowed, or the throttle did not hold), else ''."""
    asked, measured = reg.asked, reg.measured
    if not isinstance(asked, (int, float)) or not measured or abs(measured / asked - 1) <= 0.25:
        return ""
    why = ""
    native, target = reg.native_read_bps, reg.target_read_bps
    if native and target and target > native:
        why = f": the throttle target exceeds what the disk read natively ({native / 1e6:,.0f} MB/s)"
    return f" **Regime not obtained** (asked R = {asked}){why}; the goals are judged in the regime measured."


def comparisons(rows: list[dict]) -> list[dict]:
    """Per concurrency: prefetch against each baseline, paired round by round (`kvprefetch.bench.rounds`):
    TTFT p50 and throughput change (median of the rounds' ratios, with their range and verdict), speed-up."""
    return [x.model_dump() for x in _comparisons(rows)]


def _comparisons(rows: list[dict]) -> list[Comparison]:
    out = []
    levels = _levels(rows)
    for regime, c in ((g, c) for g in regimes_of(rows) for c in levels):
        p = find_row(rows, "prefetch", c, regime)
        if p is None:
            continue
        for base in BASELINES:
            b = find_row(rows, base, c, regime)
            if b is not None:
                out.append(_compare(p, b, base, regime, c))
    return out


def _levels(rows: list[dict]) -> list[int]:
    """The concurrency levels the ok rows measured, lowest first."""
    return sorted({x.concurrency for x in cells(_ok(rows))})


def _compare(p: dict, b: dict, base: str, regime: Any, c: int) -> Comparison:
    """Prefetch's row against a baseline's, paired by round."""
    ttft, thr = (Paired.of(paired(p, b, key)) for key in ("ttft_p50_s", "output_tok_s"))
    return Comparison(
        regime=regime, concurrency=c, baseline=base,
        ttft_p50_change=None if ttft is None else ttft.ratio - 1.0,
        ttft_p50_change_range=None if ttft is None else (ttft.min - 1.0, ttft.max - 1.0),
        ttft_verdict=None if ttft is None else SPEED.get(ttft.verdict, ttft.verdict),
        throughput_change=None if thr is None else thr.ratio - 1.0,
        throughput_change_range=None if thr is None else (thr.min - 1.0, thr.max - 1.0),
        throughput_verdict=None if thr is None else thr.verdict,
        ttft_speedup=None if ttft is None or not ttft.ratio else 1.0 / ttft.ratio,
        rounds=0 if ttft is None else ttft.n,
    )  # fmt: skip


def goals(comp: list[dict]) -> list[dict]:
    """The issue's targets against this run's paired medians: (goal, measured, met). A target is judged only
    where the run measured it, in the run's own regime (the first; a sweep's others are reported beside); a tie
    never counts as a gain."""
    return _goals([Comparison.model_validate(x) for x in comp])


def _goals(comp: list[Comparison]) -> list[dict]:
    first = comp[0].regime if comp else None
    by = {(x.baseline, x.concurrency): x for x in comp if x.regime == first}
    out = []

    def add(goal: str, keys: list[tuple[str, int]], value, test) -> None:
        got = [(k, by[k]) for k in keys if k in by]
        if not got:
            return
        text = ", ".join(f"c={k[1]} {value(x)}" for k, x in got)
        out.append({"goal": goal, "measured": text, "met": all(test(x) for _, x in got)})

    big = sorted({c for _, c in by if c >= 16})
    mid = sorted({c for _, c in by if c >= 8})
    add("TTFT p50 vs ondemand-sync <= -26% (c>=16)", [("ondemand-sync", c) for c in big],
        lambda x: _pct(x.ttft_p50_change),
        lambda x: x.ttft_p50_change <= -0.26 and x.ttft_verdict == "faster")  # fmt: skip
    add("throughput vs ondemand-sync >= +29% (c>=16)", [("ondemand-sync", c) for c in big],
        lambda x: _pct(x.throughput_change),
        lambda x: x.throughput_change >= 0.29 and x.throughput_verdict == "higher")  # fmt: skip
    add("TTFT p50 vs ondemand-serial <= -30% (c>=8)", [("ondemand-serial", c) for c in mid],
        lambda x: _pct(x.ttft_p50_change),
        lambda x: x.ttft_p50_change <= -0.30 and x.ttft_verdict == "faster")  # fmt: skip
    # within the spread of dram's: storage hidden
    add("TTFT p50 <= 1.10x dram (c>=8)", [("dram", c) for c in mid],
        lambda x: f"{1 + x.ttft_p50_change:.2f}x" + (" (a tie)" if x.ttft_verdict == "tie" else ""),
        lambda x: x.ttft_p50_change <= 0.10 or x.ttft_verdict == "tie")  # fmt: skip
    add("TTFT p50 >= 8.6x faster than recompute (c=16)", [("recompute", 16)],
        lambda x: f"{x.ttft_speedup:.1f}x", lambda x: x.ttft_speedup >= 8.6)  # fmt: skip
    add("never slower than ondemand or ondemand-sync beyond the spread",
        [(b, c) for b in ("ondemand", "ondemand-sync") for c in sorted({c for _, c in by})],
        lambda x: x.ttft_verdict, lambda x: x.ttft_verdict != "slower")  # fmt: skip
    return out


def storage_shares(rows: list[dict]) -> list[dict]:
    """Per concurrency of the run's own regime: the share of ondemand-sync's TTFT p50 that storage takes,
    1 - dram / ondemand-sync paired round by round (median and range). Prefetch cannot beat every chunk already
    being in DRAM, so this share is the most prefetch can cut from on-demand TTFT here."""
    return [x.model_dump() for x in _storage_shares(rows)]


def _storage_shares(rows: list[dict]) -> list[StorageShare]:
    regimes = regimes_of(rows)
    out = []
    for c in _levels(rows):
        sync, dram = (find_row(rows, m, c, regimes[0] if regimes else None) for m in ("ondemand-sync", "dram"))
        pr = Paired.of(paired(dram, sync, "ttft_p50_s")) if sync and dram else None
        if pr is not None:
            out.append(StorageShare(concurrency=c, share=1.0 - pr.ratio, range=(1.0 - pr.max, 1.0 - pr.min)))
    return out


def _whitepaper_shares(results: dict, levels: list[int]) -> dict[int, float]:
    """R2's storage share at each level by the simulator's fit (`regime.whitepaper_storage_share`), as a
    version-1 results file recorded it, else computed now (a fraction of a second per level)."""
    recorded = RegimeSeen.model_validate(results.get("regime", {})).whitepaper_storage_share
    if recorded:
        return {int(k): v for k, v in recorded.items()}
    from kvprefetch.bench.regime import whitepaper_storage_share

    return whitepaper_storage_share(levels)


def _share_lines(results: dict, comp: list[Comparison]) -> list[str]:
    shares = _storage_shares(results.get("rows", []))
    if not shares:
        return []
    r2 = _whitepaper_shares(results, [x.concurrency for x in shares])
    cut = {x.concurrency: x.ttft_p50_change for x in comp
           if x.baseline == "ondemand-sync" and x.regime == comp[0].regime}  # fmt: skip
    lines = ["## How much of on-demand TTFT is storage", "",
             "Storage's share of ondemand-sync's TTFT p50 is 1 - dram / ondemand-sync (paired by round): the most "
             "that hiding storage can cut, since prefetch cannot beat every chunk already being in DRAM. The "
             "whitepaper's -26..-32% needs a share at least that large; R2's, by the simulator's fit of it, is "
             "in the last column.", "",
             "| conc | storage share | range | prefetch vs ondemand-sync | R2's share (simulator) |",
             "|---:|---:|---:|---:|---:|"]  # fmt: skip
    for x in shares:
        c = x.concurrency
        paper = f"{100 * r2[c]:.0f}%" if c in r2 else "-"
        lo, hi = x.range
        spread = "-" if lo == hi else f"{100 * lo:.0f}..{100 * hi:.0f}%"
        lines.append(f"| {c} | {100 * x.share:.0f}% | {spread} | {_pct(cut.get(c))} | {paper} |")
    return [*lines, ""]


def sweep_points(results: dict) -> list[dict]:
    """Per further regime of a sweep (and the run's own): measured R, and per concurrency prefetch's paired TTFT
    ratio to ondemand-sync and to dram with their verdicts."""
    return [p.model_dump() for p in _sweep_points(results)]


def _sweep_points(results: dict) -> list[SweepPoint]:
    regimes = [RegimeSeen.model_validate(x) for x in [results.get("regime", {}), *results.get("sweep", [])]]
    measured = {x.asked: x.measured for x in regimes}
    return [SweepPoint(regime=x.regime, r=measured[x.regime], concurrency=x.concurrency, baseline=x.baseline,
                       ratio=1 + x.ttft_p50_change, verdict=x.ttft_verdict)
            for x in _comparisons(results.get("rows", []))
            if x.baseline in ("ondemand-sync", "dram") and x.regime in measured]  # fmt: skip


def pays_from(points: list[dict]) -> float | None:
    """The smallest measured R from which prefetch is faster than ondemand-sync at every queued level (c >= 8,
    or every level if none queue) in every regime at or above it; None if it never is."""
    return _pays_from([SweepPoint.model_validate(p) for p in points])


def _pays_from(points: list[SweepPoint]) -> float | None:
    sync = [p for p in points if p.baseline == "ondemand-sync" and p.r is not None]
    levels = {p.concurrency for p in sync}
    queued = {c for c in levels if c >= 8} or levels
    by_r: dict[float, bool] = {}
    for p in sync:
        if p.concurrency in queued:
            by_r[p.r] = by_r.get(p.r, True) and p.verdict == "faster"
    best = None
    for r in sorted(by_r, reverse=True):
        if not by_r[r]:
            break
        best = r
    return best


def _pct(x: float | None) -> str:
    return "-" if x is None else f"{100 * x:+.0f}%"


def _pct_range(r: tuple[float, float] | None) -> str:
    return "-" if r is None or r[0] == r[1] else f"{_pct(r[0])}..{_pct(r[1])}"


PLOT_LINES = ["## Plots", "", "![TTFT p50](ttft_p50.png)", "![throughput](throughput.png)", "![TTFT CDF](ttft_cdf.png)",
              ""]  # fmt: skip


def markdown_report(results: dict) -> str:
    """report.md: its sections in order, each built from the results on its own; an engine-memory sweep's
    sizes in a section of their own, the others showing the full size's rows."""
    sweep = engine_memory_report.markdown_lines(results)
    results = at_full_size(results)
    rows = results.get("rows", [])
    agent = results.get("workload", {}).get("kind") == "agent" or has_leases(rows)
    sections = [
        _header_lines(results),
        _setup_lines(results),
        _regime_lines(RegimeSeen.model_validate(results.get("regime", {})), results.get("config", {})),
        _results_lines(rows),
        sweep,
        unsteady_lines(rows),
        _rank_lines(rows),
        _against_baselines_lines(results, _comparisons(rows)),
        agent_lines(results) if agent else [],
        *(scenario.report(results) for scenario in SCENARIOS.values()),  # each scenario's own section
        _simulator_lines(results),
        _missing_lines(rows),
        _notes_lines(results.get("notes")),
        PLOT_LINES,
    ]
    return "\n".join(line for section in sections for line in section)


def _header_lines(results: dict) -> list[str]:
    """The title, when and where the run ran, with which versions and which model."""
    m = results.get("machine", {})
    model = results.get("model", {})
    return [
        "# kvprefetch bench",
        "",
        f"Started {results.get('started')}, took {results.get('duration_s', 0):.0f} s. "
        f"Machine: {m.get('cpu', '?')} x{m.get('cpus')}, {m.get('gpu', 'no GPU')}; "
        f"load average at start {_load(m.get('loadavg_start'))}, at end {_load(m.get('loadavg_end'))}.",
        f"Versions: {', '.join(f'{k} {v}' for k, v in results.get('versions', {}).items())}.",
        f"Model: `{model.get('path')}` ({model.get('load_format') or 'weights'}, {model.get('dtype')}, "
        f"{model.get('bytes_per_token')} KV bytes/token) on {model.get('device')}.",
    ]


def _setup_lines(results: dict) -> list[str]:
    """The workload, its prelude and reuse, and the engine's KV cache against the largest level's prompts."""
    w = results.get("workload", {})
    cfg = results.get("config", {})
    kv, ws = cfg.get("engine_kv_cache_tokens") or 0, w.get("largest_level_prompt_tokens") or 0
    fits = "too small to hold it, as intended" if kv < ws else "**WARNING: it holds the whole level; raise the load**"
    return ["", "## Setup", "",
            f"- Workload: **{w.get('name')}**; declared: `{_declared(w)}`.",
            f"- Prelude (populates the disk tier before any mode runs): {w.get('prelude_tokens')} tokens. "
            f"Measured prompts: {w.get('measured_prompt_tokens')} tokens, of which "
            f"{100 * w.get('reusable_share', 0):.0f}% are whole chunks some earlier request holds.",
            f"- Engine KV cache: {kv} tokens vs {ws} prompt tokens at the largest level ({fits}); "
            f"max_num_seqs {cfg.get('max_num_seqs')}, max_num_batched_tokens "
            f"{cfg.get('max_num_batched_tokens')}, chunk {cfg.get('chunk_tokens')} tokens, DRAM tier "
            f"{cfg.get('dram_tier_bytes', 0) / 2**20:.0f} MiB (dram mode: everything).",
            *trace_reuse_lines(results)]  # fmt: skip


def _regime_lines(reg: RegimeSeen, cfg: dict) -> list[str]:
    """The storage regime asked and measured, how it was enforced, and where the engines ran."""
    asked = reg.asked
    lines = ["", "## Storage regime", "", f"- Asked: {asked if asked == 'native' else f'R = {asked}'}; "
             f"enforced by: {reg.enforced_by}."]  # fmt: skip
    if reg.whitepaper_r2:
        lines.append(f"- The default (R = 18.2) is {reg.whitepaper_r2}.")
    if reg.prefill_tokens_per_s:
        lines.append(f"- Prefill {reg.prefill_tokens_per_s:,.0f} tokens/s -> recompute one chunk "
                     f"({reg.chunk_tokens} tokens, {reg.chunk_bytes / 2**20:.2f} MiB) in "
                     f"{1000 * reg.chunk_tokens / reg.prefill_tokens_per_s:.1f} ms.")  # fmt: skip
    if reg.native_read_bps:
        lines.append(f"- Native cold disk->DRAM reads: {reg.native_read_bps / 1e6:,.0f} MB/s "
                     f"(R = {reg.native_regime or 0:.1f}).")  # fmt: skip
    if reg.target_read_bps:
        lines.append(f"- Throttle target {reg.target_read_bps / 1e6:,.1f} MB/s.")
    if reg.read_bps:
        lines.append(f"- **Measured regime R = {reg.measured or 0:.1f}** "
                     f"(reads at {reg.read_bps / 1e6:,.1f} MB/s).{_regime_verdict(reg)}")  # fmt: skip
    if reg.stream_read_bps:
        lines.append(f"- Emulated array: one read stream capped at {reg.stream_read_bps / 1e6:,.1f} MB/s, "
                     f"1/{reg.array_streams or 0:.2f} of the regime's bandwidth, as the whitepaper's array "
                     f"read 0.98 GB/s with one read and 5.23 GB/s with parallel ones (R1); the parallel modes keep "
                     f"{reg.io_threads} reads in flight, `ondemand-serial` one.")  # fmt: skip
    if reg.serial_read_bps:
        lines.append(f"- Serial reads (one in flight) measured at {reg.serial_read_bps / 1e6:,.1f} MB/s: "
                     f"R = {reg.measured_serial or 0:.1f}.")  # fmt: skip
    topo = Topology.model_validate(cfg.get("topology") or {})
    if topo.sentence:
        lines.append(f"- Where the engines run: {topo.sentence}.")
    return lines


def _results_lines(rows: list[dict]) -> list[str]:
    """The cells' table (one per regime of a sweep, the run's own first) and what its columns mean."""
    lines = ["", "## Results", ""]
    regimes = regimes_of(rows)
    for g in regimes:
        if len(regimes) > 1:
            lines += ["", f"### regime {g}" + (" (the run's own)" if g == regimes[0] else ""), ""]
        lines += markdown_table([r for r in rows if r.get("regime") == g])
    return [*lines, "", "Shares are of prompt tokens: engine = vLLM's own prefix cache, dram/disk = loaded by the "
            "connector (disk: chunks read from disk during the cell), the rest is computed. `pf ok` / `late`: "
            "requests whose prefetch had / had not finished when the scheduler reached them; `wasted`: prefetch "
            "reads cancelled because their request ended first. `conn CPU s`: CPU seconds the connector's own "
            "threads took (loads, saves, disk I/O; on the host cores with the gpu-node topology, else time the model "
            "did not get). `other CPU`: "
            "cores other processes kept busy during the cell (this machine is shared; timings with a large value "
            "are disturbed).", ""]  # fmt: skip


def _against_baselines_lines(results: dict, comp: list[Comparison]) -> list[str]:
    """Prefetch against the baselines, storage's share of on-demand TTFT, a sweep's regimes and issue 19's goals
    (those of the context workload: the agent workload's own are in its section); nothing if nothing compares."""
    if not comp:
        return []
    points = _sweep_points(results)
    sweep = _sweep_lines(points) if len({x.regime for x in points}) > 1 else []
    own_goals = _goal_lines(_goals(comp)) if results.get("workload", {}).get("kind") != "agent" else []
    return [*_baseline_lines(comp), *_share_lines(results, comp), *sweep, *own_goals]


def _baseline_lines(comp: list[Comparison]) -> list[str]:
    """Prefetch / each baseline in the run's own regime, paired by round, beside the whitepaper's figures."""
    lines = ["## prefetch against the baselines, next to the whitepaper", "",
             "Paired: prefetch / baseline within each round, then the median of the rounds' ratios and their "
             "range; a range that contains 0% is a tie.",
             "", "| conc | baseline | TTFT p50 | range | verdict | throughput | range | TTFT speed-up | whitepaper |",
             "|---:|---|---:|---:|---|---:|---:|---:|---|"]  # fmt: skip
    several = len({x.regime for x in comp}) > 1
    for x in comp:
        if several and x.regime != comp[0].regime:
            continue  # a sweep's other regimes: in the sweep section
        speed = "-" if x.ttft_speedup is None else f"{x.ttft_speedup:.2f}x"
        lines.append(f"| {x.concurrency} | {x.baseline} | {_pct(x.ttft_p50_change)} | "
                     f"{_pct_range(x.ttft_p50_change_range)} | {x.ttft_verdict} | "
                     f"{_pct(x.throughput_change)} | {_pct_range(x.throughput_change_range)} | {speed} | "
                     f"{_whitepaper(x.baseline)} |")  # fmt: skip
    return [*lines, ""]


def _whitepaper(baseline: str) -> str:
    """The whitepaper's figures against a baseline ("" where it has none)."""
    if baseline in ("ondemand-serial", "ondemand-sync", "ondemand"):
        return f"{WHITEPAPER_TTFT_VS_NO_PREFETCH}; {WHITEPAPER_THROUGHPUT_VS_NO_PREFETCH}"
    return WHITEPAPER_VS_RECOMPUTE if baseline == "recompute" else ""


def _goal_lines(g: list[dict]) -> list[str]:
    """Issue 19's goals, met or not (nothing where none was measured)."""
    if not g:
        return []
    return ["## Goals (issue 19), on this run's paired medians", "", "| goal | measured | met |", "|---|---|---|",
            *(f"| {x['goal']} | {x['measured']} | {'yes' if x['met'] else '**no**'} |" for x in g), ""]  # fmt: skip


def _simulator_lines(results: dict) -> list[str]:
    """The simulator's TTFT p50 and token counts, calibrated from this run, beside the measured ones."""
    preds = [Prediction.model_validate(p) for p in results.get("simulator_prediction") or []]
    if not preds:
        return []
    lines = ["## Simulator (calibrated from this run) vs measured TTFT p50", "", *_calibration_lines(results),
             "| mode | conc | predicted s | measured s | computed tokens, replay / vLLM "
             "| tokens from vLLM's prefix cache, replay / vLLM |",
             "|---|---:|---:|---:|---:|---:|"]  # fmt: skip
    for p in preds:
        meas = "-" if p.measured is None else f"{p.measured:.3f}"
        tokens = (f"{_replay_vs_vllm(p.computed_tokens_predicted, p.computed_tokens_measured)} | "
                  f"{_replay_vs_vllm(p.engine_cached_tokens_predicted, p.engine_cached_tokens_measured)}")  # fmt: skip
        lines.append(f"| {p.mode} | {p.concurrency} | {p.predicted:.3f} | {meas} | {tokens} |")
    return [*lines, ""]


def _missing_lines(rows: list[dict]) -> list[str]:
    """Each mode with a cell that did not run or failed, and why (its last such cell's reason, and the known
    failure it matches)."""
    missing = {}
    for r in cells(rows):
        if r.status != "ok":
            why = known_failure(r.mode, r.reason)
            missing[r.mode] = f"{r.status}: {r.reason}" + (f" (known: {why})" if why else "")
    if not missing:
        return []
    return ["## Modes not run (or failed)", "", *(f"- `{k}`: {v}" for k, v in missing.items()), ""]


def _notes_lines(notes: list[str] | None) -> list[str]:
    """The run's notes, the first line of each."""
    if not notes:
        return []
    return ["## Notes", "", *(f"- {n.splitlines()[0] if n else n}" for n in notes), ""]


def _sweep_lines(points: list[SweepPoint]) -> list[str]:
    lines = ["## Regime sweep: prefetch's TTFT p50 relative to ondemand-sync and to dram, against R", "",
             "| regime | measured R | conc | / ondemand-sync | verdict | / dram | verdict |",
             "|---|---:|---:|---:|---|---:|---|"]  # fmt: skip
    keyed = {(p.regime, p.concurrency, p.baseline): p for p in points}
    for regime, c in dict.fromkeys((p.regime, p.concurrency) for p in points):
        sync, dram = keyed.get((regime, c, "ondemand-sync")), keyed.get((regime, c, "dram"))
        r = next(p.r for p in points if p.regime == regime)
        cells_ = [f"{x.ratio:.2f}x | {x.verdict}" if x else "- | -" for x in (sync, dram)]
        lines.append(f"| {regime} | {_num(r, 1, '.1f')} | {c} | {cells_[0]} | {cells_[1]} |")
    r = _pays_from(points)
    verdict = (f"Prefetch pays (faster than ondemand-sync at every queued level, in every regime from there up) "
               f"from R = {r:.1f}." if r is not None else "Prefetch is not faster than ondemand-sync at every "
               "queued level in the sweep's largest R, so it pays from no R on up.")  # fmt: skip
    lines += ["", verdict, "", "![regime sweep](regime_sweep.png)", ""]
    return lines


def unsteady_lines(rows: list[dict]) -> list[str]:
    """Every flagged cell (`rounds.unsteady`: rounds more than 2x apart) with each round's values: a median and a
    min-max range say that the rounds disagree, not which round went wrong or what else it measured then."""
    flagged = [(Cell.model_validate(r), keys) for r in _ok(rows) if (keys := unsteady(r))]
    if not flagged:
        return []
    lines = [f"## Cells whose rounds are more than {UNSTEADY_RATIO:g}x apart", "",
             "Each round of the flagged cells (noise moves a cell by about 25% here; a round this far from its "
             "sibling is an event of that round). `other CPU`: cores other processes kept busy in that round.", "",
             "| regime | mode | conc | apart in | round | TTFT p50 s | p90 s | out tok/s | hit | other CPU |",
             "|---|---|---:|---|---:|---:|---:|---:|---:|---:|"]  # fmt: skip
    for row, keys in flagged:
        by = row.by_round
        apart = ", ".join("TTFT p50" if k == "ttft_p50_s" else "throughput" for k in keys)
        for k in sorted(by.get("ttft_p50_s", {})):
            vals = [fmt(by.get(key, {}).get(k), f) for key, f in (("ttft_p50_s", ".3f"), ("ttft_p90_s", ".3f"),
                    ("output_tok_s", ".1f"), ("hit_ratio", "%"), ("foreign_cpu_cores", ".2f"))]  # fmt: skip
            lines.append(f"| {row.regime} | {row.mode} | {row.concurrency} | {apart} | {int(k) + 1} | "
                         + " | ".join(vals) + " |")  # fmt: skip
    return [*lines, ""]


def _rank_lines(rows: list[dict]) -> list[str]:
    """Per tensor-parallel rank, each cell's bytes (only when the engine has more than one rank)."""
    tp = [r for r in cells(_ok(rows)) if len(r.ranks or {}) > 1]
    if not tp:
        return []
    lines = ["## Per tensor-parallel rank", "",
             "Each rank stores its own part of every chunk (its KV heads) under keys of its own. `loaded` / `saved`: "
             "MiB the rank's worker copied into / out of the engine; `prefetched`: its chunk reads started into "
             "DRAM; `in DRAM when reached`: of its hit chunks, those already in DRAM when the scheduler reached "
             "their request.", "",
             "| mode | conc | rank | loaded MiB | saved MiB | prefetched | in DRAM when reached |",
             "|---|---:|---:|---:|---:|---:|---:|"]  # fmt: skip
    for row in tp:
        for rank, v in (row.ranks or {}).items():
            lines.append(f"| {row.mode} | {row.concurrency} | {rank} | {v.loaded_bytes / 2**20:.1f} | "
                         f"{v.saved_bytes / 2**20:.1f} | {v.prefetched_chunks} | "
                         f"{v.reached_in_dram_chunks} / {v.reached_hit_chunks} |")  # fmt: skip
    return [*lines, ""]


def _replay_vs_vllm(got: int | None, want: int | None) -> str:
    """A token count the replay predicted beside the one vLLM reported ("-" where the run did not say)."""
    return "-" if got is None or want is None else f"{got} / {want}"


def _engine_calibrations(results: dict) -> dict[str, dict]:
    """Every engine's calibration, by engine, as `BenchResults.engine_calibrations` reads them; from the results
    dict itself, since a report also shows partial runs, which the schema does not accept."""
    first = (results.get("populate") or {}).get("calibration") or {}
    return {"populate": first, **(results.get("mode_calibrations") or {})}


def _calibration_lines(results: dict) -> list[str]:
    """Each engine's calibrated speeds, and the medians the replay takes: how noisy one engine's would have been."""
    engines = _engine_calibrations(results)
    if len(engines) < 2:
        return []
    pooled = {"**median (the replay's)**": results.get("calibration") or {}}
    lines = ["| engine | prefill tok/s | decode step ms | 4 long decoding, step ms |", "|---|---:|---:|---:|"]
    for name, cal in (engines | pooled).items():
        prefill = _num(cal.get("prefill_tokens_per_s"), 1, ".0f")
        step, batch = _num(cal.get("decode_step_s"), 1e3, ".1f"), _num(cal.get("decode_batch_step_s"), 1e3, ".1f")
        lines.append(f"| {name} | {prefill} | {step} | {batch} |")
    head = f"Calibrated on {len(engines)} engines: the populating one, and each simulated mode's after its cells."
    return [head, "", *lines, ""]


def _num(x, scale: float, fmt: str) -> str:
    return "-" if x is None else format(x * scale, fmt)


def _load(x) -> str:
    return "-" if not x else "/".join(f"{v:.2f}" for v in x)


def _declared(w: dict) -> str:
    keep = {k: v for k, v in w.items() if k not in ("name", "prompt_tokens", "reusable_tokens", "reusable_share",
                                                    "prelude_tokens", "measured_prompt_tokens",
                                                    "largest_level_prompt_tokens")}  # fmt: skip
    return json.dumps(keep, sort_keys=True)


def achieved_hit_ratios(rows: list[dict]) -> dict[str, float]:
    """Each mode's hit ratio over all its levels (weighted by their prompt tokens), in the run's own regime."""
    own = cells(own_regime(rows))
    out: dict[str, float] = {}
    for m in dict.fromkeys(r.mode for r in own):
        mine = [r for r in own if r.mode == m and r.prompt_tokens]
        tokens = sum(r.prompt_tokens or 0 for r in mine)
        if tokens:
            out[m] = sum((r.hit_ratio or 0.0) * (r.prompt_tokens or 0) for r in mine) / tokens
    return out


def trace_reuse_lines(results: dict) -> list[str]:
    """A trace replay's reuse side by side: the whole trace's ideal hit ratio, the sample's, the replayed
    prompts' (whole chunks), and what each mode achieved; a warning when the sample lost most of the reuse."""
    w = results.get("workload", {})
    if not w.get("sample"):
        return []
    sample = TraceSample.model_validate(w.get("sample"))
    full, ideal = sample.full_trace_ideal_hit_ratio, sample.sample_ideal_hit_ratio
    chunks = w.get("reusable_share")
    lines = ["", "## Reuse: the trace, the replayed sample, each mode", "",
             f"Sample: {sample.conversations} conversations ({sample.measured_requests} requests) from "
             f"{sample.window_start_s:.0f} s into the trace on, {sample.prelude_prompts} prelude prompts; "
             f"rule: {sample.rule} (declared above).", "",
             "| | hit ratio | / sample ideal | / replayed ideal |", "|---|---:|---:|---:|",
             f"| full trace, ideal (unbounded cache, blocks) | {100 * full:.1f}% | | |",
             f"| sample, ideal (blocks) | {100 * ideal:.1f}% | | |"]  # fmt: skip
    if chunks is not None:
        lines.append(f"| replayed prompts, ideal (whole chunks, tokens) | {100 * chunks:.1f}% | | |")
    for m, got in achieved_hit_ratios(results.get("rows", [])).items():
        lines.append(f"| {m}, achieved | {100 * got:.1f}% | {fmt(ratio(got, ideal), '.2f')} | "
                     f"{fmt(ratio(got, chunks), '.2f')} |")  # fmt: skip
    if sample.sample_lost_most_reuse:
        lines += ["", f"**WARNING: the sample lost most of the trace's reuse** (ideal {100 * ideal:.0f}% vs "
                  f"{100 * full:.0f}%): start the window later (--trace-window-start) or allow longer "
                  "prompts."]  # fmt: skip
    if note := w.get("length_scale_note"):
        lines += ["", f"Length scale corrected: {note}."]
    return lines


def markdown_table(rows: list[dict]) -> list[str]:
    head = [h for _, h, _ in TABLE_COLUMNS]
    out = ["| " + " | ".join(head) + " |", "|" + "|".join("---" if i == 0 else "---:" for i in range(len(head))) + "|"]
    for r in rows:
        out.append("| " + " | ".join(c.replace("|", "/") for c in row_cells(r)) + " |")
    return out


def at_full_size(results: dict) -> dict:
    """The results with only the full size's rows (an engine-memory sweep's other sizes have their own
    section and plot; every other run is returned as it is)."""
    rows = results.get("rows", [])
    full = engine_memory_report.full_size_rows(rows)
    return results if full is rows else results | {"rows": full}


def plots(results: dict, out: Path) -> list[str]:
    """ttft_p50.png and throughput.png against concurrency, a line per mode, and ttft_cdf.png at the highest
    level, in the run's own regime at its full size; regime_sweep.png for a sweep."""
    rows = cells(own_regime(at_full_size(results).get("rows", [])))
    modes = list(dict.fromkeys(r.mode for r in rows))
    label = _regime_label(results)
    written = [
        _level_plot(rows, modes, lambda r: r.ttft_p50_s, "TTFT p50 (s)", f"Time to first token, median ({label})",
                    out / "ttft_p50.png", log=bool(rows)),
        _level_plot(rows, modes, lambda r: r.output_tok_s, "output tokens/s", f"Throughput ({label})",
                    out / "throughput.png", log=False),
        _cdf_plot(rows, modes, label, out / "ttft_cdf.png"),
    ]  # fmt: skip
    points = [p for p in _sweep_points(results) if p.r is not None]
    if len({p.regime for p in points}) > 1:
        written.append(_sweep_plot(points, out / "regime_sweep.png"))
    return written


def _level_plot(rows: list[Cell], modes: list[str], figure_of, ylabel: str, title: str, path: Path, log: bool) -> str:
    """A figure of every mode's cells against concurrency."""
    fig, ax = plotting.figure()
    for m in modes:
        pts = sorted((r.concurrency, figure_of(r)) for r in rows if r.mode == m and figure_of(r) is not None)
        if pts:
            ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=m)
    ax.set_xlabel("concurrency")
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    if log:
        ax.set_yscale("log")
    return plotting.save(fig, ax, path, legend=bool(modes))


def _cdf_plot(rows: list[Cell], modes: list[str], label: str, path: Path) -> str:
    """Every mode's TTFT CDF at the highest concurrency every mode ran."""
    fig, ax = plotting.figure()
    levels = sorted({r.concurrency for r in rows})
    c = levels[-1] if levels else None
    for m in modes:
        r = next((x for x in rows if x.mode == m and x.concurrency == c), None)
        xs = sorted(r.ttft_samples_s or []) if r else []
        if xs:
            ax.step(xs, [(i + 1) / len(xs) for i in range(len(xs))], where="post", label=m)
    ax.set_xlabel("TTFT (s)")
    ax.set_ylabel("share of requests")
    ax.set_xscale("log")
    ax.set_title(f"TTFT CDF at concurrency {c} ({label})")
    return plotting.save(fig, ax, path, legend=bool(modes))


def _sweep_plot(points: list[SweepPoint], path: Path) -> str:
    """Prefetch's paired TTFT ratio to each baseline against the sweep's measured R."""
    fig, ax = plotting.figure()
    for (base, c), pts in _series(points).items():
        ax.plot([p.r for p in pts], [p.ratio for p in pts], marker="o" if base == "ondemand-sync" else "s",
                linestyle="-" if base == "ondemand-sync" else "--", label=f"/ {base}, c={c}")  # fmt: skip
    ax.axhline(1.0, color="gray", linewidth=0.8)
    ax.set_xscale("log")
    ax.set_xlabel("R (recompute time / load time per chunk), measured")
    ax.set_ylabel("prefetch TTFT p50 / baseline's")
    ax.set_title("Regime sweep: where prefetch pays")
    return plotting.save(fig, ax, path, fontsize=8)


def _series(points: list[SweepPoint]) -> dict[tuple[str, int], list[SweepPoint]]:
    series: dict[tuple[str, int], list[SweepPoint]] = {}
    for p in sorted(points, key=lambda p: p.r):
        series.setdefault((p.baseline, p.concurrency), []).append(p)
    return series


def _regime_label(results: dict) -> str:
    reg = RegimeSeen.model_validate(results.get("regime", {}))
    if reg.measured:
        return f"R={reg.measured:.1f} measured"
    return f"regime {reg.asked}"


def write_outputs(results: dict, out: Path) -> list[str]:
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(json.dumps(results, indent=2, default=str) + "\n")
    files = ["results.json"]
    if calibration := results.get("calibration"):
        # The simulator's input (kvprefetch.sim.calibration.Calibration), measured by this run.
        (out / "calibration.json").write_text(json.dumps(calibration, indent=2) + "\n")
        files.append("calibration.json")
    files += plots(results, out)
    files += engine_memory_report.plots(results, out)
    files += lease_plot(results, out)
    files += two_node_plots(results, out)
    (out / "report.md").write_text(markdown_report(results))
    files.append("report.md")
    return files
