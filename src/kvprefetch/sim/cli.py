"""`kvprefetch sim`: validation scenarios, free-form runs, and the storage-bandwidth sweep."""

from __future__ import annotations

import time
from enum import StrEnum
from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console
from rich.progress import Progress
from rich.table import Table

from kvprefetch.config import IOConfig
from kvprefetch.results import BenchResults
from kvprefetch.sim.calibration import load_bench_calibration
from kvprefetch.sim.freeform import (
    DEFAULT_MODEL,
    THIS_CPU,
    THIS_DISK,
    Load,
    Setup,
    default_bandwidths,
    parse_workload,
    run_setup,
    sweep_storage_bw,
)
from kvprefetch.sim.policy import Policy
from kvprefetch.sim.scenarios import PUBLISHED, run_whitepaper, scenario_names

console = Console()


class Eviction(StrEnum):
    LRU = "lru"
    QUEUE_AWARE = "queue-aware"


def _number(text: str, option: str, kind: type) -> int | float:
    try:
        return kind(text)
    except ValueError:
        raise ValueError(f"{option} takes comma-separated {kind.__name__}s, got {text!r}") from None


def _run_bench_scenario(results_paths: list[Path] | None, json_path: Path | None) -> None:
    """Our own benchmark predicted from its own calibration: every mode x concurrency cell (medians over runs)."""
    import json as jsonlib

    from kvprefetch.sim.calibration import predict_bench
    from kvprefetch.sim.report import bench_cells, bench_rows, print_rows, write_json

    # a run's output directory stands for its results.json (what `kvprefetch bench` prints it wrote)
    results_paths = [p / "results.json" if p.is_dir() else p for p in results_paths or []]
    missing = [p for p in results_paths if not p.exists()]
    if not results_paths or missing:
        raise typer.BadParameter(
            f"--scenario bench needs --bench-results PATH (repeatable), the results.json of a `kvprefetch bench`"
            f" run (missing: {', '.join(map(str, missing)) or 'none given'})"
        )
    runs = []
    for path in results_paths:
        try:
            runs.append(BenchResults.from_json(jsonlib.loads(path.read_text())))
        except (ValueError, OSError) as err:
            raise typer.BadParameter(f"{path} is not a usable kvprefetch bench results.json: {err!r}") from None
    try:
        predictions = [predict_bench(results) for results in runs]
    except (ValueError, KeyError, TypeError) as err:
        raise typer.BadParameter(f"not a usable kvprefetch bench results.json: {err!r}") from None
    cells = bench_cells(predictions)
    title = "simulated vs measured" + (f" ({results_paths[0]})" if len(runs) == 1 else f", medians of {len(runs)} runs")
    rows = bench_rows(cells)
    print_rows(rows, console, title=title, reference="measured")
    within = sum(abs(r.error_pct) <= 20 for r in rows)
    console.print(f"{within} of {len(rows)} cells within 20%")
    _print_calibration(runs)
    if len(runs) > 1:
        inside = sum(min(m) <= r.simulated <= max(m) for r, (m, _) in zip(rows, cells.values(), strict=True))
        console.print(f"{inside} of {len(rows)} predictions inside the range the runs measured")
    rows += _token_split(predictions)
    rows += _step_checks(results_paths, runs)
    if json_path:
        write_json(rows, json_path)


def _token_split(predictions: list[list[dict]]) -> list:
    """Where the prompt tokens came from, replayed vs measured: those the engine computed and those it found in
    its own prefix cache (the rest were loaded from a tier). Where both agree, the replay found in the engine's
    cache and in the tiers what vLLM and the connector found, and a TTFT error is in the costs."""
    from kvprefetch.sim.report import bench_cells, bench_rows, print_rows

    out = []
    for metric, title, what in (
        ("computed_tokens", "prompt tokens the engine computed (the rest came from its cache or a tier)", "computed"),
        ("engine_cached_tokens", "prompt tokens found in the engine's own prefix cache", "found in its prefix cache"),
    ):
        cells = bench_cells(predictions, f"{metric}_measured", f"{metric}_predicted")
        if not cells:
            continue
        rows = bench_rows(cells, metric=metric, unit="tokens")
        print_rows(rows, console, title=title, reference="measured")
        within = sum(abs(r.error_pct) <= 5 for r in rows)
        console.print(f"{within} of {len(rows)} cells within 5% of the tokens vLLM {what}")
        out += rows
    return out


