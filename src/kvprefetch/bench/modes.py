"""The benchmark's modes: one vLLM engine each, same model and engine settings, different KV paths."""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kvprefetch.modes import MODE
from kvprefetch.vllm.settings import transfer_config

MODES: dict[str, str] = {name: m.description for name, m in MODE.items()}
"""Every mode the bench knows, by name (`kvprefetch.modes` defines them)."""

KNOWN_PEER_FAILURES: dict[str, tuple[str, str]] = {
    "vllm-example": (
        "shape mismatch",
        "vLLM's ExampleConnector (a debug connector) stores a prompt only in the step that first schedules it, "
        "with the blocks allocated by then: a prompt whose prefill is chunked over several steps is saved short "
        "under its whole length's name, and the next request with that prompt fails to load it",
    ),
}
"""Failures of a peer's own connector that we have traced: (text in the error, why), so a report can say so."""


def known_failure(mode: str, reason: str | None) -> str | None:
    """Why a peer's cell failed, where the error is one we have traced to the peer itself."""
    known = KNOWN_PEER_FAILURES.get(mode)
    return known[1] if known and reason and known[0] in reason else None


TWO_INSTANCE_MODES = tuple(n for n, m in MODE.items() if m.two_instance)
PEER_MODES = tuple(n for n, m in MODE.items() if m.peer)  # other projects' connectors, each with a store of its own
REMOTE_MODES = tuple(n for n, m in MODE.items() if m.remote)
NODE_MODES = tuple(n for n, m in MODE.items() if m.nodes)  # the two-node scenario's own (recompute runs there too)
TWO_NODE_MODES = ("recompute", *NODE_MODES)  # the two-node scenario's modes, in its order
CLUSTER_MODES = ("recompute", *(n for n, m in MODE.items() if m.cluster))  # the cluster-serve scenario's, in order

CONNECTOR_MODES = tuple(n for n, m in MODE.items()
                        if m.connector and not (m.two_instance or m.remote or m.nodes or m.cluster))
SYNC_MODES = tuple(n for n, m in MODE.items() if m.load_mode == "sync")  # loads inside the engine step
SERIAL_READS = tuple(n for n, m in MODE.items() if m.serial)  # one read in flight: io.threads = 1


def connector_has_setting(name: str) -> bool:
    try:
        from kvprefetch.vllm.settings import _CONNECTOR_KEYS
    except Exception:
        return False
    return name in _CONNECTOR_KEYS


def router_available() -> bool:
    from kvprefetch.testbed.router import router_executable

    try:
        router_executable()
    except RuntimeError:
        return False
    return True


def remote_available(backend: str) -> bool:
    import shutil
    import sys

    if backend == "redis":
        return shutil.which("redis-server") is not None and importlib.util.find_spec("redis") is not None
    return Path(sys.executable).with_name("mooncake_master").exists()


def route_turn(turn: int, engines: int = 2) -> int:
    """Which engine serves a session's turn in the two-instance scenario: they alternate, turn k on k % n."""
    return turn % engines


def route(mode: str, session: int, turn: int, engines: int = 2) -> int:
    """Which node serves turn `turn` of session `session` in the two-node scenario: a pinned mode's sessions stay
    on one node each (session i on i mod n, as a cache-aware router keeps them); every other mode's turns
    alternate, session i's turn k on (i + k) mod n, so each turn lands on another node than the one before it
    and the nodes share every turn's load. Turn -1 is the prelude's (the conversation so far)."""
    return session % engines if MODE[mode].pinned else (session + turn) % engines


def two_instance_caches(mode: str, work: Path, pool_prefix: str, engines: int = 2) -> list[tuple[Path, str]]:
    """(disk directory, DRAM pool name) per engine: one of each for all (shared-2x), or one each (private-2x)."""
    if mode == "shared-2x":
        return [(work / "disk-shared-2x", f"{pool_prefix}-shared-2x")] * engines
    if mode == "private-2x":
        return [(work / f"disk-private-2x-{e}", f"{pool_prefix}-private-2x-{e}") for e in range(engines)]
    raise ValueError(mode)


def remote_section(backend: str, server: Any, segment_bytes: int | None = None) -> dict:
    """The store's `remote` section for a server from `kvprefetch.testbed.local_servers`."""
    if backend == "redis":
        return {"backend": "redis", "redis": {"url": server.url}}
    mc = {"master": server.master, "metadata_server": server.metadata_server}
    mc |= _set(segment_bytes=int(segment_bytes or 0))
    return {"backend": "mooncake", "mooncake": mc}


def availability(mode: str, cuda: bool, remote_backend: str = "redis") -> tuple[bool, str]:
    if mode not in MODES:
        return False, f"unknown mode {mode!r}"
    if mode in SYNC_MODES and not connector_has_setting("load_mode"):
        return False, "the connector has no load_mode setting yet (synchronous loads)"
    if (mode in REMOTE_MODES or MODE[mode].pool) and not remote_available(remote_backend):
        return False, f"the {remote_backend} server is not installed"
    if MODE[mode].nodes or MODE[mode].cluster:
        from kvprefetch.testbed.netns import available

        if (why := available()) is not None:
            return False, why
    if MODE[mode].cluster and not router_available():
        return False, "vllm-router is not installed (make setup installs the router extra)"
    if MODE[mode].cluster and not remote_available("redis"):
        return False, "the cluster's pool runs redis-server, which is not installed"
    if mode == "lmcache":
        if not cuda:
            return False, "LMCache's connector needs CUDA"
        if importlib.util.find_spec("lmcache") is None:
            return False, "lmcache is not installed"
    return True, ""


