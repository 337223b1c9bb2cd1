"""The `kvprefetch` command line: benchmarks, the simulator, and configuration checks."""

from __future__ import annotations

import json
import signal
import sys
import tempfile
from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console
from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from kvprefetch.cli_args import parse_size
from kvprefetch.config import ConfigError, StoreConfig, default_cache_dir

app = typer.Typer(no_args_is_help=True, add_completion=False, help=__doc__)
console = Console()


@app.command()
def version() -> None:
    """Print the version."""
    from kvprefetch import __version__

    print(__version__)


@app.command("config")
def show_config(
    path: Annotated[Path | None, typer.Option("--config", "-c", help="YAML file to load.")] = None,
) -> None:
    """Validate and print the effective store configuration (file + KVPREFETCH_* environment + defaults)."""
    try:
        cfg = StoreConfig.load(path)
    except ConfigError as err:
        console.print(f"[red]{err}[/red]")
        raise typer.Exit(2) from None
    print(json.dumps(cfg.model_dump(mode="json"), indent=2))


@app.command()
def iobench(
    directory: Annotated[
        Path | None, typer.Option("--dir", help="Directory on the device to measure (default: the cache dir).")
    ] = None,
    size: Annotated[str, typer.Option(help="Bytes to write and read back.")] = "1GiB",
    chunk: Annotated[str, typer.Option(help="Chunk payload size.")] = "4MiB",
    threads: Annotated[int, typer.Option(min=1, max=256, help="Reads in flight for the parallel rows.")] = 4,
    repeats: Annotated[int, typer.Option(min=1, max=20, help="Interleaved repetitions; medians reported.")] = 5,
    fio: Annotated[bool, typer.Option("--fio/--no-fio", help="Measure the fio reference ceiling.")] = True,
    json_path: Annotated[Path | None, typer.Option("--json", help="Write the results as JSON here.")] = None,
) -> None:
    """Storage benchmark: fio's ceiling vs the disk tier's serial and parallel cold reads, and write-back."""
    from kvprefetch.bench.micro.fio_reference import fio_available
    from kvprefetch.bench.micro.iobench import run_iobench

    total, chunk_bytes = parse_size(size), parse_size(chunk)
    if fio and not fio_available():
        console.print("[yellow]fio not found: install it (apt-get install fio) for the reference row[/yellow]")
    base = directory or default_cache_dir()
    base.mkdir(parents=True, exist_ok=True)
    with (
        tempfile.TemporaryDirectory(prefix="kvprefetch-iobench-", dir=base) as tmp,
        Progress(
            TextColumn("[bold]iobench[/bold] {task.description}"), BarColumn(), TimeElapsedColumn(), console=console
        ) as bar,
    ):
        task = bar.add_task("starting", total=1.0)
        result = run_iobench(
            Path(tmp), total, chunk_bytes, threads, repeats, use_fio=fio,
            progress=lambda label, frac: bar.update(task, description=label, completed=frac),
        )  # fmt: skip
    _print_iobench(result, Path(base))
    if json_path is not None:
        out = result.to_json()
        keep = ("fio_read_gbps", "serial_read_gbps", "parallel_read_gbps", "write_gbps", "parallel_over_fio",
                "parallel_over_serial", "chunk_bytes", "total_bytes")  # fmt: skip
        payload = {k: out[k] for k in keep} | {k: v for k, v in out.items() if k not in keep}
        json_path.write_text(json.dumps(payload, indent=2) + "\n")
        console.print(f"wrote {json_path}")


def _print_iobench(result, base: Path) -> None:
    table = Table(title=f"kvprefetch iobench on {base} ({result.total_bytes / 2**30:.2f} GiB, "
                  f"chunks of {result.chunk_bytes / 2**20:g} MiB, {result.threads} threads)")  # fmt: skip
    table.add_column("path")
    table.add_column("GB/s", justify="right")
    table.add_column("vs fio", justify="right")
    fio = result.fio_read_gbps

    def row(name: str, gbps: float | None) -> None:
        if gbps is None:
            return
        table.add_row(name, f"{gbps:.2f}", f"{gbps / fio:.2f}x" if fio else "-")

    row("fio sequential O_DIRECT read (best job, median)", fio)
    row("disk tier, one chunk at a time", result.serial_read_gbps)
    row(f"disk tier, parallel reads -> DRAM ({result.dram_backing})", result.parallel_read_gbps)
    row("  same, read straight into the slots (no staging)", result.parallel_read_gbps_unstaged)
    row("disk tier, parallel reads -> DRAM (4 KiB pages)", result.parallel_read_gbps_4k_pages)
    row("demand loads into caller buffers", result.get_into_gbps)
    row("bare preadv into the pool's memory (no checks)", result.raw_pool_read_gbps)
    row("write-back (fsync'd)", result.write_gbps)
    console.print(table)
    for run in result.fio_runs:
        console.print(f"  fio sweep: iodepth={run.iodepth:<3} iomem={run.iomem:<40} {run.gbps:.2f} GB/s")
    sweep = ", ".join(f"{cap / 2**20:.0f} MiB: {gbps:.2f}" for cap, gbps in result.inflight_sweep.items())
    console.print(f"  reads in flight (disk.read_inflight_bytes -> GB/s): {sweep}; best "
                  f"{result.read_inflight_bytes / 2**20:.0f} MiB")  # fmt: skip
    ratio = result.parallel_over_fio
    console.print(
        f"parallel/serial = {result.parallel_over_serial:.2f}x"
        + (f", parallel/fio = {ratio:.2f}x" if ratio is not None else "")
    )


def _register_subcommands() -> None:
    from kvprefetch.bench.bench_cli import register as register_bench
    from kvprefetch.bench.micro.loadbench_cli import register as register_loadbench
    from kvprefetch.bench.micro.remotebench_cli import register as register_remotebench
    from kvprefetch.bench.serve_bench_cli import register as register_bench_serve
    from kvprefetch.serve_cli import register as register_serve
    from kvprefetch.sim.cli import register as register_sim
    from kvprefetch.status_cli import register as register_status
    from kvprefetch.trace_cli import register as register_trace

    register_sim(app)
    register_bench(app)
    register_remotebench(app)
    register_status(app)
    register_trace(app)
    register_loadbench(app)
    register_serve(app)
    register_bench_serve(app)


_register_subcommands()


def exit_on_sigterm() -> None:
    """Make SIGTERM end a command the way Ctrl-C does: by an exception, so that the `finally` blocks that remove
    what it made (DRAM pools, engine processes, temp dirs, cgroups) run as on a normal exit. A second SIGTERM
    kills at once."""

    def handler(signum: int, _frame) -> None:
        signal.signal(signum, signal.SIG_DFL)
        raise SystemExit(128 + signum)

    signal.signal(signal.SIGTERM, handler)


def main() -> None:
    exit_on_sigterm()
    try:
        app()
    except ConfigError as err:
        console.print(f"[red]{err}[/red]")
        sys.exit(2)


if __name__ == "__main__":
    main()
