"""KV events for kvprefetch's tiers, so that KV-aware routers see what a node holds below its engine.

vLLM publishes `BlockStored` / `BlockRemoved` for the engine's own blocks (medium GPU) on its KV-events publisher
(``--kv-events-config``); a connector adds its own through ``take_events``, in the same step's batch. We
announce each chunk per tier in the **engine's own block-hash space**: the hashes vLLM gave the chunk's blocks
(``Request.block_hashes``, converted as vLLM converts its own), so an index built from vLLM's events needs
nothing more to see ours. A tier in vLLM's vocabulary (`TIER_EVENTS`): the node's DRAM pool is medium ``CPU``,
the disk tier ``STORAGE``, both ``LOCAL``; the shared pool ``STORAGE``, ``REMOTE``; ``ownership`` names the tier.

How the announcements stay true: nothing is inferred from this process's own actions. The scheduler notes every
chunk it keys, with its blocks (`TierEvents.note`); a thread (``kvprefetch-events``) asks the tiers, every
``period_s``, which noted chunks each one holds (`SchedulerStore.residency`: the pool's node-wide index, the
disk files, the remote), and queues the difference from what it announced; `take` hands the queue to vLLM in
the engine step. Invariant, after each pass: for every tier, the chunks announced there are exactly the noted
chunks that tier holds, whoever put them there or took them away (this engine, another engine on the node, LRU
eviction, ``kvprefetch status --gc``, a damaged file dropped, expiry). A chunk is in a tier when every
tensor-parallel rank's part is.

Every engine on a node announces what the node's tiers hold that it can serve, not only what it computed: the
chunks each engine announces are appended to the node's catalog (`NodeCatalog`, a JSON-lines file beside the disk
tier's chunks: keys, hashes, parent, tokens), which every engine reads on each pass. So a chunk another engine
saved is announced by all of them, and an engine that restarts announces what the disk tier already holds
(a router that starts later is resynced). Without a disk tier there is no catalog: each engine announces what
it keyed itself.

Chunks of requests whose blocks' hashes carry more than their tokens (a LoRA adapter, a cache salt, multimodal
inputs, prompt embeddings) are announced like any other, with the fields vLLM fills for its own blocks
(``lora_name``, ``extra_keys``): their chunk keys carry the same identity (`kvprefetch.vllm.identity`), so one
chunk stands for one identity's blocks. Requests served without the tiers (`identity.Untiered`) are never keyed,
so never noted.
"""

from __future__ import annotations

import json
import logging
import os
import threading
import time
from array import array
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kvprefetch.vllm.identity import event_extra_keys
from kvprefetch.vllm.store_api import SchedulerStore

log = logging.getLogger("kvprefetch.vllm")

PERIOD_S = 0.5  # how often the tiers are asked what they hold: how late a router learns of a change, at most
FORGET_S = 60.0  # a noted chunk no tier has held for this long is no longer asked about
MAX_SHARE = 0.1  # of a core the passes may take (each stats every noted chunk's file): longer waits past that


@dataclass(frozen=True)
class Where:
    """A tier as vLLM's events name where blocks are."""

    medium: str
    locality: str
    ownership: str


# The store's tiers (`Tier` values) in vLLM's vocabulary (`vllm.distributed.kv_events`: MEDIUM_CPU, MEDIUM_STORAGE).
TIER_EVENTS: dict[str, Where] = {
    "dram": Where("CPU", "LOCAL", "kvprefetch-dram"),
    "disk": Where("STORAGE", "LOCAL", "kvprefetch-disk"),
    "remote": Where("STORAGE", "REMOTE", "kvprefetch-pool"),
}


@dataclass(frozen=True)
class ChunkBlocks:
    """A chunk as vLLM's events name blocks: its blocks' hashes, the hash of the block before it, its tokens, and
    what else vLLM hashed into them (the adapter's name; per block, the extra keys as vLLM's events publish them)."""

    hashes: tuple[int | bytes, ...]
    parent: int | bytes | None
    token_ids: array  # (4 bytes a token: a chunk's tokens are most of what is kept of it)
    lora_name: str | None = None
    extra_keys: tuple[Any, ...] | None = None  # one entry per block (None, or a tuple), or None for none at all


@dataclass
class _Noted:
    blocks: ChunkBlocks
    seen: float  # (clock) when it was noted or last held by a tier
    announced: frozenset[str] = frozenset()  # the tiers it was announced in
    cataloged: bool = False  # in the node's catalog (written by this engine, or read from it)


