"""`kvprefetch remotebench`: remote-tier read bandwidth per backend, ours next to the raw client; and the CPU per MiB
each backend costs a node receiving and sending, next to memcpy and the socket floors (`remote_cpu`)."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console
from rich.table import Table

console = Console(width=None if sys.stdout.isatty() else 132)  # the CPU table is wide; logs keep it whole


def remotebench(
    backend: Annotated[list[str] | None, typer.Option(help="redis and/or mooncake (started on loopback).")] = None,
    chunk: Annotated[str, typer.Option(help="Chunk payload size.")] = "1MiB",
    chunks: Annotated[int, typer.Option(min=1, help="Chunks written then read back.")] = 256,
    threads: Annotated[int, typer.Option(min=1, max=64)] = 4,
    repeats: Annotated[int, typer.Option(min=1, max=20)] = 3,
    bandwidth: Annotated[bool, typer.Option(help="Measure read bandwidth through the store vs the raw client.")] = True,
    cpu: Annotated[bool, typer.Option(help="Measure CPU per MiB received and sent vs memcpy and the floors.")] = True,
    cpu_sizes: Annotated[str, typer.Option(help="Value sizes for the CPU table, comma-separated.")] = "1MiB,4MiB,16MiB",
    cpu_bytes: Annotated[str, typer.Option(help="Bytes each path moves per size and round (CPU table).")] = "64MiB",
    json_path: Annotated[Path | None, typer.Option("--json", help="Write the rows as JSON here.")] = None,
) -> None:
    """Remote tier (Redis, Mooncake Store): read bandwidth through kvprefetch vs the raw client, and CPU per MiB
    received and sent vs memcpy and a plain socket loop, one run."""
    from kvprefetch.cli_args import parse_size

    backends = backend or ["redis", "mooncake"]
    unknown = set(backends) - {"redis", "mooncake"}
    if unknown:
        raise typer.BadParameter(f"unknown backend(s) {sorted(unknown)}: choose redis and/or mooncake")
    out: dict = {}
    with console.status("remotebench") as status:
        if bandwidth:
            from kvprefetch.bench.micro.remotebench import run_all

            out["bandwidth"] = run_all(backends, parse_size(chunk), chunks, threads, repeats, status.update)
        if cpu:
            from kvprefetch.bench.micro.remote_cpu import run_cpu

            sizes = [parse_size(s) for s in cpu_sizes.split(",") if s.strip()]
            out["cpu"] = run_cpu(backends, sizes, parse_size(cpu_bytes), repeats, status.update)
    if "bandwidth" in out:
        _bandwidth_table(out["bandwidth"], chunk, chunks, repeats)
    if "cpu" in out:
        _cpu_table(out["cpu"], repeats)
    if json_path is not None:
        json_path.write_text(json.dumps({k: [r.to_json() for r in rows] for k, rows in out.items()}, indent=2) + "\n")
        console.print(f"wrote {json_path}")


def _bandwidth_table(rows: list, chunk: str, chunks: int, repeats: int) -> None:
    table = Table(title=f"remote tier reads, {chunks} chunks of {chunk}, medians of {repeats} interleaved rounds")
    for col in ("backend", "raw client GB/s", "prefetch -> DRAM GB/s", "ours/raw", "get_into GB/s",
                "get_into/raw", "write-through GB/s"):  # fmt: skip
        table.add_column(col, justify="right")
    for r in rows:
        table.add_row(r.backend, f"{r.raw_read_gbps:.2f}", f"{r.prefetch_read_gbps:.2f}", f"{r.prefetch_over_raw:.2f}x",
                      f"{r.get_into_gbps:.2f}", f"{r.get_into_over_raw:.2f}x", f"{r.write_gbps:.2f}")  # fmt: skip
    console.print(table)


def _cpu_table(rows: list, repeats: int) -> None:
    """One line per value size and path: receive and send side by side, each with its ratio to the floors."""
    from kvprefetch.bench.micro.remote_cpu import FLOOR, FRAMED, RECV, SEND

    order = [FLOOR, FRAMED, "memcpy", "xxh3", "redis", "redis x8", "redis-py", "redis TLS", "redis-py TLS", "mooncake"]

    table = Table(title=f"process CPU ms per MiB moved, one value per round trip, medians of {repeats} rounds "
                        "(x floor: over the plain socket loop; x framed: over it with RESP framing)")  # fmt: skip
    for col in ("value", "path", "recv ms/MiB", "x floor", "x framed", "send ms/MiB", "x floor", "recv GB/s (wall)"):
        table.add_column(col, justify="right")
    by_key = {(r.value_bytes, r.path, r.direction): r for r in rows}
    keys = sorted({(r.value_bytes, r.path) for r in rows}, key=lambda k: (k[0], order.index(k[1])))
    for size, path in keys:
        recv, send = by_key.get((size, path, RECV)), by_key.get((size, path, SEND))
        table.add_row(f"{size / (1 << 20):g} MiB", path, _ms(recv), _x(recv and recv.over_floor),
                      _x(recv and recv.over_framed), _ms(send), _x(send and send.over_floor),
                      f"{recv.gbps:.2f}" if recv else "")  # fmt: skip
    console.print(table)


def _ms(row) -> str:
    return f"{row.cpu_ms_per_mib:.3f}" if row else ""


def _x(ratio: float | None) -> str:
    return f"{ratio:.2f}x" if ratio else ""


def register(app: typer.Typer) -> None:
    app.command("remotebench")(remotebench)
