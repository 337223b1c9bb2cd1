"""`kvprefetch loadbench`: the weight loaders side by side (see kvprefetch.bench.micro.loadbench)."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer
from rich.console import Console
from rich.table import Table

if TYPE_CHECKING:  # the bench and the loader load when the command runs, not at every `kvprefetch` start
    from kvprefetch.bench.micro.loadbench import LoadBench, Row
    from kvprefetch.loader.settings import LoaderSettings

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
    from kvprefetch.bench.micro.loadbench import timestamp
    from kvprefetch.config import default_cache_dir
    from kvprefetch.loader.settings import LoaderSettings

    settings = LoaderSettings.from_extra_config(json.loads(extra))
    work = (directory or default_cache_dir() / "loadbench").expanduser()
    work.mkdir(parents=True, exist_ok=True)
    if model is None:
        model = _generated_checkpoint(work, layers, hidden, shard_size)
    bench = _bench(model, work, repeats, network_gbps, settings)
    rows = _run(bench, settings)
    report = _report(bench, rows)
    _print_report(report, bench.notes)
    out = work / f"loadbench-{timestamp()}"
    _write(report, out, json_path)
    console.print(f"wrote {out}/results.json, loadbench.png and loadbench_timeline.png (each of our loads' blocks)")


def _generated_checkpoint(work: Path, layers: int, hidden: int, shard_size: str) -> Path:
    """The random Llama of this shape in the work directory, written on the first run that asks for it."""
    from kvprefetch.bench.micro.loadbench import make_checkpoint

    model = work / f"llama-{layers}x{hidden}-bf16"
    if not model.exists():
        console.print(f"writing a random checkpoint to {model} ...")
        make_checkpoint(model, layers, hidden, shard_size)
    return model


def _bench(model: Path, work: Path, repeats: int, network_gbps: float, settings: LoaderSettings) -> LoadBench:
    """The comparison, set up: our passes run with the settings that differ from the defaults."""
    from kvprefetch.bench.micro.loadbench import LoadBench

    return LoadBench(
        model,
        work,
        repeats,
        int(network_gbps * 1e9),
        settings.model_dump(mode="json", exclude_defaults=True),
        int(settings.block_bytes),
        progress=lambda s: console.print(f"[dim]{s}[/dim]"),
    )


def _run(bench: LoadBench, settings: LoaderSettings) -> list[Row]:
    """Every pass, on huge pages reserved for the run where they can be had (fio's sweep then tries them too);
    with ``--extra '{"huge_pages": false}'`` none are reserved, as on a node that has none."""
    from kvprefetch.bench.micro.hugepages import reserved_huge_pages

    if not settings.huge_pages:  # a node without reserved huge pages, as most are
        bench.notes.append("huge pages off (huge_pages false): shard buffers and fio's on ordinary pages")
        return bench.run()
    with reserved_huge_pages(huge_page_bytes(settings, bench.model)) as huge:
        if not huge:
            bench.notes.append("no huge pages could be reserved: shard buffers and fio's on ordinary pages")
        bench.huge_pages = huge
        return bench.run()


@dataclass(frozen=True)
class _Report:
    """What the run printed and wrote: the rows, the goals judged on them, and results.json's content."""

    title: str
    rows: list[Row]
    goals: list[tuple[str, float | None, float, bool | None]]
    payload: dict


def _report(bench: LoadBench, rows: list[Row]) -> _Report:
    """The checkpoint's size in the title, the goals and R9's ratios judged once for the screen and the file
    alike."""
    from kvprefetch.bench.micro.loadbench import WHITEPAPER_R9, goals, whitepaper_comparison
    from kvprefetch.loader.shards import open_checkpoint

    ckpt = open_checkpoint(bench.model)
    size = f"{ckpt.total_bytes / 1e9:.2f} GB in {len(ckpt.shards)} shards"
    title = f"kvprefetch loadbench: {bench.model.name}, {size}, median of {bench.repeats}"
    judged = goals(rows)
    payload = {
        "model": str(bench.model),
        "total_bytes": ckpt.total_bytes,
        "shards": len(ckpt.shards),
        "repeats": bench.repeats,
        "notes": bench.notes,
        "identity_seconds": bench.identity_seconds,
        "rows": [r.as_json() for r in rows],
        "goals": [{"goal": n, "ratio": v, "target": t, "met": m} for n, v, t, m in judged],
        "whitepaper_r9": {"range": list(WHITEPAPER_R9), "measured": dict(whitepaper_comparison(rows))},
        "timelines": bench.timelines,
    }
    return _Report(title, rows, judged, payload)


def _print_report(report: _Report, notes: list[str]) -> None:
    table = Table(title=report.title)
    for col in ("loader", "regime", "seconds", "GB/s", "vs default", "samples / why unavailable"):
        table.add_column(col, justify="left" if col in ("loader", "regime", "samples / why unavailable") else "right")
    for r in report.rows:
        table.add_row(
            r.loader,
            r.regime,
            _num(r.seconds),
            _num(r.gbps),
            f"{r.ratio_to_default:.2f}x" if r.ratio_to_default else "-",
            " ".join(f"{s:.2f}" for s in r.samples) if r.samples else f"unavailable: {r.unavailable}",
        )
    console.print(table)
    split = Table(title="where the seconds went (medians)")
    for col in ("loader", "regime", "CPU s/GB", "wait s", "vLLM copy s"):
        split.add_column(col, justify="left" if col in ("loader", "regime") else "right")
    for r in report.rows:
        if r.seconds:
            split.add_row(r.loader, r.regime, _num(r.cpu_s_per_gb), _num(r.wait_s), _num(r.handout_s))
    console.print(split)
    console.print("  CPU s/GB: the process's CPU (all threads, kernel included) per GB loaded; wait s: our loading "
                  "thread waiting for bytes; vLLM copy s: vLLM's time with the tensors we handed it")
    for note in notes:
        console.print(f"  {note}")
    for name, value, target, met in report.goals:
        verdict = "n/a" if met is None else "met" if met else "NOT met"
        console.print(f"  goal {name}: {'-' if value is None else f'{value:.2f}x'} (target >= {target}x): {verdict}")
    r9 = report.payload["whitepaper_r9"]
    lo, hi = r9["range"]
    for name, value in r9["measured"].items():
        console.print(f"  whitepaper R9 ({lo}-{hi}x faster than from NFS): {name} "
                      f"{'-' if value is None else f'{value:.2f}x'}")


def _num(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}"


def _write(report: _Report, out: Path, json_path: Path | None) -> None:
    """results.json and the plot in the run's own directory; the same JSON at --json too."""
    from kvprefetch.bench.micro.loadbench import plot, plot_timelines

    out.mkdir(exist_ok=True)
    text = json.dumps(report.payload, indent=2) + "\n"
    (out / "results.json").write_text(text)
    plot(report.rows, out / "loadbench.png", report.title)
    plot_timelines(report.payload["timelines"], out / "loadbench_timeline.png")
    if json_path is not None:
        json_path.write_text(text)


def huge_page_bytes(settings: LoaderSettings, model: Path) -> int:
    """What one pass may hold on huge pages: its shard buffers (the one being copied, the ones read ahead, and one
    whose last tensor vLLM still holds), its and the cache's staging buffers, and fio's deepest queue."""
    from kvprefetch.loader.shards import open_checkpoint

    largest = max(s.size for s in open_checkpoint(model).shards)
    shards = (2 + settings.lookahead_shards) * (largest + (2 << 20))
    staging = (settings.threads + 4) * (int(settings.block_bytes) + (8 << 20)) * 2
    return shards + staging + 16 * int(settings.block_bytes)


def register(app: typer.Typer) -> None:
    app.command("loadbench")(loadbench)
