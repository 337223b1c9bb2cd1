"""Checkpoint blocks in the kvprefetch tiers (local disk, optionally the node's DRAM pool).

A checkpoint read from slow storage is put into a TieredStore block by block, so the next engine on the node,
or a restart, reads it at local speed. Blocks are keyed by the shard's content identity, never by its path
alone: (file name, size, mtime, blake3 of the safetensors header) by default, and with `identity: full` also a
blake3 of the whole file. A checkpoint rewritten in place gets a new mtime (and usually a new header), so its
blocks get new keys and the old ones are never read for it: a changed checkpoint never loads stale bytes.
Every cached block carries its own checksum (the chunk format), so a damaged cache file reads as a miss and
that block comes from the source again.
"""

from __future__ import annotations

import logging
from concurrent.futures import Future

import blake3

from kvprefetch.config import StoreConfig
from kvprefetch.loader.settings import LoaderSettings
from kvprefetch.loader.shards import Shard
from kvprefetch.store import TieredStore

log = logging.getLogger(__name__)

_DOMAIN = b"kvprefetch-weights-v1"


def header_identity(shard: Shard) -> bytes:
    """blake3 over (name, size, mtime_ns, header bytes): cheap, from what the verification already read."""
    h = blake3.blake3(_DOMAIN)
    h.update(f"{shard.path.name}\0{shard.size}\0{shard.mtime_ns}\0".encode())
    h.update(shard.header)
    return h.digest()


def full_identity(shard: Shard, chunk: int = 64 << 20) -> bytes:
    """header_identity plus a blake3 of the whole file (one full read of the source, hashed on all cores)."""
    h = blake3.blake3(header_identity(shard), max_threads=blake3.blake3.AUTO)
    with open(shard.path, "rb", buffering=0) as f:
        buf = bytearray(chunk)
        view = memoryview(buf)
        while n := f.readinto(buf):
            h.update(view[:n])
    return h.digest()


class WeightCache:
    """A TieredStore whose chunks are checkpoint blocks; failures degrade to reading the source."""

    def __init__(self, config: StoreConfig, block_bytes: int, identity: str = "header"):
        self.block_bytes = block_bytes
        self.identity = identity
        self.store = TieredStore(config, chunk_bytes=block_bytes)

    def block_keys(self, shard: Shard, nblocks: int) -> list[bytes]:
        ident = full_identity(shard) if self.identity == "full" else header_identity(shard)
        return [blake3.blake3(ident + self.block_bytes.to_bytes(8, "little") + i.to_bytes(8, "little")).digest()
                for i in range(nblocks)]  # fmt: skip

    def get_into(self, keys: list[bytes], views: list[memoryview]) -> int:
        """Copy the leading cached blocks into views; return how many (0 on any cache failure)."""
        try:
            return self.store.get_into(keys, views)
        except Exception as err:  # the cache is an accelerator: any failure reads the source instead
            log.warning("kvprefetch loader: weight cache read failed (%s); reading the source", err)
            return 0

    def put(self, key: bytes, view: memoryview) -> Future:
        try:
            return self.store.put([key], [view])
        except Exception as err:
            failed: Future = Future()
            failed.set_exception(err)
            return failed

    def close(self) -> None:
        self.store.close()


def open_cache(settings: LoaderSettings) -> WeightCache | None:
    """The weight cache, or None: none configured, or it cannot be opened now (logged; the load goes on).

    A bad cache configuration is refused when the loader is configured (LoaderSettings.from_extra_config);
    here, at load time, a cache that has become unusable (its directory gone or replaced, no memory for the
    pool) only costs speed.
    """
    if settings.cache is None:
        return None
    try:
        return WeightCache(settings.store_config(), int(settings.block_bytes), settings.identity)
    except (OSError, ValueError) as err:  # ConfigError is a ValueError
        where = settings.cache.get("disk", {}).get("path", "the default cache directory")
        log.warning("kvprefetch loader: weight cache at %s unavailable (%s); loading from the source only", where, err)
        return None
