"""`kvprefetch serve`: vLLM's OpenAI server with the connector, its configuration checked before vLLM starts."""

from __future__ import annotations

import json
import os
import shlex
from pathlib import Path
from typing import Annotated, Any

import typer
from rich.console import Console

from kvprefetch.config import ConfigError, default_cache_dir

console = Console(stderr=True)
# vLLM's default (0) force-kills the engine on SIGTERM at once: the connector would never drain its write-back
# or detach from the DRAM pool. A grace period lets vLLM run the connector's shutdown.
SHUTDOWN_TIMEOUT_S = 30
TINY = "kvprefetch-tiny"
WARM_MIDDLEWARE = "kvprefetch.vllm.warm_api.WarmMiddleware"  # MODEL naming the shipped tiny test model


def build_extra(config: Path | None, extra_json: str | None, sets: list[str]) -> dict[str, Any]:
    """The connector's extra config: `config_path`, then the JSON object, then each KEY=VALUE (dotted keys nest;
    values parse as JSON where they can, e.g. prefetch=false, dram.capacity_bytes=\"8GiB\")."""
    extra: dict[str, Any] = {}
    if config is not None:
        if not config.is_file():
            raise ConfigError(f"kvprefetch config file not found: {config}")
        extra["config_path"] = str(config.resolve())
    if extra_json:
        try:
            obj = json.loads(extra_json)
        except ValueError as err:
            raise ConfigError(f"--extra is not JSON: {err}") from None
        if not isinstance(obj, dict):
            raise ConfigError("--extra must be a JSON object")
        extra |= obj
    for item in sets:
        key, eq, raw = item.partition("=")
        if not eq or not key:
            raise ConfigError(f"--set takes KEY=VALUE, got {item!r}")
        try:
            value = json.loads(raw)
        except ValueError:
            value = raw
        node = extra
        *parents, leaf = key.split(".")
        for p in parents:
            node = node.setdefault(p, {})
            if not isinstance(node, dict):
                raise ConfigError(f"--set {key}: {p} is not a section")
        node[leaf] = value
    return extra


def checked_transfer_config(extra: dict[str, Any]) -> dict[str, Any]:
    """vLLM's kv_transfer_config for `extra` (`kvprefetch.vllm.transfer_config`, which checks it as the connector
    will: store config and connector keys), so a typo fails here, not in vLLM."""
    from kvprefetch.vllm import transfer_config

    try:
        return transfer_config(extra)
    except (ValueError, ConfigError) as err:
        raise ConfigError(f"kvprefetch connector config: {err}") from None


def serve(
    ctx: typer.Context,
    model: Annotated[str, typer.Argument(help=f"Model name or path, as for `vllm serve` ({TINY}: the shipped "
                                          "tiny test model, dummy weights, word-level tokenizer; also "
                                          f"{TINY}-hybrid, sliding window, and {TINY}-mla).")],
    config: Annotated[Path | None, typer.Option("--config", "-c", help="kvprefetch YAML (store + connector).")] = None,
    extra: Annotated[str | None, typer.Option("--extra", help="Connector extra config as a JSON object.")] = None,
    sets: Annotated[list[str] | None, typer.Option("--set", help="KEY=VALUE over the config (dotted keys).")] = None,
    connector: Annotated[bool, typer.Option("--connector/--no-connector", help="--no-connector: vLLM alone.")] = True,
    dry_run: Annotated[bool, typer.Option("--dry-run", help="Print the vLLM command instead of running it.")] = False,
) -> None:
    """Start vLLM's OpenAI server with the kvprefetch connector (arguments after MODEL go to vLLM).

    e.g. `kvprefetch serve meta-llama/Llama-3.1-8B -c kvprefetch.yaml --port 8000 --max-model-len 32768`
    """
    from kvprefetch.testbed.server import TINY_MODEL_ARGS, TINY_MODELS, server_argv, with_word_tokenizer

    vllm_args = list(ctx.args)
    if model in TINY_MODELS and not Path(model).exists():  # (and the hybrid and MLA ones: kvprefetch-tiny-hybrid, -mla)
        packaged = TINY_MODELS[model]
        model = str(with_word_tokenizer(packaged, default_cache_dir() / packaged.name))
        vllm_args = [*TINY_MODEL_ARGS, *vllm_args]
    transfer = None
    if connector:
        try:
            transfer = checked_transfer_config(build_extra(config, extra, sets or []))
        except ConfigError as err:
            console.print(f"[red]{err}[/red]")
            raise typer.Exit(2) from None
        vllm_args += ["--middleware", WARM_MIDDLEWARE]  # POST /v1/kvprefetch/warm on vLLM's own port
    if not any(a == "--shutdown-timeout" or a.startswith("--shutdown-timeout=") for a in vllm_args):
        vllm_args += ["--shutdown-timeout", str(SHUTDOWN_TIMEOUT_S)]
    argv = server_argv(model, transfer, vllm_args)
    if dry_run:
        print(shlex.join(argv))
        return
    console.print(f"kvprefetch serve: {shlex.join(argv[1:])}")
    os.execv(argv[0], argv)  # vLLM becomes this process: signals (SIGTERM) reach it directly


def register(app: typer.Typer) -> None:
    app.command("serve", context_settings={"allow_extra_args": True, "ignore_unknown_options": True})(serve)