def _hash_json(h: int | bytes | None) -> int | str | None:
    return h.hex() if isinstance(h, bytes) else h  # (bytes: with VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=0)


def _hash_of(v: int | str | None) -> int | bytes | None:
    return bytes.fromhex(v) if isinstance(v, str) else v


class NodeCatalog:
    """The chunks the node's engines announced, in their hash space: one JSON line per chunk (every rank's key,
    its blocks' hashes, the hash before it, its tokens), appended by the engine that keyed it and read by all
    (from where each last stopped; at start, from the beginning). One file per hash space (the engine's hash
    function, block size and seed), so engines that hash differently never read each other's hashes. A line
    cut short (a writer killed mid-write) is skipped; the file only grows (each chunk once per engine start)."""

    def __init__(self, path: Path):
        self.path = path
        self._offset = 0
        path.parent.mkdir(parents=True, exist_ok=True)

    def append(self, entries: list[tuple[tuple[bytes, ...], ChunkBlocks]]) -> None:
        if not entries:
            return
        lines = "".join(json.dumps(_catalog_line(ck, b), separators=(",", ":")) + "\n" for ck, b in entries)
        fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        try:
            os.write(fd, lines.encode())  # one append: lines of concurrent writers do not interleave
        finally:
            os.close(fd)

    def read_new(self) -> list[tuple[tuple[bytes, ...], ChunkBlocks]]:
        """The whole lines appended since the last call."""
        try:
            with open(self.path, "rb") as f:
                f.seek(self._offset)
                data = f.read()
        except FileNotFoundError:
            return []
        end = data.rfind(b"\n") + 1  # a line still being written waits for the next call
        self._offset += end
        out = []
        for line in data[:end].splitlines():
            try:
                d = json.loads(line)
                blocks = ChunkBlocks(tuple(_hash_of(h) for h in d["h"]), _hash_of(d["p"]), array("i", d["t"]),
                                     d.get("l"), _untagged(d["x"]) if d.get("x") is not None else None)  # fmt: skip
                out.append((tuple(bytes.fromhex(k) for k in d["k"]), blocks))
            except (ValueError, KeyError, TypeError):
                continue  # cut short or damaged: that chunk is announced by the engine that keyed it only
        return out


def _catalog_line(ck: tuple[bytes, ...], b: ChunkBlocks) -> dict[str, Any]:
    line: dict[str, Any] = {"k": [k.hex() for k in ck], "h": [_hash_json(h) for h in b.hashes],
                            "p": _hash_json(b.parent), "t": list(b.token_ids)}  # fmt: skip
    if b.lora_name is not None:
        line["l"] = b.lora_name
    if b.extra_keys is not None:
        line["x"] = _tagged(b.extra_keys)
    return line


def _tagged(v: Any) -> Any:
    """Extra keys as JSON: tuples as lists, bytes (prompt-embedding digests) as {"b": hex}."""
    if isinstance(v, bytes):
        return {"b": v.hex()}
    if isinstance(v, tuple | list):
        return [_tagged(x) for x in v]
    return v


def _untagged(v: Any) -> Any:
    if isinstance(v, dict):
        return bytes.fromhex(v["b"])
    if isinstance(v, list):
        return tuple(_untagged(x) for x in v)
    return v


def catalog_path(directory: Path, hash_algo: str, block_size: int) -> Path | None:
    """The catalog of this engine's hash space under `directory` (None before vLLM set its hash seed)."""
    from blake3 import blake3
    from vllm.v1.core import kv_cache_utils

    seed = getattr(kv_cache_utils, "NONE_HASH", None)  # (set by vLLM's engine core, after the connector)
    if seed is None:
        return None
    space = blake3(repr((hash_algo, block_size, seed)).encode()).hexdigest()[:16]
    return directory / f"{space}.jsonl"


def carries_more_than_tokens(request: Any) -> bool:
    """Whether vLLM's hashes of the request's blocks carry more than their tokens (its adapter, cache salt,
    multimodal items or prompt embeddings)."""
    extra = ("lora_request", "cache_salt", "mm_features")
    return any(getattr(request, a, None) for a in extra) or getattr(request, "prompt_embeds", None) is not None