def _print_calibration(runs: list[BenchResults]) -> None:
    """Say how many engines each run's speeds are medians over, and what the replays charged the steps for the
    connector's copies (or that an older run could not tell)."""
    from kvprefetch.sim.calibration import calibration_from_results, charged_io_cpu

    cals = [calibration_from_results(r) for r in runs]
    engines = ", ".join(str(c.engines) for c in cals)
    console.print(f"calibration: each speed the median over the run's engines ({engines} engines; 1 = an older run)")
    costs = [c.io_cpu_s_per_byte for c in cals]
    if all(k is None for k in costs):
        console.print("these runs did not measure the connector's CPU (an older bench): copies cost the steps nothing")
        return
    each = ", ".join(
        "-" if c.io_cpu_s_per_byte is None
        else f"{charged_io_cpu(c) * 1e9:.2f}" + ("" if c.shared_cores else " (gpu-node: cores of their own)")
        for c in cals
    )  # fmt: skip
    console.print(f"connector CPU per byte moved, charged to the steps: {each} ns/B (each run's prelude)")
    busy = [c for c in cals if c.shared_cores and c.foreign_cpu_cores is not None and c.machine_cpus]
    if busy:
        took = ", ".join(f"{c.foreign_cpu_cores:.2f} of {c.machine_cpus}" for c in busy)
        console.print(f"other processes took {took} cores while the engine calibrated: each cell is replayed at the "
                      "engine's share of the cores in that cell (its row's foreign_cpu_cores)")


def _step_checks(results_paths: list[Path], runs: list[BenchResults]) -> list:
    """The step model on each run's recorded engine steps (`kvprefetch bench --step-log`), where there are any."""
    from kvprefetch.sim.report import print_rows, step_rows
    from kvprefetch.sim.stepcheck import check_run

    rows = []
    for path, results in zip(results_paths, runs, strict=True):
        folder = path.parent / "steps"
        if not folder.is_dir():
            continue
        try:
            found = step_rows(check_run(results, folder), name=f"steps {path.parent.name}")
        except (ValueError, KeyError, TypeError) as err:
            raise typer.BadParameter(f"not a usable step log: {err}") from None
        title = f"engine steps ({folder}): measured vs the step model on the same batches"
        print_rows(found, console, title=title, reference="measured")
        rows += found
    return rows


def _run_cluster(nodes: str, concurrency: str | None, json_path: Path | None, plots: Path | None) -> None:
    """`--scenario cluster`: N nodes on one array (`kvprefetch.sim.cluster`), per concurrency asked."""
    import json

    from kvprefetch.sim.cluster import lines, plot, project

    try:
        ns = [int(x) for x in nodes.split(",") if x.strip()]
        levels = [int(x) for x in concurrency.split(",")] if concurrency else [16]
        projections = [project(ns, c) for c in levels]
    except ValueError as err:
        raise typer.BadParameter(f"--nodes/--concurrency: {err}") from None
    for p in projections:
        for line in lines(p):
            console.print(line, markup=False, highlight=False, soft_wrap=True)
        if plots:
            console.print(f"wrote {plot(p, plots / f'cluster_c{p.concurrency}.png')}")
    if json_path:
        json_path.write_text(json.dumps([p.to_json() for p in projections], indent=2) + "\n")


def _run_engine_memory(concurrency: str | None, json_path: Path | None, plots: Path | None) -> None:
    """`--scenario engine-memory`: the whitepaper's 14B deployment with its engine KV cut to shares of the full
    size (`kvprefetch.sim.engine_memory`); --concurrency: the clients (default: as many as the full KV holds)."""
    import json

    from kvprefetch.sim.engine_memory import POLICIES, Inputs, lines, plot, project

    try:
        clients = int(concurrency) if concurrency else None
        inputs = Inputs(concurrency=clients)
        if inputs.clients() < 1:
            raise ValueError("at least one client")
    except ValueError as err:
        raise typer.BadParameter(f"--concurrency: one number of clients for --scenario engine-memory ({err})") from None
    with Progress(console=console, transient=True) as bar:
        task = bar.add_task("simulating", total=len(inputs.shares) * len(POLICIES))
        projection = project(inputs, progress=lambda: bar.advance(task))
    for line in lines(projection):
        console.print(line, markup=False, highlight=False, soft_wrap=True)
    if plots:
        console.print(f"wrote {plot(projection, plots / 'engine_memory_14b.png')}")
    if json_path:
        json_path.write_text(json.dumps(projection.to_json(), indent=2, default=str) + "\n")


