"""`kvprefetch status`: what the node's cache holds and who is attached, without starting an engine; frees idle pools.

It looks at each pool as an observer (no process row of its own), so looking neither keeps a pool alive nor
changes when it was last used; a pool idle past its keep_idle_s is removed on sight, as any attach would.
"""

from __future__ import annotations

import datetime as dt
import json
import time
from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console
from rich.table import Table

from kvprefetch.config import ConfigError, StoreConfig
from kvprefetch.tiers.access import FileAccess
from kvprefetch.tiers.disk import DiskTier
from kvprefetch.tiers.dram import SHM_DIR, PoolExpired, PoolInUse, SharedChunkPool, hugetlbfs_mount

console = Console()


def pools_on_node() -> list[Path]:
    dirs = [d for d in (SHM_DIR, hugetlbfs_mount()) if d is not None]
    return sorted(p for d in dirs for p in d.glob("kvprefetch-*.pool"))


def pool_name(path: Path) -> str:
    return path.name.removeprefix("kvprefetch-").removesuffix(".pool")


def inspect_pool(path: Path, access: FileAccess, reap: bool, remove: bool) -> dict:
    """One pool's report; with remove, the pool is removed if idle (report["removed"]) or refused if in use."""
    name = pool_name(path)
    row: dict = {"name": name, "path": str(path)}
    try:
        pool = SharedChunkPool.attach(name, path.parent, access, observer=True)
    except PoolExpired as err:
        return row | {"removed": f"expired: {err}"}
    except (OSError, ValueError) as err:
        return row | {"error": str(err)}
    with pool:
        row["reaped_dead_processes"] = pool.reap_dead() if reap else 0
        row |= pool.stats()
        usage = pool.usage()
        row |= {"pids": list(usage.pids), "keep_idle_s": usage.keep_idle_s, "last_used": usage.last_used}
        if remove:
            try:
                pool.remove_if_idle()
                row["removed"] = "removed by request"
            except PoolInUse as err:
                row["refused"] = str(err)
    return row


def _last_used(p: dict) -> str:
    if p["pids"]:
        return "in use"
    ago = time.time() - p["last_used"]
    when = dt.datetime.fromtimestamp(p["last_used"]).strftime("%Y-%m-%d %H:%M:%S")
    return f"{when} ({ago / 60:.0f} min ago)" if ago >= 60 else f"{when} ({ago:.0f} s ago)"


def _policy(p: dict) -> str:
    keep = p["keep_idle_s"]
    return "until removed" if keep is None else "free at detach" if keep == 0 else f"{keep:g} s idle"


def status(
    config: Annotated[Path | None, typer.Option("--config", "-c", help="YAML file naming the disk tier.")] = None,
    reap: Annotated[bool, typer.Option(help="Release the pins and half-written slots of dead processes.")] = True,
    remove: Annotated[
        list[str] | None, typer.Option("--remove", help="Free this idle pool's RAM (refused while processes use it).")
    ] = None,
    gc: Annotated[bool, typer.Option("--gc", help="Free every pool no process uses, whatever its policy.")] = False,
    as_json: Annotated[bool, typer.Option("--json", help="Print JSON instead of tables.")] = False,
) -> None:
    """DRAM pools on this node (RAM held, processes, last use, slots, pins), the leases of every engine running the
    connector, and the configured disk tier.

    A pool idle past its keep_idle_s is removed as soon as this command sees it.
    """
    try:
        cfg = StoreConfig.load(config)
    except ConfigError as err:
        console.print(f"[red]{err}[/red]")
        raise typer.Exit(2) from None
    access = FileAccess.for_group(cfg.share_group)
    paths = pools_on_node()
    wanted = set(remove or ())
    unknown = wanted - {pool_name(p) for p in paths}
    if unknown:
        console.print(f"[red]no DRAM pool named {', '.join(sorted(unknown))} on this node[/red]")
        raise typer.Exit(2)
    report: dict = {"pools": [inspect_pool(p, access, reap, gc or pool_name(p) in wanted) for p in paths], "disk": None}
    report["leases"] = engines_leases()
    if cfg.disk_enabled and cfg.disk.path.exists():
        report["disk"] = DiskTier(cfg.disk.path, int(cfg.disk.capacity_bytes), access=access).stats()
    refused = [p for p in report["pools"] if "refused" in p and (p["name"] in wanted)]
    if as_json:
        print(json.dumps(report, indent=2))
    else:
        _print(report, cfg)
    if refused:
        raise typer.Exit(1)


def engines_leases() -> dict[str, dict]:
    """Leases of every engine on this node running the connector, by engine id (asked over its warm-up socket:
    leases live in the engine's scheduler process, their pins in the pools above)."""
    from kvprefetch.vllm.warm_api import engine_leases, live_engines

    return {e: engine_leases(e) for e in live_engines()}


def _print_leases(leases: dict[str, dict]) -> None:
    for engine, got in leases.items():
        if "error" in got:
            console.print(f"[yellow]engine {engine}: leases unknown ({got['error']})[/yellow]")
            continue
        table = Table(title=f"Leases of engine {engine}: {got['lease_chunks_reserved']} of "
                            f"{got['lease_budget_chunks']} DRAM slots reserved, {got['lease_chunks_pinned']} pinned")
        for col in ("id", "origin", "slots", "pinned", "seconds left"):
            table.add_column(col)
        for x in got["list"]:
            table.add_row(x["id"], x["origin"], str(x["keys"]), str(x["pinned"]), f"{x['remaining_s']:.1f}")
        console.print(table if got["list"] else f"engine {engine}: no lease")


def _print(report: dict, cfg: StoreConfig) -> None:
    table = Table(title="DRAM pools on this node")
    for col in ("name", "backing", "RAM held GiB", "of GiB", "ready / slots", "pinned", "processes", "last used",
                "kept", "reaped"):  # fmt: skip
        table.add_column(col)
    for p in report["pools"]:
        if "error" in p or "capacity_bytes" not in p:
            note = f"[red]{p['error']}[/red]" if "error" in p else p["removed"]
            table.add_row(p["name"], "-", note, *[""] * 7)
            continue
        processes = ", ".join(map(str, p["pids"])) or "0"
        table.add_row(p["name"], str(Path(p["path"]).parent), f"{p['held_bytes'] / 2**30:.2f}",
                      f"{p['capacity_bytes'] / 2**30:.2f}", f"{p['slots_ready']} / {p['slots_total']}",
                      str(p["slots_pinned"]), processes, _last_used(p), _policy(p),
                      str(p["reaped_dead_processes"]))  # fmt: skip
    console.print(table if report["pools"] else "no DRAM pool on this node")
    for p in report["pools"]:
        if "removed" in p and "capacity_bytes" in p:
            console.print(f"removed {p['name']}: freed {p['held_bytes'] / 2**30:.2f} GiB")
        if "refused" in p:
            console.print(f"[red]not removed: {p['refused']}[/red]")
    _print_leases(report.get("leases") or {})
    d = report["disk"]
    if d:
        console.print(f"disk tier {d['root']}: {d['chunks']} chunks, {d['bytes_used'] / 2**30:.2f} of "
                      f"{d['capacity_bytes'] / 2**30:.2f} GiB, O_DIRECT {d['direct_io']}")  # fmt: skip
    else:
        console.print(f"disk tier {cfg.disk.path}: none yet")


def register(app: typer.Typer) -> None:
    app.command("status")(status)