def chunk_blocks(request: Any, i: int, block_size: int, blocks_per_chunk: int, convert: Callable) -> ChunkBlocks:
    """Chunk i of the request in the engine's hash space (its blocks must be hashed: a whole chunk's are), with
    the extra keys vLLM hashed into each block, as its own events publish them. A chunk is counted in the
    engine's blocks (the spec's geometry): no chunk size is derived here."""
    hashes, first = request.block_hashes, i * blocks_per_chunk
    end = first + blocks_per_chunk
    lora, extra = None, None
    if carries_more_than_tokens(request):
        lora = request.lora_request.lora_name if request.lora_request else None
        keys = event_extra_keys(request, first, end, block_size)
        extra = tuple(keys) if keys is not None else None
    return ChunkBlocks(
        tuple(convert(h) for h in hashes[first:end]),
        convert(hashes[first - 1]) if first else None,
        array("i", request.all_token_ids[first * block_size : end * block_size]),
        lora,
        extra,
    )


@dataclass
class TierEvents:
    """The chunks noted, what was announced of each, and the events that keep a router's index equal to the
    tiers (see the module's docstring). `note` and `take` are the scheduler's; `reconcile` runs on the thread
    `start` starts (or when a test calls it)."""

    store: SchedulerStore
    block_size: int
    blocks_per_chunk: int
    # (vLLM's index, kind as `KVCacheSpecKind` names it) of every KV cache group: a chunk holds every group's KV,
    # so each of its stores and removals is one event per group, as vLLM's own events are per group
    groups: tuple[tuple[int, str], ...] = ((0, "full_attention"),)
    period_s: float = PERIOD_S
    forget_s: float = FORGET_S
    clock: Callable[[], float] = time.monotonic
    catalog_dir: Path | None = None  # the node's catalog's directory (beside the disk tier's chunks)
    hash_algo: str = "sha256"  # vLLM's prefix_caching_hash_algo (names the catalog's hash space)
    _catalog: NodeCatalog | None = None
    _noted: dict[tuple[bytes, ...], _Noted] = field(default_factory=dict)  # every rank's keys of a chunk -> it
    _queue: list[Any] = field(default_factory=list)
    _lock: threading.Lock = field(default_factory=threading.Lock)
    _stop: threading.Event = field(default_factory=threading.Event)
    _thread: threading.Thread | None = None

    def __post_init__(self) -> None:
        from vllm.distributed.kv_events import BlockRemoved, BlockStored
        from vllm.v1.core.kv_cache_utils import maybe_convert_block_hash

        self._stored, self._removed, self._convert = BlockStored, BlockRemoved, maybe_convert_block_hash

    # ---- the scheduler's -------------------------------------------------------------------------------------
    def note(self, request: Any, keys: Sequence[Sequence[bytes]], n: int) -> None:
        """Chunks [0, n) of the request, keyed (``keys[rank][i]``, under its identity): asked about from now on."""
        n = min(n, len(request.block_hashes) // self.blocks_per_chunk)
        now = self.clock()
        with self._lock:
            for i in range(n):
                ck = tuple(rank[i] for rank in keys)
                if ck not in self._noted:
                    blocks = chunk_blocks(request, i, self.block_size, self.blocks_per_chunk, self._convert)
                    self._noted[ck] = _Noted(blocks, now)

    def take(self) -> list[Any]:
        """The events queued since the last call (vLLM's ``take_events``, once per engine step)."""
        with self._lock:
            out, self._queue = self._queue, []
        return out

    # ---- the thread's -----------------------------------------------------------------------------------------
    def reconcile(self) -> int:
        """Ask the tiers what they hold of the noted chunks (the node's catalog's included), queue what changed
        since the last pass (stores first, then removals, grouped per tier), catalog the chunks this engine
        announced first (again when it comes back after leaving every tier: another engine may have forgotten
        it meanwhile), forget chunks no tier has held for `forget_s`; the number of events queued. What is kept is
        what the tiers hold and what left them lately, whatever the catalog's length."""
        self._read_catalog()
        with self._lock:
            noted = list(self._noted.items())
        held = self._held([ck for ck, _ in noted])
        stored: list[Any] = []
        removed: dict[str, list[int | bytes]] = {}
        now = self.clock()
        for (_, c), tiers in zip(noted, held, strict=True):
            for tier in sorted(tiers - c.announced):
                stored += self._stored_events(c.blocks, TIER_EVENTS[tier])
            for tier in sorted(c.announced - tiers):
                removed.setdefault(tier, []).extend(c.blocks.hashes)
            if c.announced and not tiers:
                c.cataloged = False
            c.announced = tiers
            if tiers:
                c.seen = now
        events = stored + [e for t, hashes in removed.items() for e in self._removed_events(hashes, TIER_EVENTS[t])]
        self._write_catalog([(ck, c) for ck, c in noted if c.announced and not c.cataloged])
        with self._lock:
            for ck, c in noted:
                if not c.announced and now - c.seen > self.forget_s:
                    self._noted.pop(ck, None)
            self._queue.extend(events)
        return len(events)

    def _open_catalog(self) -> NodeCatalog | None:
        if self._catalog is None and self.catalog_dir is not None:
            path = catalog_path(self.catalog_dir, self.hash_algo, self.block_size)
            if path is not None:
                self._catalog = NodeCatalog(path)
        return self._catalog

    def _read_catalog(self) -> None:
        """Note the chunks other engines (or this node's earlier engines) announced."""
        catalog = self._open_catalog()
        if catalog is None:
            return
        now = self.clock()
        try:
            entries = catalog.read_new()
        except OSError as err:
            log.warning("kvprefetch: KV events: the node's catalog %s is unreadable (%s)", catalog.path, err)
            return
        with self._lock:
            for ck, blocks in entries:
                if ck not in self._noted:
                    self._noted[ck] = _Noted(blocks, now, cataloged=True)
                else:
                    self._noted[ck].cataloged = True

    def _write_catalog(self, new: list[tuple[tuple[bytes, ...], _Noted]]) -> None:
        catalog = self._open_catalog()
        if catalog is None or not new:
            return
        try:
            catalog.append([(ck, c.blocks) for ck, c in new])
        except OSError as err:
            log.warning("kvprefetch: KV events: cannot append to the node's catalog %s (%s)", catalog.path, err)
            return
        for _, c in new:
            c.cataloged = True

    def _held(self, chunks: list[tuple[bytes, ...]]) -> list[frozenset[str]]:
        """Per chunk, the tiers holding every rank's part (one residency query for every key)."""
        flat = [k for ck in chunks for k in ck]
        try:
            per_key = [frozenset(map(str, ts)) for ts in self.store.residency(flat)]  # (`Tier` is a StrEnum)
        except Exception as err:  # a tier that fails to answer: nothing changes this pass
            log.warning("kvprefetch: KV events: the tiers did not answer (%s); retried in %.1f s", err, self.period_s)
            with self._lock:
                return [self._noted[ck].announced if ck in self._noted else frozenset() for ck in chunks]
        out, at = [], 0
        for ck in chunks:
            parts = per_key[at : at + len(ck)]
            at += len(ck)
            out.append(frozenset.intersection(*parts) if parts else frozenset())
        return out

    def _stored_events(self, blocks: ChunkBlocks, where: Where) -> list[Any]:
        return [self._stored(
            block_hashes=list(blocks.hashes), parent_block_hash=blocks.parent, token_ids=list(blocks.token_ids),
            block_size=self.block_size, lora_id=None, medium=where.medium, lora_name=blocks.lora_name,
            extra_keys=list(blocks.extra_keys) if blocks.extra_keys is not None else None, group_idx=group_idx,
            kv_cache_spec_kind=kind, locality=where.locality, ownership=where.ownership,
        ) for group_idx, kind in self.groups]  # fmt: skip

    def _removed_events(self, hashes: list[int | bytes], where: Where) -> list[Any]:
        return [self._removed(block_hashes=hashes, medium=where.medium, group_idx=group_idx, locality=where.locality,
                              ownership=where.ownership) for group_idx, _ in self.groups]  # fmt: skip

    def start(self) -> TierEvents:
        self._thread = threading.Thread(target=self._run, name="kvprefetch-events", daemon=True)
        self._thread.start()
        return self

    def _run(self) -> None:
        """A pass every `period_s`, or longer where passes are long (many chunks): at most `MAX_SHARE` of a core."""
        wait = self.period_s
        while not self._stop.wait(wait):
            t0 = time.perf_counter()
            try:
                self.reconcile()
            except Exception:  # never let the thread die: the next pass tries again
                log.exception("kvprefetch: KV events: a pass failed")
            wait = max(self.period_s, (time.perf_counter() - t0) / MAX_SHARE)

    def close(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