def _run_scenario(name: str, trace: Path, json_path: Path | None, plots: Path | None) -> None:
    from kvprefetch.sim.plots import ttft_vs_concurrency
    from kvprefetch.sim.report import mooncake_rows, print_rows, whitepaper_rows, write_json
    from kvprefetch.workload.mooncake import read_mooncake_trace

    names = scenario_names() if name == "all" else [name]
    unknown = set(names) - set(scenario_names())
    if unknown:
        raise typer.BadParameter(f"unknown scenario {sorted(unknown)}; known: {', '.join(scenario_names())}, all")
    rows = []
    wp = [n for n in names if n != "mooncake"]
    with Progress(console=console, transient=True) as bar:
        task = bar.add_task("simulating", total=sum(p.scenario in wp for p in PUBLISHED))
        rows += whitepaper_rows(wp, progress=lambda: bar.advance(task))
    if "mooncake" in names:
        if not trace.exists():
            raise typer.BadParameter(f"trace not found: {trace} (pass --trace PATH)")
        started = time.perf_counter()
        try:
            requests = read_mooncake_trace(trace)
        except (ValueError, OSError) as err:
            raise typer.BadParameter(f"--trace: {err}") from None
        rows += mooncake_rows(requests, trace.name)
        console.print(f"mooncake: {len(requests)} requests in {time.perf_counter() - started:.1f} s")
        if plots:
            _plot_hit_ratio(requests, trace, plots)
    print_rows(rows, console)
    if json_path:
        write_json(rows, json_path)
    if plots and any(n.startswith("seed-r2") for n in names):
        series = {
            p.value: {c: run_whitepaper(p, c).ttft_p(50) for c in (8, 16, 32)}
            for p in (Policy.ONDEMAND_SYNC, Policy.PREFETCH)
        }
        ttft_vs_concurrency(series, plots / "ttft_r2.png", "R2 (simulated): TTFT p50 vs concurrency")


# `kvprefetch sim`'s options, declared once here so the command's signature reads as a list of names.
ScenarioOpt = Annotated[
    str | None,
    typer.Option(
        help="validation scenario, 'all', 'bench' (with --bench-results), 'cluster': the whitepaper's "
        "deployment on --nodes N nodes sharing its array (--concurrency: clients per node, default 16), or "
        "'engine-memory': the whitepaper's 14B run (R5) with its engine KV cut to 1, 1/2, 1/4 and 1/8 of "
        "what the accelerator leaves it, vLLM alone against kvprefetch (--concurrency: clients, default as "
        "many as the full KV holds conversations)"
    ),
]
BenchResultsOpt = Annotated[
    list[Path] | None,
    typer.Option(
        help="results.json of a `kvprefetch bench` run, or its directory, for --scenario bench (repeat for medians)"
    ),
]
ModelOpt = Annotated[
    str | None, typer.Option(help=f"catalog model; default {DEFAULT_MODEL}, or the calibrated one on {THIS_CPU}")
]
AcceleratorOpt = Annotated[str, typer.Option(help=f"catalog accelerator, or {THIS_CPU} (needs --calibration)")]
StorageOpt = Annotated[
    str,
    typer.Option(
        help=f"catalog storage, or {THIS_DISK} (needs --calibration); several, nearest first: "
        "local-nvme,nvmeof-100gbe-raid0"
    ),
]
CalibrationOpt = Annotated[
    Path | None,
    typer.Option(
        help=f"results.json of a `kvprefetch bench` run: defines {THIS_CPU} and {THIS_DISK} as it measured them"
    ),
]
ConcurrencyOpt = Annotated[str | None, typer.Option(help="closed-loop clients, comma-separated (default 8,16,32)")]
RateOpt = Annotated[
    str | None, typer.Option(help="open loop instead: sessions starting per second (Poisson), comma-separated")
]
WorkloadOpt = Annotated[str, typer.Option(help="chat | context:CTX,NEW,OUT | trace:PATH")]
DramOpt = Annotated[float | None, typer.Option(help="host DRAM tier size; default unbounded")]
IODepthOpt = Annotated[
    int,
    typer.Option(
        min=1,
        help="reads kvprefetch keeps in flight (its io.threads): storage that needs more streams than this "
        "to reach its bandwidth is read slower",
    ),
]
EvictionOpt = Annotated[
    Eviction,
    typer.Option(help="DRAM tier: plain LRU, or queue-aware (queued requests' prefetched KV stays until admitted)"),
]
SweepOpt = Annotated[bool, typer.Option(help="find the storage bandwidth prefetch needs")]
JsonOpt = Annotated[Path | None, typer.Option("--json", help="write rows as JSON")]
PlotsOpt = Annotated[Path | None, typer.Option(help="directory for PNG plots")]
NodesOpt = Annotated[str, typer.Option(help="--scenario cluster: numbers of nodes sharing the whitepaper's array")]


