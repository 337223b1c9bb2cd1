"""`kvprefetch bench`: the command line around `kvprefetch.bench.runner`."""

from __future__ import annotations

import datetime as dt
import json
from dataclasses import replace
from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console

console = Console()


def parse_engine_args(items: list[str]) -> dict:
    """['max_num_batched_tokens=4096', 'enforce_eager=false'] -> {...}; values parsed as JSON where they parse."""
    out = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key.strip():
            raise typer.BadParameter(f"--engine-arg takes key=value, got {item!r}")
        try:
            out[key.strip().replace("-", "_")] = json.loads(value)
        except ValueError:
            out[key.strip().replace("-", "_")] = value
    return out


def parse_list(text: str) -> list[int]:
    try:
        vals = [int(x) for x in text.replace(" ", "").split(",") if x]
    except ValueError:
        raise typer.BadParameter(f"expected a comma-separated list of integers, got {text!r}") from None
    if not vals or any(v < 1 for v in vals):
        raise typer.BadParameter(f"concurrency levels must be positive integers, got {text!r}")
    return vals


def register(app: typer.Typer) -> None:
    @app.command("bench")
    def bench(
        mode: Annotated[
            list[str] | None,
            typer.Option(
                "--mode",
                "-m",
                help="Modes to run (repeat or comma list); "
                "default: all (recompute, ondemand-serial, ondemand-sync, ondemand, prefetch, dram, "
                "vllm-example, lmcache); "
                "opt-in: prefetch-remote, shared-2x, private-2x.",
            ),
        ] = None,
        concurrency: Annotated[
            str | None, typer.Option(help="Concurrency levels, e.g. 1,8,16,32 (the default).")
        ] = None,
        regime: Annotated[
            str,
            typer.Option(
                help="R = recompute time / slowest-tier load time per chunk, enforced by a read throttle; "
                "'native' for none. Default: the whitepaper's R2 (18.2, derived in report.md). A list (e.g. "
                "18.2,3,1,native) sweeps: every regime on the same engines, the goals judged in the first, and "
                "report.md plots prefetch against ondemand-sync and dram over R (regime_sweep.png)."
            ),
        ] = "18.2",
        workload: Annotated[
            str,
            typer.Option(
                help="'context' (default: the whitepaper's R2 shape, a long stored context + 32 new tokens, "
                "the engine batching 4), 'chat' (multi-turn sessions, nothing queues) or 'agent' (sessions of "
                "turns separated by tool calls, --gap-s; modes recompute, ondemand-sync, prefetch, lease, warm, "
                "dram at concurrency 1,8 unless -m/--concurrency say otherwise)."
            ),
        ] = "context",
        gap_s: Annotated[
            str,
            typer.Option(help="Agent: a tool call's duration in seconds, uniform in MIN-MAX (e.g. 0.5-3, the "
                         "default), or one value (0: no gap, nothing to hide)."),
        ] = "0.5-3",
        dram_life_s: Annotated[
            float,
            typer.Option(min=0.0, help="Agent: other traffic on the node's DRAM tier, as how long an unpinned chunk "
                         "lasts after its last use (default 0.4 s: below the shortest tool gap)."),
        ] = 0.4,
        repeats: Annotated[
            int | None,
            typer.Option(
                min=1,
                help="Rounds of every cell, modes interleaved within each round; medians, min-max and paired "
                "ratios are reported (default 3; 1 with --quick).",
            ),
        ] = None,
        topology: Annotated[
            str,
            typer.Option(
                help="'gpu-node' (default: the model computes on cores of its own, in vLLM's worker process, "
                "while the client, the scheduler and the connector's threads run on the rest, as host and "
                "accelerator divide the work on a GPU node) or 'shared' (every thread on every core)."
            ),
        ] = "gpu-node",
        model: Annotated[
            str | None, typer.Option(help="Model path or name (default: the packaged tiny dummy Llama).")
        ] = None,
        engine_arg: Annotated[
            list[str] | None,
            typer.Option(
                "--engine-arg",
                help="vLLM engine argument key=value (repeatable), e.g. dtype=bfloat16, tensor_parallel_size=2.",
            ),
        ] = None,
        out: Annotated[
            Path | None, typer.Option(help="Output directory (default: bench-results/<timestamp>/).")
        ] = None,
        quick: Annotated[
            bool,
            typer.Option(
                "--quick",
                help="Two concurrency levels, fewer sessions, one round, one engine calibrated, and without the "
                "other projects' connectors unless -m names them (~5 min here).",
            ),
        ] = False,
        trace: Annotated[
            Path | None, typer.Option(help="Replay a Mooncake-format trace instead of synthetic chat.")
        ] = None,
        trace_length_scale: Annotated[
            float | None,
            typer.Option(help="Trace token lengths x this; a 512-token block must stay a whole number of chunks "
                         "(default: one chunk a block)."),
        ] = None,
        trace_time_scale: Annotated[
            float, typer.Option(help="Trace arrival times x this (with --trace-timestamps and --trace-utilisation 0).")
        ] = 1.0,
        trace_timestamps: Annotated[
            bool, typer.Option(help="Honour trace arrival times (else: as fast as the concurrency allows).")
        ] = False,
        trace_utilisation: Annotated[
            float,
            typer.Option(help="With --trace-timestamps: scale arrival times so recomputing each level would keep "
                         "the engine this busy (0: use --trace-time-scale as given)."),
        ] = 0.8,
        trace_window_start: Annotated[
            float, typer.Option(help="Measure conversations from this share of the trace's time span on.")
        ] = 0.3,
        trace_max_prompt_tokens: Annotated[
            int, typer.Option(help="Leave out conversations with a longer (scaled) prompt.")
        ] = 2048,
        system_tokens: Annotated[int | None, typer.Option(help="Chat: shared system prompt tokens.")] = None,
        history_tokens: Annotated[
            int | None, typer.Option(help="Chat: first (long) message tokens (agent: the task context).")
        ] = None,
        user_tokens: Annotated[
            int | None, typer.Option(help="Chat: follow-up message tokens (agent: a tool's result).")
        ] = None,
        output_tokens: Annotated[
            int | None, typer.Option(help="Chat: answer tokens (agent: the model's answer per turn).")
        ] = None,
        turns: Annotated[int | None, typer.Option(help="Chat (and agent): measured turns per session.")] = None,
        think_s: Annotated[float | None, typer.Option(help="Chat: mean think time between turns (s).")] = None,
        sessions_per_concurrency: Annotated[
            float | None, typer.Option(help="Chat: sessions per level = max(min, this x concurrency).")
        ] = None,
        no_reuse: Annotated[
            bool,
            typer.Option(
                "--no-reuse",
                help="Chat without any reuse (no prelude, no system prompt, one turn): "
                "the cost of the connector on misses.",
            ),
        ] = False,
        chunk_tokens: Annotated[
            int | None, typer.Option(help="kvprefetch chunk size in tokens (default 256; 128 with --trace).")
        ] = None,
        kv_cache: Annotated[
            str | None, typer.Option(help="Engine KV cache size (default: 4 longest requests).")
        ] = None,
        dram: Annotated[
            str | None,
            typer.Option(help="DRAM tier size of the non-dram modes (default: 1.5x the in-flight requests' KV)."),
        ] = None,
        cache_dir: Annotated[Path | None, typer.Option(help="Where the disk tiers go (default: the temp dir).")] = None,
        keep_cache: Annotated[bool, typer.Option(help="Keep the disk tiers and engine logs.")] = False,
        step_log: Annotated[
            bool,
            typer.Option(
                help="Record every engine step (batch, time) to <out>/steps/; `kvprefetch sim "
                "--scenario bench` then checks its step model on them."
            ),
        ] = False,
        cell_timeout: Annotated[float, typer.Option(help="Seconds one mode x concurrency may take.")] = 1800,
        scenario: Annotated[
            str,
            typer.Option(
                help="'single' (default: one engine per mode) or 'two-instance': two engines at once, turns "
                "alternating between them, with one shared node-local cache (shared-2x) and with a cache each "
                "(private-2x); runs only those two unless -m adds modes; there the prelude holds only each "
                "conversation's first message and --turns defaults to 4."
            ),
        ] = "single",
        remote_backend: Annotated[
            str, typer.Option(help="Server of the prefetch-remote mode (-m prefetch-remote): redis or mooncake.")
        ] = "redis",
    ) -> None:
        """The main benchmark: TTFT and throughput of tiered prefetch vs recompute, on-demand loads, all-in-DRAM and
        vLLM's own connector, on real vLLM engines, over a concurrency sweep, in a declared storage regime."""
        from kvprefetch.bench.modes import MODES, PEER_MODES, TWO_INSTANCE_MODES
        from kvprefetch.bench.regime import parse_regime
        from kvprefetch.bench.runner import QUICK_CONCURRENCY, BenchOptions
        from kvprefetch.bench.topology import TOPOLOGIES
        from kvprefetch.cli_args import parse_size
        from kvprefetch.workload.replay import ChatBench, TraceBench

        modes = [m.strip() for item in (mode or []) for m in item.split(",") if m.strip()]
        for m in modes:
            if m not in MODES:
                raise typer.BadParameter(f"unknown mode {m!r}; choose from {', '.join(MODES)}")
        if scenario not in ("single", "two-instance"):
            raise typer.BadParameter(f"--scenario is 'single' or 'two-instance', got {scenario!r}")
        if remote_backend not in ("redis", "mooncake"):
            raise typer.BadParameter(f"--remote-backend is 'redis' or 'mooncake', got {remote_backend!r}")
        if scenario == "two-instance":
            modes = [m for m in modes if m not in TWO_INSTANCE_MODES] + list(TWO_INSTANCE_MODES)
            if turns is None:
                turns = 4
        try:
            first, *sweep = [parse_regime(x) for x in regime.split(",") if x.strip()] or [parse_regime("")]
        except ValueError as err:
            raise typer.BadParameter(str(err)) from None
        if workload not in ("context", "chat", "agent"):
            raise typer.BadParameter(f"--workload is 'context', 'chat' or 'agent', got {workload!r}")
        if topology not in TOPOLOGIES:
            raise typer.BadParameter(f"--topology is {' or '.join(map(repr, TOPOLOGIES))}, got {topology!r}")
        opts = BenchOptions(regime=first, sweep=sweep, model=model, engine_args=parse_engine_args(engine_arg or []),
                            quick=quick, chunk_tokens=chunk_tokens, cache_dir=cache_dir, keep_cache=keep_cache,
                            step_log=step_log, cell_timeout_s=cell_timeout, remote_backend=remote_backend,
                            repeats=repeats or (1 if quick else 3), topology=topology)  # fmt: skip
        if workload == "chat" or no_reuse or trace is not None or scenario == "two-instance":
            opts.chat, opts.max_num_seqs = ChatBench(), None
        if workload == "agent":
            from kvprefetch.bench.runner import AGENT_CONCURRENCY, AGENT_MODES
            from kvprefetch.workload.agent import AgentBench, parse_gap

            try:
                gap_min, gap_max = parse_gap(gap_s)
            except ValueError as err:
                raise typer.BadParameter(str(err)) from None
            sizes = {"measured_turns": turns, "task_tokens": history_tokens, "tool_tokens": user_tokens,
                     "answer_tokens": output_tokens}  # the chat options' counterparts
            opts.agent = AgentBench(gap_min_s=gap_min, gap_max_s=gap_max,
                                    **{k: v for k, v in sizes.items() if v is not None})  # fmt: skip
            opts.modes, opts.concurrency, opts.max_num_seqs = list(AGENT_MODES), list(AGENT_CONCURRENCY), None
            opts.dram_life_s = dram_life_s
        if modes:
            opts.modes = modes
        if quick:
            if not modes:  # an engine start and two cells each: the full run compares with them
                opts.modes = [m for m in opts.modes if m not in PEER_MODES]
            opts.concurrency = list(QUICK_CONCURRENCY) if opts.agent is None else opts.concurrency
            opts.calibrate_modes = False
            opts.chat = replace(opts.chat, min_sessions=2, sessions_per_concurrency=1.0)
            if opts.agent is not None:
                opts.agent = replace(opts.agent, min_sessions=2, sessions_per_concurrency=1.0)
        if concurrency:
            opts.concurrency = parse_list(concurrency)
        chat_kw = {k: v for k, v in dict(system_tokens=system_tokens, history_tokens=history_tokens,
                   user_tokens=user_tokens, output_tokens=output_tokens, measured_turns=turns, think_s=think_s,
                   sessions_per_concurrency=sessions_per_concurrency).items() if v is not None}  # fmt: skip
        if no_reuse:
            chat_kw["reuse"] = False
        if scenario == "two-instance":
            # the prelude holds each conversation's first message only: every later turn's prefix was computed
            # by the turn before it, on the other engine (a hit only where the cache is shared)
            chat_kw["prelude_turns"] = 1
        opts.chat = replace(opts.chat, **chat_kw)
        opts.chunk_tokens = chunk_tokens or (128 if trace is not None else 256)
        if trace is not None:
            from kvprefetch.trace_cli import bench_preamble

            try:
                for line in bench_preamble(trace, trace_length_scale, opts.chunk_tokens, trace_window_start,
                                           trace_max_prompt_tokens):  # fmt: skip
                    console.print(line, markup=False)
            except (ValueError, OSError) as err:
                raise typer.BadParameter(str(err)) from None
            opts.trace = TraceBench(path=str(trace), length_scale=trace_length_scale, chunk_tokens=opts.chunk_tokens,
                                    time_scale=trace_time_scale, use_timestamps=trace_timestamps,
                                    utilisation=trace_utilisation or None, window_start=trace_window_start,
                                    max_prompt_tokens=trace_max_prompt_tokens)  # fmt: skip
            if quick:
                opts.trace = replace(opts.trace, min_requests=4, requests_per_concurrency=1.0)
        if kv_cache:
            opts.kv_cache_bytes = parse_size(kv_cache)
        if dram:
            opts.dram_bytes = parse_size(dram)
        opts.out = out or Path("bench-results") / dt.datetime.now().strftime("%Y%m%d-%H%M%S")
        run_and_report(opts)


