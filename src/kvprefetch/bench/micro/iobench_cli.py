"""`kvprefetch iobench`: the disk tier's cold reads and write-back next to fio's ceiling, on one directory."""

from __future__ import annotations

import json
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer
from rich.console import Console
from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from kvprefetch.cli_args import parse_size
from kvprefetch.config import default_cache_dir

if TYPE_CHECKING:  # the measurement and the store load when the command runs, not at every `kvprefetch` start
    from kvprefetch.bench.micro.iobench import IOBenchResult

console = Console()

# The headline figures lead the JSON, in this order; every other field follows as the result names it.
JSON_HEAD = ("fio_read_gbps", "serial_read_gbps", "parallel_read_gbps", "write_gbps", "parallel_over_fio",
             "parallel_over_serial", "chunk_bytes", "total_bytes")  # fmt: skip


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
    sglang: Annotated[
        bool,
        typer.Option(
            "--sglang",
            help="Instead: SGLang HiCache storage reads, our backend (zero-copy and flat) against SGLang's own "
            "HiCacheFile and our store's get_into, on the same pages (8 MiB: Llama-3-8B, 64-token pages), cold.",
        ),
    ] = False,
    page_tokens: Annotated[
        int, typer.Option(min=1, max=4096, help="--sglang: tokens per SGLang page (8 MiB at 64; SGLang's --page-size).")
    ] = 64,
) -> None:
    """Storage benchmark: fio's ceiling vs the disk tier's serial and parallel cold reads, and write-back."""
    from kvprefetch.bench.micro.fio_reference import fio_available

    total, chunk_bytes = parse_size(size), parse_size(chunk)
    if sglang:
        _sglang_iobench(directory, total, threads, repeats, json_path, page_tokens)
        return
    if fio and not fio_available():
        console.print("[yellow]fio not found: install it (apt-get install fio) for the reference row[/yellow]")
    base = directory or default_cache_dir()
    base.mkdir(parents=True, exist_ok=True)
    result = _measure(base, total, chunk_bytes, threads, repeats, fio)
    _print_iobench(result, Path(base))
    if json_path is not None:
        json_path.write_text(json.dumps(json_payload(result), indent=2) + "\n")
        console.print(f"wrote {json_path}")


def _measure(base: Path, total: int, chunk_bytes: int, threads: int, repeats: int, fio: bool) -> IOBenchResult:
    """The run, in a temporary directory under `base` (removed after), its phases on a progress bar."""
    from kvprefetch.bench.micro.iobench import run_iobench

    with (
        tempfile.TemporaryDirectory(prefix="kvprefetch-iobench-", dir=base) as tmp,
        Progress(
            TextColumn("[bold]iobench[/bold] {task.description}"), BarColumn(), TimeElapsedColumn(), console=console
        ) as bar,
    ):
        task = bar.add_task("starting", total=1.0)
        return run_iobench(
            Path(tmp), total, chunk_bytes, threads, repeats, use_fio=fio,
            progress=lambda label, frac: bar.update(task, description=label, completed=frac),
        )  # fmt: skip


def json_payload(result: IOBenchResult) -> dict:
    """What --json writes: the headline figures first (JSON_HEAD), then the rest."""
    out = result.to_json()
    return {k: out[k] for k in JSON_HEAD} | {k: v for k, v in out.items() if k not in JSON_HEAD}


def _print_iobench(result: IOBenchResult, base: Path) -> None:
    shape = result.shape
    table = Table(title=f"kvprefetch iobench on {base} ({shape.total_bytes / 2**30:.2f} GiB, "
                  f"chunks of {shape.chunk_bytes / 2**20:g} MiB, {shape.threads} threads)")  # fmt: skip
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
    for run in result.fio.runs if result.fio else []:
        console.print(f"  fio sweep: iodepth={run.iodepth:<3} iomem={run.iomem:<40} {run.gbps:.2f} GB/s")
    sweep = ", ".join(f"{cap / 2**20:.0f} MiB: {gbps:.2f}" for cap, gbps in result.inflight.rates.items())
    console.print(f"  reads in flight (disk.read_inflight_bytes -> GB/s): {sweep}; best "
                  f"{result.inflight.best_bytes / 2**20:.0f} MiB")  # fmt: skip
    ratio = result.parallel_over_fio
    console.print(
        f"parallel/serial = {result.parallel_over_serial:.2f}x"
        + (f", parallel/fio = {ratio:.2f}x" if ratio is not None else "")
    )


