"""`kvprefetch trace FILE`: what a Mooncake-format trace offers a prefix cache, before anything replays it."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console

from kvprefetch.workload import read_mooncake_trace
from kvprefetch.workload.analysis import HUB_FANOUT, TraceAnalysis, analyse

console = Console()


def analyse_file(path: Path, hub_fanout: int = HUB_FANOUT) -> TraceAnalysis:
    """The analysis of a trace file at its own (unscaled) lengths; a clear ValueError/OSError otherwise."""
    return analyse(read_mooncake_trace(path), hub_fanout)


def bench_preamble(
    trace: Path, length_scale: float | None, chunk_tokens: int, window_start: float, max_prompt_tokens: int
) -> list[str]:
    """What `kvprefetch bench --trace` prints before it starts anything: a length-scale correction, if one is
    needed, and the trace's analysis. Raises ValueError (a scale it cannot correct, a bad rule, a bad trace)
    or OSError (no such file)."""
    from kvprefetch.workload.replay import find_trace
    from kvprefetch.workload.sampling import SampleRule, fit_block_tokens

    _, note = fit_block_tokens(length_scale, chunk_tokens)
    SampleRule(window_start, max_prompt_tokens)
    path = find_trace(trace)
    lines = [f"--trace-length-scale: {note}"] if note else []
    return [*lines, f"trace {path}:", *(f"  {line}" for line in analyse_file(path).lines())]


def plot_analysis(analysis: TraceAnalysis, trace: Path, path: Path) -> Path:
    """Hit ratio against LRU cache size, beside the published points when we know the trace."""
    from kvprefetch.sim.hitratio import published_for
    from kvprefetch.sim.plots import hit_ratio_vs_capacity

    title = f"{trace.stem}: prefix hit ratio vs cache size"
    return hit_ratio_vs_capacity(analysis.curve(), published_for(trace), path, title)


def register(app: typer.Typer) -> None:
    @app.command("trace")
    def trace(
        file: Annotated[Path, typer.Argument(help="A Mooncake-format JSON-lines trace.")],
        json_path: Annotated[Path | None, typer.Option("--json", help="Write the analysis as JSON here.")] = None,
        plot: Annotated[
            Path | None, typer.Option(help="Write the hit ratio vs cache size plot (PNG) here.")
        ] = None,
        hub_fanout: Annotated[
            int, typer.Option(help="A block followed by more distinct blocks than this is a shared prompt head.")
        ] = HUB_FANOUT,
    ) -> None:
        """Requests, prefix groups (conversations), the ideal prefix hit ratio unbounded and by cache size,
        reuse distance, arrival rate and lengths of a trace (the bench prints the same before a --trace run)."""
        try:
            analysis = analyse_file(file, hub_fanout)
        except (ValueError, OSError) as err:
            console.print(f"[red]kvprefetch trace: {err}[/red]")
            raise typer.Exit(2) from None
        console.print(f"[bold]{file}[/bold]")
        for line in analysis.lines():
            console.print(f"  {line}")
        if json_path:
            json_path.write_text(json.dumps(analysis.to_json(), indent=2) + "\n")
            console.print(f"wrote {json_path}")
        if plot:
            console.print(f"wrote {plot_analysis(analysis, file, plot)}")