def run_and_report(opts) -> dict:
    from rich.progress import (
        BarColumn,
        Progress,
        TaskProgressColumn,
        TextColumn,
        TimeElapsedColumn,
        TimeRemainingColumn,
    )

    from kvprefetch.bench.client import EngineError
    from kvprefetch.bench.modes import known_failure
    from kvprefetch.bench.report import (
        TABLE_COLUMNS,
        regimes_of,
        rich_table,
        row_cells,
        trace_reuse_lines,
        write_outputs,
    )
    from kvprefetch.bench.runner import Bench, simulator_prediction

    levels = ",".join(map(str, opts.concurrency))
    console.print(
        f"[bold]kvprefetch bench[/bold]: modes {', '.join(opts.modes)}; concurrency {levels}; "
        f"regime {opts.regime or 'native'}; out {opts.out}"
    )
    with Progress(
        TextColumn("[bold]bench[/bold] {task.description}"),
        BarColumn(),
        TaskProgressColumn(),
        TimeElapsedColumn(),
        TextColumn("ETA"),
        TimeRemainingColumn(),
        console=console,
    ) as bar:
        task = bar.add_task("starting", total=1.0)

        def progress(desc: str, done: float, total: float) -> None:
            kw = {"completed": done, "total": max(total, 1e-9)}
            if desc:
                kw["description"] = desc
            bar.update(task, **kw)

        def on_row(row: dict) -> None:
            cell = dict(zip((h for _, h, _ in TABLE_COLUMNS), row_cells(row), strict=True))
            if row.get("status") == "ok":
                bar.console.print(
                    f"  {row['mode']:<15} c={row['concurrency']:<3} round {row.get('round', 0) + 1}: TTFT p50 "
                    f"{cell['TTFT p50 s']} s, p90 {cell['p90 s']} s, {cell['out tok/s']} out tok/s, hit {cell['hit']}, "
                    f"disk {cell['disk']}, errors {row.get('errors')}, other CPU {cell['other CPU']}"
                )
            else:
                bar.console.print(
                    f"  {row['mode']:<13} c={row['concurrency']:<3} {row.get('status')}: {row.get('reason')}"
                )

        bench = Bench(opts, progress=progress, on_row=on_row, log=bar.console.print)
        try:
            results = bench.run()
        except EngineError as err:
            bar.stop()
            console.print(f"[red]kvprefetch bench: {err}[/red]")
            console.print(f"engine logs kept in {getattr(bench, 'work', '?')}")
            raise typer.Exit(1) from None
    results["simulator_prediction"] = simulator_prediction(results)
    files = write_outputs(results, opts.out)
    reg = results["regime"]
    title = f"kvprefetch bench: {results['workload']['name']}, regime asked {reg.get('asked')}"
    if reg.get("measured"):
        title += f", measured R = {reg['measured']:.1f}"
    wide = console if console.is_terminal and console.width >= 200 else Console(width=max(console.width, 210))
    regimes = regimes_of(results["rows"])
    for g in regimes:
        head = title if g == regimes[0] else f"kvprefetch bench: {results['workload']['name']}, sweep: regime {g}"
        wide.print(rich_table([r for r in results["rows"] if r.get("regime") == g], title=head))
    for r in results["rows"]:
        if r.get("status") != "ok":
            console.print(f"[yellow]{r['mode']} @ {r['concurrency']}: {r.get('status')}: {r.get('reason')}[/yellow]")
            if why := known_failure(r["mode"], r.get("reason")):
                console.print(f"  known: {why}")
    for line in trace_reuse_lines(results):
        if line:
            console.print(line, markup=False)
    for n in results.get("notes", []):
        console.print(f"[yellow]note:[/yellow] {n.splitlines()[0]}")
    console.print(f"wrote {', '.join(str(opts.out / f) for f in files)}")
    return results