def _sglang_iobench(
    directory: Path | None, total: int, threads: int, repeats: int, json_path: Path | None, page_tokens: int
) -> None:
    try:
        from kvprefetch.bench.micro.sglangbench import PageShape, run_sglangbench
    except ImportError as err:
        console.print(f"[red]iobench --sglang needs SGLang's storage interface ({err}): `make setup` installs it "
                      "(pip install --no-deps sglang==0.5.23 and kvprefetch[sglang])[/red]")  # fmt: skip
        raise typer.Exit(2) from None
    base = directory or default_cache_dir()
    base.mkdir(parents=True, exist_ok=True)
    with (
        tempfile.TemporaryDirectory(prefix="kvprefetch-sglangbench-", dir=base) as tmp,
        Progress(
            TextColumn("[bold]iobench --sglang[/bold] {task.description}"), BarColumn(), TimeElapsedColumn(),
            console=console,
        ) as bar,
    ):  # fmt: skip
        task = bar.add_task("starting", total=1.0)

        def progress(label: str, frac: float) -> None:
            bar.update(task, description=label, completed=frac)

        shape = PageShape(page_tokens=page_tokens)
        result = run_sglangbench(Path(tmp), total, threads, repeats, shape, progress=progress)
    print_sglangbench(result, base)
    if json_path is not None:
        json_path.write_text(json.dumps(result.to_json(), indent=2) + "\n")
        console.print(f"wrote {json_path}")


def print_sglangbench(result, base: Path) -> None:
    """The four read paths' rates, then the two paired goals."""
    from kvprefetch.bench.micro.sglangbench import BATCH, FIO, PATHS

    shape = result.shape
    table = Table(title=f"SGLang HiCache storage reads on {base}: {result.pages} pages of "
                  f"{shape.page_bytes / 2**20:g} MiB ({shape.page_tokens} tokens, {shape.layout}), batches of {BATCH}, "
                  f"{len(result.gbps[PATHS[0]])} rounds")  # fmt: skip
    table.add_column("path")
    table.add_column("GB/s median", justify="right")
    table.add_column("min..max", justify="right")
    names = {
        "hicache-file": "SGLang HiCacheFile batch_get -> flat pages -> host pool",
        "ours-v1": f"kvprefetch batch_get_v1 -> host pool (zero-copy, {result.threads} threads, "
        f"DRAM pool on {result.dram_backing})",
        "ours-flat": "kvprefetch batch_get -> flat pages -> host pool",
        "store-get-into": "kvprefetch store get_into -> caller buffers",
        FIO: f"fio O_DIRECT read of HiCacheFile's files (a page per read, iodepth {result.threads})",
    }
    for path in result.gbps:
        rates = result.gbps[path]
        table.add_row(names[path], f"{result.median(path):.2f}", f"{min(rates):.2f}..{max(rates):.2f}")
    console.print(table)
    if not result.page_cache_dropped:
        console.print("[yellow]the page cache could not be dropped (not root): HiCacheFile may read RAM[/yellow]")
    for num, den, goal in (("ours-v1", "hicache-file", 2.0), ("ours-v1", "store-get-into", 0.9)):
        med, lo, hi = result.paired(num, den)
        verdict = "met" if med >= goal else "NOT met"
        console.print(f"{num} / {den}: {med:.2f}x (rounds {lo:.2f}..{hi:.2f}x; goal >= {goal}x: {verdict})")
    if FIO in result.gbps:
        for path in ("hicache-file", "ours-v1"):
            med, lo, hi = result.paired(path, FIO)
            console.print(f"{path} / fio: {med:.2f}x (rounds {lo:.2f}..{hi:.2f}x)")


def register(app: typer.Typer) -> None:
    app.command("iobench")(iobench)