def register(app: typer.Typer) -> None:
    """Add the `sim` command to the main CLI."""
    app.command()(sim)


def sim(
    scenario: ScenarioOpt = None,
    bench_results: BenchResultsOpt = None,
    model: ModelOpt = None,
    accelerator: AcceleratorOpt = "mi308x",
    tp: int = 8,
    storage: StorageOpt = "nvmeof-100gbe-raid0",
    calibration: CalibrationOpt = None,
    concurrency: ConcurrencyOpt = None,
    rate: RateOpt = None,
    workload: WorkloadOpt = "context",
    policies: str = "recompute,ondemand-sync,ondemand,prefetch,dram",
    efficiency: float = 0.4,
    dram_gb: DramOpt = None,
    io_depth: IODepthOpt = IOConfig.model_fields["threads"].default,
    eviction: EvictionOpt = Eviction.LRU,
    sweep: SweepOpt = False,
    trace: Path = Path("../shared/data/mooncake/synthetic_trace.jsonl"),
    json: JsonOpt = None,
    plots: PlotsOpt = None,
    nodes: NodesOpt = "1,2,4,8,16",
) -> None:
    """Simulate tiered KV serving: reproduce published figures or plan a deployment."""
    if scenario == "bench":
        _run_bench_scenario(bench_results, json)
        return
    if scenario == "cluster":
        _run_cluster(nodes, concurrency, json, plots)
        return
    if scenario == "engine-memory":
        _run_engine_memory(concurrency, json, plots)
        return
    if scenario:
        _run_scenario(scenario, trace, json, plots)
        return
    setup = _setup(model, accelerator, tp, storage, efficiency, dram_gb, io_depth, calibration, eviction)
    loads = _loads(workload, concurrency, rate)
    try:
        parse_workload(workload, loads[0])  # a bad spec or an unreadable trace fails here, by name
    except (ValueError, OSError) as err:
        raise typer.BadParameter(f"--workload: {err}") from None
    if sweep:
        _run_sweep(setup, workload, loads, json, plots)
        return
    _run_freeform(setup, workload, loads, _policies(policies), json, plots)


def _policies(text: str) -> list[Policy]:
    try:
        return [Policy(p.strip()) for p in text.split(",") if p.strip()]
    except ValueError as err:
        known = ", ".join(p.value for p in Policy)
        raise typer.BadParameter(f"{err.args[0]}; known policies: {known}") from None


def _loads(workload: str, concurrency: str | None, rate: str | None) -> list[Load]:
    """The loads to run: closed loops, Poisson rates, or a trace's own arrivals, refused where they conflict."""
    try:
        if workload.startswith("trace:"):
            if concurrency or rate:
                raise ValueError("a trace brings its own arrival times: drop --concurrency and --rate")
            return [Load()]
        if concurrency and rate:
            raise ValueError("--concurrency (closed loop) or --rate (open loop), not both")
        if rate:
            return [Load(rate_per_s=_number(r, "--rate", float)) for r in rate.split(",") if r.strip()]
        concs = (concurrency or "8,16,32").split(",")
        return [Load(concurrency=_number(c, "--concurrency", int)) for c in concs if c.strip()]
    except ValueError as err:
        raise typer.BadParameter(str(err)) from None


