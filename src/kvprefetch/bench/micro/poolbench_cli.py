"""`kvprefetch poolbench`: a new DRAM pool's ways to get its memory, side by side (the measurement behind
`SharedChunkPool`'s default reserve; see kvprefetch.bench.micro.poolbench)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated

import typer


def poolbench(
    pool: Annotated[str, typer.Option(help="Pool size, every way's alike.")] = "2GiB",
    chunk: Annotated[str, typer.Option(help="Chunk payload size.")] = "16MiB",
    chunks: Annotated[int, typer.Option(min=1, help="Chunks the first request loads.")] = 8,
    repeats: Annotated[int, typer.Option(min=1, help="Interleaved rounds; medians (min-max) reported.")] = 3,
    json_path: Annotated[Path | None, typer.Option("--json", help="Write the rounds and the summary here.")] = None,
) -> None:
    """DRAM pool reserve ways (touch, fallocate, first_write): creation time vs the first request's load."""
    from kvprefetch.bench.micro.poolbench import run_poolbench, summarize
    from kvprefetch.cli_args import parse_size

    pool_bytes, chunk_bytes = parse_size(pool), parse_size(chunk)
    runs = run_poolbench(pool_bytes, chunk_bytes, chunks, repeats, progress=_print_round)
    summary = summarize(runs)
    _print_summary(summary, pool, chunk, chunks, repeats)
    if json_path:
        args = {"pool": pool, "chunk": chunk, "chunks": chunks, "repeats": repeats, "json": str(json_path)}
        json_path.write_text(json.dumps({"args": args, "runs": runs, "summary": summary}))


def _print_round(r: int, way: str, figures: dict) -> None:
    print(f"round {r + 1} {way:<11} " + " ".join(f"{k}={v:.3f}" for k, v in figures.items() if k.endswith("_s")),
          flush=True)  # fmt: skip


def _print_summary(summary: dict[str, dict], pool: str, chunk: str, chunks: int, repeats: int) -> None:
    from kvprefetch.tiers.dram import SHM_DIR

    print(f"\n{pool} pool in {SHM_DIR}, first request loads {chunks} x {chunk}; medians of {repeats} (min-max)")
    print(f"{'way':<12} {'create s':>20} {'first load s':>20} {'touched load s':>20} {'RAM held GiB':>13}")
    for way, cols in summary.items():
        cell = [f"{c['median']:.3f} ({c['min']:.2f}-{c['max']:.2f})" for c in list(cols.values())[:3]]
        print(f"{way:<12} {cell[0]:>20} {cell[1]:>20} {cell[2]:>20} {cols['held_gib']:>13.2f}")


def register(app: typer.Typer) -> None:
    app.command("poolbench")(poolbench)
