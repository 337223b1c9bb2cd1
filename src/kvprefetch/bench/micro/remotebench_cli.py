"""`kvprefetch remotebench`: remote-tier read bandwidth per backend, ours next to the raw client."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console
from rich.table import Table

console = Console()


def remotebench(
    backend: Annotated[list[str] | None, typer.Option(help="redis and/or mooncake (started on loopback).")] = None,
    chunk: Annotated[str, typer.Option(help="Chunk payload size.")] = "1MiB",
    chunks: Annotated[int, typer.Option(min=1, help="Chunks written then read back.")] = 256,
    threads: Annotated[int, typer.Option(min=1, max=64)] = 4,
    repeats: Annotated[int, typer.Option(min=1, max=20)] = 3,
    json_path: Annotated[Path | None, typer.Option("--json", help="Write the rows as JSON here.")] = None,
) -> None:
    """Remote tier (Redis, Mooncake Store) read bandwidth through kvprefetch vs the raw client, one run."""
    from kvprefetch.bench.micro.remotebench import run_all
    from kvprefetch.cli_args import parse_size

    backends = backend or ["redis", "mooncake"]
    unknown = set(backends) - {"redis", "mooncake"}
    if unknown:
        raise typer.BadParameter(f"unknown backend(s) {sorted(unknown)}: choose redis and/or mooncake")
    with console.status("remotebench") as status:
        rows = run_all(backends, parse_size(chunk), chunks, threads, repeats, lambda s: status.update(s))
    table = Table(title=f"remote tier reads, {chunks} chunks of {chunk}, medians of {repeats} interleaved rounds")
    for col in ("backend", "raw client GB/s", "prefetch -> DRAM GB/s", "ours/raw", "get_into GB/s",
                "get_into/raw", "write-through GB/s"):  # fmt: skip
        table.add_column(col, justify="right")
    for r in rows:
        table.add_row(r.backend, f"{r.raw_read_gbps:.2f}", f"{r.prefetch_read_gbps:.2f}", f"{r.prefetch_over_raw:.2f}x",
                      f"{r.get_into_gbps:.2f}", f"{r.get_into_over_raw:.2f}x", f"{r.write_gbps:.2f}")  # fmt: skip
    console.print(table)
    if json_path is not None:
        json_path.write_text(json.dumps([r.to_json() for r in rows], indent=2) + "\n")
        console.print(f"wrote {json_path}")


def register(app: typer.Typer) -> None:
    app.command("remotebench")(remotebench)