def _setup(
    model: str | None,
    accelerator: str,
    tp: int,
    storage: str,
    efficiency: float,
    dram_gb: float | None,
    io_depth: int,
    calibration: Path | None,
    eviction: Eviction,
) -> Setup:
    """The free-form setup, checked before any run: unknown names and unusable calibrations fail here, by name.
    Says what was measured (this-cpu) and what the storage delivers at this io depth, so a slow result is not
    blamed on its bandwidth alone."""
    path = str(calibration) if calibration else None
    try:
        if model is None:
            calibrated = accelerator == THIS_CPU and path is not None
            model = load_bench_calibration(path).model if calibrated else DEFAULT_MODEL
        setup = Setup(model, accelerator, tp, storage, efficiency, dram_gb, io_depth=io_depth, calibration=path,
                      queue_aware_eviction=eviction is Eviction.QUEUE_AWARE)  # fmt: skip
        _ = setup.deployment().kv_capacity_tokens  # a model that does not fit fails here
        bandwidths = setup.storage_read_bw()
    except KeyError as err:
        raise typer.BadParameter(str(err.args[0])) from None
    except ValueError as err:
        raise typer.BadParameter(str(err)) from None
    if accelerator == THIS_CPU:
        engines = setup.measured().engines
        console.print(
            f"{THIS_CPU}: {model} as {calibration} measured it (median of {engines} engines); --tp and --efficiency "
            "do not apply"
        )
    for name, (full, got) in bandwidths.items():
        line = f"{name}: {full / 1e9:.2f} GB/s, {got / 1e9:.2f} GB/s read with --io-depth {setup.io_depth}"
        if got < full:
            line += " (it needs more reads in flight to reach full bandwidth)"
        console.print(line)
    return setup


def _run_freeform(
    setup: Setup, workload: str, loads: list[Load], policies: list[Policy], json_path: Path | None, plots: Path | None
) -> None:
    import json as jsonlib

    dep = setup.deployment()
    eviction = Eviction.QUEUE_AWARE if setup.queue_aware_eviction else Eviction.LRU
    title = f"{dep.model.name} on {dep.tp}x {dep.accelerator.name}, {setup.storage}, {workload}"
    table = Table(title=title + ("" if setup.dram_gb is None else f", {setup.dram_gb:g} GB DRAM ({eviction})"))
    table.add_column("policy", no_wrap=True, min_width=max(len(p.value) for p in policies))
    for col in ("load", "TTFT p50 s", "TTFT p90 s", "output tok/s", "hit ratio", "from tiers", "stall s"):
        table.add_column(col)
    rows, series = [], {}
    with Progress(console=console, transient=True) as bar:
        task = bar.add_task("simulating", total=len(loads) * len(policies))
        for load in loads:
            for p in policies:
                r = run_setup(setup, p, workload, load)
                rows.append(
                    {
                        "policy": p.value,
                        "load": load.label,
                        "concurrency": load.concurrency,
                        "rate_per_s": load.rate_per_s,
                        "ttft_p50_s": r.ttft_p(50),
                        "ttft_p90_s": r.ttft_p(90),
                        "output_tok_s": r.output_tok_s,
                        "hit_ratio": r.hit_ratio,
                        "served_from": r.served_from(),
                        "recomputed_slower": r.recomputed_slower_tokens / max(1, r.prompt_tokens),
                        "stall_s": r.stall_s,
                        "eviction": eviction.value,
                        "storage_read_gb": sum(v for k, v in r.bytes_read.items() if k != "host") / 1e9,
                    }
                )
                series.setdefault(p.value, {})[load.x] = r.ttft_p(50)
                bar.advance(task)
    for row in rows:
        table.add_row(
            row["policy"],
            row["load"],
            f"{row['ttft_p50_s']:.2f}",
            f"{row['ttft_p90_s']:.2f}",
            f"{row['output_tok_s']:.1f}",
            f"{row['hit_ratio']:.2f}",
            f"{_from_tiers(row['served_from']):.2f}",
            f"{row['stall_s']:.1f}",
        )
    console.print(table)
    if policies != [Policy.RECOMPUTE] and not any(_from_tiers(row["served_from"]) for row in rows):
        console.print(_why_no_tier_served(rows))
    if json_path:
        json_path.write_text(jsonlib.dumps(rows, indent=2) + "\n")
    if plots and workload.startswith("trace:"):  # one load, the trace's own: its reuse against pool capacity
        trace = Path(workload.removeprefix("trace:"))
        _plot_hit_ratio(parse_workload(workload, loads[0])[0], trace, plots)
    elif plots:
        from kvprefetch.sim.plots import ttft_vs_concurrency

        xlabel = "concurrency" if loads[0].concurrency else "sessions starting per second"
        ttft_vs_concurrency(series, plots / "ttft_vs_concurrency.png", xlabel=xlabel)


