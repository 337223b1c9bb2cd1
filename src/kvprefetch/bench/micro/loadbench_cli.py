"""`kvprefetch loadbench`: the weight loaders side by side (see kvprefetch.bench.micro.loadbench)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console
from rich.table import Table

console = Console()


def loadbench(
    model: Annotated[
        Path | None, typer.Option(help="Checkpoint directory (default: a random Llama made once in --dir).")
    ] = None,
    directory: Annotated[Path | None, typer.Option("--dir", help="Work directory (default: the cache dir).")] = None,
    layers: Annotated[int, typer.Option(help="Layers of the generated checkpoint.")] = 20,
    hidden: Annotated[int, typer.Option(help="Hidden size of the generated checkpoint.")] = 2048,
    shard_size: Annotated[str, typer.Option(help="max_shard_size of the generated checkpoint.")] = "700MB",
    repeats: Annotated[int, typer.Option(min=1, max=20, help="Rounds; every mode once per round, medians.")] = 3,
    network_gbps: Annotated[float, typer.Option(help="Bandwidth of the throttled 'network storage' regime.")] = 0.2,
    extra: Annotated[str, typer.Option(help="JSON: kvprefetch loader settings for all its passes.")] = "{}",
    json_path: Annotated[Path | None, typer.Option("--json", help="Write the rows as JSON here.")] = None,
) -> None:
    """Load one checkpoint with vLLM's default loader, runai_streamer, fastsafetensors and kvprefetch (cold
    local, cold from throttled 'network' storage, warm from the node's DRAM pool and from the disk cache), next
    to fio's ceiling."""
    from kvprefetch.bench.micro.loadbench import LoadBench, goals, make_checkpoint, plot, timestamp
    from kvprefetch.config import default_cache_dir
    from kvprefetch.loader.settings import LoaderSettings

    settings = LoaderSettings.from_extra_config(json.loads(extra))
    work = (directory or default_cache_dir() / "loadbench").expanduser()
    work.mkdir(parents=True, exist_ok=True)
    if model is None:
        model = work / f"llama-{layers}x{hidden}-bf16"
        if not model.exists():
            console.print(f"writing a random checkpoint to {model} ...")
            make_checkpoint(model, layers, hidden, shard_size)
    bench = LoadBench(
        model,
        work,
        repeats,
        int(network_gbps * 1e9),
        settings.model_dump(mode="json", exclude_defaults=True),
        int(settings.block_bytes),
        progress=lambda s: console.print(f"[dim]{s}[/dim]"),
    )
    from kvprefetch.bench.micro.hugepages import reserved_huge_pages

    with reserved_huge_pages(huge_page_bytes(settings, model)) as huge:
        if not huge:
            bench.notes.append("no huge pages could be reserved: shard buffers and fio's on ordinary pages")
        bench.huge_pages = huge
        rows = bench.run()
    from kvprefetch.loader.shards import open_checkpoint

    ckpt = open_checkpoint(model)
    size = f"{ckpt.total_bytes / 1e9:.2f} GB in {len(ckpt.shards)} shards"
    title = f"kvprefetch loadbench: {model.name}, {size}, median of {repeats}"
    table = Table(title=title)
    for col in ("loader", "regime", "seconds", "GB/s", "vs default", "samples / why unavailable"):
        table.add_column(col, justify="left" if col in ("loader", "regime", "samples / why unavailable") else "right")
    for r in rows:
        table.add_row(
            r.loader,
            r.regime,
            f"{r.seconds:.2f}" if r.seconds else "-",
            f"{r.gbps:.2f}" if r.gbps else "-",
            f"{r.ratio_to_default:.2f}x" if r.ratio_to_default else "-",
            " ".join(f"{s:.2f}" for s in r.samples) if r.samples else f"unavailable: {r.unavailable}",
        )
    console.print(table)
    for note in bench.notes:
        console.print(f"  {note}")
    for name, value, target, met in goals(rows):
        verdict = "n/a" if met is None else "met" if met else "NOT met"
        console.print(f"  goal {name}: {'-' if value is None else f'{value:.2f}x'} (target >= {target}x): {verdict}")
    out = work / f"loadbench-{timestamp()}"
    out.mkdir(exist_ok=True)
    payload = {
        "model": str(model),
        "total_bytes": ckpt.total_bytes,
        "shards": len(ckpt.shards),
        "repeats": repeats,
        "notes": bench.notes,
        "identity_seconds": bench.identity_seconds,
        "rows": [r.as_json() for r in rows],
        "goals": [{"goal": n, "ratio": v, "target": t, "met": m} for n, v, t, m in goals(rows)],
    }
    (out / "results.json").write_text(json.dumps(payload, indent=2) + "\n")
    plot(rows, out / "loadbench.png", title)
    if json_path is not None:
        json_path.write_text(json.dumps(payload, indent=2) + "\n")
    console.print(f"wrote {out}/results.json and loadbench.png")


def huge_page_bytes(settings, model: Path) -> int:
    """What one pass may hold on huge pages: its shard buffers (the one being copied, the ones read ahead, and one
    whose last tensor vLLM still holds), its and the cache's staging buffers, and fio's deepest queue."""
    from kvprefetch.loader.shards import open_checkpoint

    largest = max(s.size for s in open_checkpoint(model).shards)
    shards = (2 + settings.lookahead_shards) * (largest + (2 << 20))
    staging = (settings.threads + 4) * (int(settings.block_bytes) + (8 << 20)) * 2
    return shards + staging + 16 * int(settings.block_bytes)


def register(app: typer.Typer) -> None:
    app.command("loadbench")(loadbench)