@dataclass
class StoreSizing:
    chunk_tokens: int
    dram_bytes: int
    disk_bytes: int
    io_threads: int = 4
    io_cpus: list[int] | None = None  # the connector's threads' cores (kvprefetch.testbed.topology)
    read_rate_limit_bps: int | None = None  # the fallback throttle (no kernel throttle available)
    read_stream_bps: int | None = None  # one read stream's cap (the emulated array: `regime.stream_bps`)
    prefill_tps_prior: float | None = None
    disk_bps_prior: float | None = None
    extra: dict[str, Any] = field(default_factory=dict)


def kvprefetch_extra(sizing: StoreSizing, disk_dir: Path, pool: str, *, prefetch: bool, sync: bool = False,
                     serial: bool = False) -> dict:  # fmt: skip
    """The connector's settings for a mode: ``sync`` loads inside the step, ``serial`` keeps one read in flight;
    a setting the sizing leaves unset is left out (the connector's default)."""
    s = sizing
    io = {"threads": 1 if serial else s.io_threads} | _set(
        cpus=list(s.io_cpus or []), read_rate_limit_bps=int(s.read_rate_limit_bps or 0),
        read_stream_bps=int(s.read_stream_bps or 0))  # fmt: skip
    # what the product recommends with prefetch: finish a late prefetch in the step when cheaper
    load_mode = "sync" if sync else "auto" if prefetch else None
    return {
        "chunk_tokens": s.chunk_tokens,
        "prefetch": prefetch,
        "dram": {"capacity_bytes": int(s.dram_bytes), "pool_name": pool},
        "disk": {"path": str(disk_dir), "capacity_bytes": int(s.disk_bytes)},
        "io": io,
        "log_interval_s": 0,
    } | _set(prefill_tps_prior=float(s.prefill_tps_prior or 0), disk_bps_prior=float(s.disk_bps_prior or 0),
             load_mode=load_mode) | s.extra  # fmt: skip


def _set(**settings: Any) -> dict[str, Any]:
    """The settings given a value (not None, 0 or empty)."""
    return {k: v for k, v in settings.items() if v}


def kv_transfer_config(mode: str, sizing: StoreSizing, disk_dir: Path, pool: str,
                       remote: dict | None = None) -> dict | None:  # fmt: skip
    """vLLM's kv_transfer_config for a mode (None: no connector); remote: the store's remote section."""
    if mode == "recompute":
        return None
    if mode in TWO_INSTANCE_MODES or mode in REMOTE_MODES:
        extra = kvprefetch_extra(sizing, disk_dir, pool, prefetch=True)
        if mode in REMOTE_MODES:
            if remote is None:
                raise ValueError(f"{mode} needs a remote section")
            extra |= {"tiers": ["dram", "disk", "remote"], "remote": remote}
        return transfer_config(extra)
    if mode in CONNECTOR_MODES:
        m = MODE[mode]
        extra = kvprefetch_extra(sizing, disk_dir, pool, prefetch=m.prefetch, sync=m.load_mode == "sync",
                                 serial=m.serial)  # fmt: skip
        return transfer_config(extra | _set(keep_warm_s=m.keep_warm_s))
    if mode == "vllm-example":
        return {
            "kv_connector": "ExampleConnector",
            "kv_role": "kv_both",
            "kv_connector_extra_config": {"shared_storage_path": str(disk_dir)},
        }
    if mode == "lmcache":
        return {"kv_connector": "LMCacheConnectorV1", "kv_role": "kv_both"}
    raise ValueError(mode)


def node_transfer_config(mode: str, sizing: StoreSizing, pool: str, *, remote: dict | None,
                         disk_dir: Path | None = None) -> dict | None:  # fmt: skip
    """vLLM's kv_transfer_config for one node of a two-node mode: its own DRAM tier (pool name `pool`), a local
    disk tier only with `disk_dir` (the whitepaper's GPU servers are diskless), and the shared pool below for the
    pool modes (`remote`: the store's remote section, reached over the node's link)."""
    if mode == "recompute":
        return None
    m = MODE[mode]
    if not m.nodes:
        raise ValueError(f"{mode} is not a two-node mode")
    if m.pool and remote is None:
        raise ValueError(f"{mode} needs the pool's remote section")
    extra = kvprefetch_extra(sizing, disk_dir or Path("/nonexistent"), pool, prefetch=m.prefetch,
                             sync=m.load_mode == "sync")  # fmt: skip
    tiers = ["dram", *(["disk"] if disk_dir is not None else []), *(["remote"] if m.pool else [])]
    kept = {k: v for k, v in extra.items() if k != "disk" or disk_dir is not None}
    return transfer_config(kept | {"tiers": tiers} | ({"remote": remote} if m.pool else {}))


def lmcache_env(sizing: StoreSizing, disk_dir: Path) -> dict[str, str]:
    """LMCache's config file (CPU staging as large as our DRAM tier, then local disk)."""
    cfg = disk_dir.parent / f"{disk_dir.name}-lmcache.yaml"
    cfg.write_text(
        f"chunk_size: {sizing.chunk_tokens}\n"
        "local_cpu: true\n"
        f"max_local_cpu_size: {max(sizing.dram_bytes / 2**30, 0.1):.3f}\n"
        f'local_disk: "file://{disk_dir}/"\n'
        f"max_local_disk_size: {max(sizing.disk_bytes / 2**30, 1):.1f}\n"
    )
    return {"LMCACHE_CONFIG_FILE": str(cfg), "LMCACHE_USE_EXPERIMENTAL": "True"}
