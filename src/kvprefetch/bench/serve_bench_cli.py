"""`kvprefetch bench-serve`: the bench's modes through vLLM's OpenAI server and vLLM's own benchmark client.

`kvprefetch bench` drives in-process engines; this runs what a vLLM user runs: one OpenAI server per mode (the
same model and engine arguments, a different KV path), vLLM's `vllm bench serve` client with the
`prefix_repetition` dataset against each in turn, the same prompts in every round, so the figures compare
directly with the user's own `vllm bench serve` runs.
"""

from __future__ import annotations

import json
import shutil
import uuid
from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console
from rich.table import Table

console = Console()
SERVER_MODES = ("recompute", "ondemand", "ondemand-sync", "ondemand-serial", "prefetch", "vllm-example")


def bench_serve(
    model: Annotated[str, typer.Option(help="Model path or name; kvprefetch-tiny: the shipped tiny model.")] = (
        "kvprefetch-tiny"
    ),
    mode: Annotated[str, typer.Option(help=f"Comma list of modes ({', '.join(SERVER_MODES)}).")] = "recompute,prefetch",
    rounds: Annotated[str, typer.Option(help="Rounds, each repeating the same prompts.")] = "cold,warm",
    num_prompts: Annotated[int, typer.Option(min=1)] = 16,
    num_prefixes: Annotated[int, typer.Option(min=1)] = 4,
    prefix_len: Annotated[int, typer.Option(min=1)] = 1024,
    suffix_len: Annotated[int, typer.Option(min=1)] = 256,
    output_len: Annotated[int, typer.Option(min=1)] = 4,
    concurrency: Annotated[int, typer.Option(min=1)] = 2,
    kv_cache: Annotated[str, typer.Option(help="The engine's own KV cache (its prefix cache) per server.")] = "8MiB",
    dram: Annotated[str, typer.Option(help="kvprefetch's DRAM tier per server.")] = "256MiB",
    chunk_tokens: Annotated[int, typer.Option(min=16)] = 256,
    max_model_len: Annotated[int, typer.Option(min=16)] = 1536,
    vllm_arg: Annotated[list[str] | None, typer.Option("--vllm-arg", help="Extra vLLM argument (repeat).")] = None,
    out: Annotated[Path | None, typer.Option(help="Output directory (default: bench-results/serve-<id>/).")] = None,
) -> None:
    """Compare the bench's modes through vLLM's OpenAI server, measured by vLLM's own benchmark client."""
    from kvprefetch.bench.modes import StoreSizing, kv_transfer_config
    from kvprefetch.cli_args import parse_size
    from kvprefetch.testbed.server import (
        TINY_MODEL_ARGS,
        PrefixWorkload,
        compare_servers,
        server_argv,
        tiny_model_dir,
    )

    modes = [m for m in mode.replace(" ", "").split(",") if m]
    bad = [m for m in modes if m not in SERVER_MODES]
    if bad or not modes:
        raise typer.BadParameter(f"modes must be among {', '.join(SERVER_MODES)}, got {mode!r}")
    round_names = [r for r in rounds.replace(" ", "").split(",") if r]
    work = out or Path("bench-results") / f"serve-{uuid.uuid4().hex[:8]}"
    work.mkdir(parents=True, exist_ok=True)
    engine_args = list(vllm_arg or [])
    if model == "kvprefetch-tiny":
        model = str(tiny_model_dir(work / "model"))
        engine_args = [*TINY_MODEL_ARGS, *engine_args]
    engine_args += [
        "--kv-cache-memory-bytes", str(parse_size(kv_cache)), "--max-model-len", str(max_model_len),
        "--max-num-seqs", str(concurrency), "--seed", "0", "--shutdown-timeout", "30",
    ]  # fmt: skip
    sizing = StoreSizing(chunk_tokens=chunk_tokens, dram_bytes=parse_size(dram), disk_bytes=8 << 30)
    tag = uuid.uuid4().hex[:8]
    servers = {
        m: server_argv(model, kv_transfer_config(m, sizing, work / f"disk-{m}", f"kvp-serve-{tag}-{m}"), engine_args)
        for m in modes
    }
    workload = PrefixWorkload(num_prompts, prefix_len, suffix_len, num_prefixes, output_len, concurrency)
    console.print(
        f"bench-serve: {len(modes)} OpenAI server(s) starting, then vllm bench serve ({num_prompts} prompts, "
        f"{num_prefixes} prefixes, concurrency {concurrency}); logs in {work}"
    )
    try:
        result = compare_servers(servers, model, workload, work, rounds=round_names)
    finally:
        for m in modes:  # the DRAM pools outlive their servers by design; these are the run's own
            for f in Path("/dev/shm").glob(f"*kvp-serve-{tag}-{m}*"):
                f.unlink(missing_ok=True)
            shutil.rmtree(work / f"disk-{m}", ignore_errors=True)
    table = Table(title="vllm bench serve (prefix_repetition) through the OpenAI server")
    for col in ("mode", "round", "done/failed", "mean TTFT ms", "median TTFT ms", "p99 TTFT ms", "mean vs recompute"):
        table.add_column(col, justify="right" if "TTFT" in col or "vs" in col else "left")
    rows = {}
    for m in modes:
        for r in round_names:
            res = result.rounds[f"{m}-{r}"].result
            base = result.rounds.get(f"recompute-{r}")
            ratio = f"{res['mean_ttft_ms'] / base.mean_ttft_ms:.2f}x" if base and m != "recompute" else "-"
            table.add_row(m, r, f"{res['completed']}/{res.get('failed', 0)}", f"{res['mean_ttft_ms']:.1f}",
                          f"{res['median_ttft_ms']:.1f}", f"{res['p99_ttft_ms']:.1f}", ratio)  # fmt: skip
            rows[f"{m}-{r}"] = {k: res[k] for k in ("completed", "failed", "mean_ttft_ms", "median_ttft_ms",
                                                    "p99_ttft_ms", "duration") if k in res}  # fmt: skip
    console.print(table)
    (work / "results.json").write_text(json.dumps({"model": model, "workload": workload.__dict__, "rounds": rows},
                                                  indent=2) + "\n")  # fmt: skip
    console.print(f"wrote {work / 'results.json'} (vLLM's per-round results: {work / 'results'})")


def register(app: typer.Typer) -> None:
    app.command("bench-serve")(bench_serve)