def _why_no_tier_served(rows: list[dict]) -> str:
    """Why every policy gave the same run: the tiers served nothing, and the reason decides what to change."""
    if any(row["recomputed_slower"] for row in rows):
        return (
            "the tiers held hits, but the load-or-recompute rule recomputed them all: loading was slower than this "
            "engine's prefill (storage too slow for it, or its queue too long; see --sweep, --efficiency)"
        )
    if any(row["served_from"].get("hbm") for row in rows):
        return (
            "every hit came from the engine's own prefix cache in HBM: this workload's reuse fits in HBM, so the "
            "tiers below it and the policies change nothing here (a larger workload, e.g. --workload context, "
            "reaches them)"
        )
    return "this workload reuses no prompt tokens: there is nothing for a cache to serve"


def _from_tiers(served_from: dict[str, float]) -> float:
    """Share of prompt tokens served from below HBM (DRAM or storage): the hits the tiers and the policies act on."""
    return sum(v for k, v in served_from.items() if k not in ("computed", "hbm"))


def _plot_hit_ratio(requests: list, trace: Path, plots: Path) -> None:
    """Prefix hit ratio of the trace against one LRU pool's capacity, beside the published points if we know any."""
    from kvprefetch.sim.hitratio import hit_ratio_curve, published_for
    from kvprefetch.sim.plots import hit_ratio_vs_capacity

    caps = [1000, 3000, 10000, 30000, 50000, 100000, None]
    title = f"{trace.stem}: prefix hit ratio vs capacity"
    hit_ratio_vs_capacity(hit_ratio_curve(requests, caps), published_for(trace), plots / "hit_ratio.png", title)


def _run_sweep(
    setup: Setup, workload: str, loads: list[Load], json_path: Path | None, plots: Path | None = None
) -> None:
    """Prefetch's TTFT p50 at each bandwidth of the farthest storage tier, beside the two bounds it moves between:
    everything in DRAM, and recomputing everything."""
    import json as jsonlib

    bws = default_bandwidths()
    out = []
    with Progress(console=console, transient=True) as bar:
        task = bar.add_task("sweeping storage bandwidth", total=len(bws) * len(loads))
        for load in loads:
            rows, enough = sweep_storage_bw(setup, workload, load, bws, progress=lambda: bar.advance(task))
            out.append(
                {
                    "load": load.label,
                    "concurrency": load.concurrency,
                    "rate_per_s": load.rate_per_s,
                    "enough_gbps": enough,
                    "recompute_ttft_p50_s": run_setup(setup, Policy.RECOMPUTE, workload, load).ttft_p(50),
                    "points": [{"read_gbps": b, "prefetch_ttft_p50_s": t, "dram_ttft_p50_s": d} for b, t, d in rows],
                }
            )
    table = Table(title="prefetch TTFT p50 (s) by the farthest tier's full read bandwidth")
    table.add_column("GB/s", justify="right")
    for entry in out:
        table.add_column(entry["load"], justify="right")
    for i, bw in enumerate(bws):
        table.add_row(f"{bw:g}", *(f"{entry['points'][i]['prefetch_ttft_p50_s']:.2f}" for entry in out))
    table.add_row("all in DRAM", *(f"{entry['points'][0]['dram_ttft_p50_s']:.2f}" for entry in out))
    table.add_row("recompute", *(f"{entry['recompute_ttft_p50_s']:.2f}" for entry in out))
    console.print(table)
    full, got = list(setup.storage_read_bw().values())[-1]  # the sweep varies the farthest tier
    share = "" if got >= full else f" of full bandwidth, of which --io-depth {setup.io_depth} reads {got / full:.0%}"
    for entry in out:
        need = entry["enough_gbps"]
        verdict = f"{need} GB/s{share}" if need is not None else f"more than {max(bws)} GB/s{share}"
        console.print(f"{entry['load']}: prefetch hides storage (within 10% of all-in-DRAM) from {verdict}")
    if json_path:
        json_path.write_text(jsonlib.dumps(out, indent=2) + "\n")
    if plots:
        from kvprefetch.sim.plots import ttft_vs_bandwidth

        ttft_vs_bandwidth(out, plots / "sweep.png")
