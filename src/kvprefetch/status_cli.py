"""`kvprefetch status`: what the node's cache holds and who is attached, without starting an engine."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console
from rich.table import Table

from kvprefetch.config import ConfigError, StoreConfig
from kvprefetch.tiers.access import FileAccess
from kvprefetch.tiers.disk import DiskTier
from kvprefetch.tiers.dram import SHM_DIR, SharedChunkPool, hugetlbfs_mount

console = Console()


def pools_on_node() -> list[Path]:
    dirs = [d for d in (SHM_DIR, hugetlbfs_mount()) if d is not None]
    return sorted(p for d in dirs for p in d.glob("kvprefetch-*.pool"))


def status(
    config: Annotated[Path | None, typer.Option("--config", "-c", help="YAML file naming the disk tier.")] = None,
    reap: Annotated[bool, typer.Option(help="Release the pins and half-written slots of dead processes.")] = True,
    # (attaching to a pool always reaps: every process does so when it attaches)
    as_json: Annotated[bool, typer.Option("--json", help="Print JSON instead of tables.")] = False,
) -> None:
    """DRAM pools on this node (slots, pins, attached processes) and the configured disk tier."""
    try:
        cfg = StoreConfig.load(config)
    except ConfigError as err:
        console.print(f"[red]{err}[/red]")
        raise typer.Exit(2) from None
    access = FileAccess.for_group(cfg.share_group)
    report: dict = {"pools": [], "disk": None}
    for path in pools_on_node():
        name = path.name.removeprefix("kvprefetch-").removesuffix(".pool")
        try:
            pool = SharedChunkPool.attach(name, path.parent, access)
        except (OSError, ValueError) as err:
            report["pools"].append({"name": name, "path": str(path), "error": str(err)})
            continue
        with pool:
            reaped = pool.reaped_at_attach + (pool.reap_dead() if reap else 0)
            stats = pool.stats()
            stats["processes"] -= 1  # not counting this command
            report["pools"].append({"path": str(path), "reaped_dead_processes": reaped, **stats})
    if cfg.disk_enabled and cfg.disk.path.exists():
        report["disk"] = DiskTier(cfg.disk.path, int(cfg.disk.capacity_bytes), access=access).stats()
    if as_json:
        print(json.dumps(report, indent=2))
        return
    table = Table(title="DRAM pools on this node")
    for col in ("name", "backing", "ready / slots", "pinned", "GiB used", "processes", "reaped"):
        table.add_column(col)
    for p in report["pools"]:
        if "error" in p:
            table.add_row(p["name"], "-", f"[red]{p['error']}[/red]", "", "", "", "")
            continue
        table.add_row(p["name"], str(Path(p["path"]).parent), f"{p['slots_ready']} / {p['slots_total']}",
                      str(p["slots_pinned"]), f"{p['bytes_used'] / 2**30:.2f}", str(p["processes"]),
                      str(p["reaped_dead_processes"]))  # fmt: skip
    console.print(table if report["pools"] else "no DRAM pool on this node")
    d = report["disk"]
    if d:
        console.print(f"disk tier {d['root']}: {d['chunks']} chunks, {d['bytes_used'] / 2**30:.2f} of "
                      f"{d['capacity_bytes'] / 2**30:.2f} GiB, O_DIRECT {d['direct_io']}")  # fmt: skip
    else:
        console.print(f"disk tier {cfg.disk.path}: none yet")


def register(app: typer.Typer) -> None:
    app.command("status")(status)
