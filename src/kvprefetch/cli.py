"""The `kvprefetch` command line: benchmarks, the simulator, and configuration checks."""

from __future__ import annotations

import json
import shutil
import signal
import sys
from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console

from kvprefetch.config import ConfigError, StoreConfig

app = typer.Typer(no_args_is_help=True, add_completion=False, help=__doc__)
console = Console()


# The commands that start (and kill) vLLM engines of their own; `serve` is a user's server and keeps vLLM's folder.
ENGINE_COMMANDS = frozenset({"bench", "bench-serve", "soak-serve", "loadbench"})


@app.callback()
def _engine_sockets(ctx: typer.Context) -> None:
    """A command that starts vLLM engines gives their ZeroMQ sockets a folder of its own, removed when it ends
    (`kvprefetch.testbed.client.own_socket_folder`)."""
    if ctx.invoked_subcommand not in ENGINE_COMMANDS:
        return
    from kvprefetch.testbed.client import own_socket_folder

    folder = own_socket_folder()
    if folder is not None:
        ctx.call_on_close(lambda: shutil.rmtree(folder, ignore_errors=True))


@app.command()
def version() -> None:
    """Print the version."""
    from kvprefetch import __version__

    print(__version__)


@app.command("config")
def show_config(
    path: Annotated[Path | None, typer.Option("--config", "-c", help="YAML file to load.")] = None,
) -> None:
    """Validate and print the effective store configuration (file + KVPREFETCH_* environment + defaults), with the
    chunk size the vLLM connector would use with it (the connector owns it; its default where nothing sets it)."""
    from kvprefetch.vllm.settings import DEFAULT_CHUNK_TOKENS

    try:
        cfg = StoreConfig.load(path)
    except ConfigError as err:
        console.print(f"[red]{err}[/red]")
        raise typer.Exit(2) from None
    shown = cfg.model_copy(update={"chunk_tokens": cfg.chunk_tokens or DEFAULT_CHUNK_TOKENS})
    print(json.dumps(shown.model_dump(mode="json"), indent=2))


def _register_subcommands() -> None:
    from kvprefetch.bench.bench_cli import register as register_bench
    from kvprefetch.bench.micro.iobench_cli import register as register_iobench
    from kvprefetch.bench.micro.loadbench_cli import register as register_loadbench
    from kvprefetch.bench.micro.poolbench_cli import register as register_poolbench
    from kvprefetch.bench.micro.remotebench_cli import register as register_remotebench
    from kvprefetch.bench.serve_bench_cli import register as register_bench_serve
    from kvprefetch.bench.soak_serve import register as register_soak_serve
    from kvprefetch.events_cli import register as register_events
    from kvprefetch.serve_cli import register as register_serve
    from kvprefetch.sim.cli import register as register_sim
    from kvprefetch.status_cli import register as register_status
    from kvprefetch.trace_cli import register as register_trace

    register_iobench(app)  # first, where its @app.command() stood: `kvprefetch --help` lists the same order
    register_sim(app)
    register_bench(app)
    register_remotebench(app)
    register_status(app)
    register_trace(app)
    register_loadbench(app)
    register_poolbench(app)
    register_serve(app)
    register_bench_serve(app)
    register_events(app)
    register_soak_serve(app)


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
