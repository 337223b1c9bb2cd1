"""Checkpoint blocks in the kvprefetch tiers (local disk, optionally the node's DRAM pool).

A checkpoint read from slow storage is put into a TieredStore block by block, so the next engine on the node,
or a restart, reads it at local speed. Blocks are keyed by the shard's content identity, never by its path
alone: (file name, size, mtime, blake3 of the safetensors header) by default, and with `identity: full` also a
blake3 of the whole file. A checkpoint rewritten in place gets a new mtime (and usually a new header), so its
blocks get new keys and the old ones are never read for it: a changed checkpoint never loads stale bytes.
Every cached block carries its own checksum (the chunk format), so a damaged cache file reads as a miss and
that block comes from the source again.

A block in the node's DRAM pool is not copied into the shard buffer: the pool's pages are mapped there
(`WeightCache.map_block`, copy-on-write), pinned until the reader says the buffer's bytes are no longer needed
from the pool (`release`): so a warm load from DRAM costs vLLM's own copy into the parameters and nothing else.
"""

from __future__ import annotations

import contextlib
import logging
import mmap
import os
import threading
from concurrent.futures import Future
from enum import StrEnum

import blake3

from kvprefetch.config import StoreConfig
from kvprefetch.loader.settings import LoaderSettings
from kvprefetch.loader.shards import Shard
from kvprefetch.store import DramExtent, Tier, TieredStore
from kvprefetch.tiers.chunk_format import HEADER_BYTES, CorruptChunk, image_bytes, payload_checksum, read_header
from kvprefetch.tiers.memory import MapError, address_of, map_file_over

log = logging.getLogger(__name__)

_DOMAIN = b"kvprefetch-weights-v1"


class CheckpointMemoryError(MemoryError):
    """A shard buffer's range could be neither mapped from the pool nor given its memory back: the load stops."""


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


class Source(StrEnum):
    """Where a block's bytes came from (the load's timeline and counters)."""

    SOURCE = "source"  # the checkpoint file
    DISK = "cache-disk"  # the cache's file on the local disk, read straight into the buffer
    DRAM_COPY = "cache-dram-copy"  # the DRAM pool, copied (a pool that cannot be mapped: hugetlbfs, unaligned)
    DRAM_MAP = "cache-dram-map"  # the DRAM pool's pages mapped into the buffer


class WeightCache:
    """A TieredStore whose chunks are checkpoint blocks; failures degrade to reading the source."""

    def __init__(self, config: StoreConfig, block_bytes: int, identity: str = "header"):
        self.block_bytes = block_bytes
        self.identity = identity
        self.store = TieredStore(config, chunk_bytes=block_bytes)
        self._local = threading.local()
        self._warned: set[type] = set()
        self._closed = False

    def block_keys(self, shard: Shard, nblocks: int) -> list[bytes]:
        ident = full_identity(shard) if self.identity == "full" else header_identity(shard)
        return [blake3.blake3(ident + self.block_bytes.to_bytes(8, "little") + i.to_bytes(8, "little")).digest()
                for i in range(nblocks)]  # fmt: skip

    def all_in_dram(self, keys: list[bytes]) -> bool:
        """Whether the node's DRAM pool holds every one of these blocks now (False on any failure)."""
        try:
            return all(self.store.in_dram(keys))
        except Exception:  # the cache is an accelerator: a failing pool is simply not there
            return False

    def get_into(self, keys: list[bytes], views: list[memoryview]) -> int:
        """Copy the leading cached blocks into views; return how many (0 on any cache failure)."""
        try:
            return self.store.get_into(keys, views)
        except Exception as err:  # the cache is an accelerator: any failure reads the source instead
            log.warning("kvprefetch loader: weight cache read failed (%s); reading the source", err)
            return 0

    def read_block(self, key: bytes, dst: memoryview) -> tuple[Source, DramExtent | None] | None:
        """One cached block into dst (a whole, page-aligned block): where it came from, and the pin to give back
        (`release`) once dst's bytes are no longer read from the pool; None on a miss or any failure (read the
        source).

        From the DRAM pool when it holds the block: its pages mapped over dst (`map_block`), or copied where the
        pool cannot be mapped. Else straight from the block's file in the disk cache: one O_DIRECT read whose
        first page (the chunk header) goes to a scratch page and whose payload lands in dst, then the header and
        the payload's checksum are verified in place. Going through the store instead (disk -> DRAM slot -> dst)
        cost two extra passes over every byte, which made a warm load no faster than a cold one on our 2-core VM.
        """
        tiers = self.store.lookup([key]).tiers
        if not tiers:
            return None
        if tiers[0] is Tier.DRAM:
            mapped = self.map_block(key, dst)
            if mapped is not None:
                return Source.DRAM_MAP, mapped
        if tiers[0] is Tier.DRAM or self.store.disk is None:
            return (Source.DRAM_COPY, None) if self.get_into([key], [dst]) == 1 else None
        try:
            return (Source.DISK, None) if self._read_disk(key, dst) else None
        except (OSError, CorruptChunk) as err:
            if isinstance(err, CorruptChunk):
                self.store.disk.delete(key)  # the next load re-caches it from the source
            self._warn(err, "cached block unreadable")
            return None

    def map_block(self, key: bytes, dst: memoryview) -> DramExtent | None:
        """Map key's payload in the DRAM pool over dst (no copy); the pin that keeps the slot's bytes is returned,
        to `release` once dst is no longer read (or made private: `tiers.memory.privatize`). None where the block
        left DRAM, the pool cannot be mapped over dst (another page size, another length), or the kernel refuses:
        dst is then as it was (zeroed memory), for a copy or a read instead."""
        try:
            extent = self.store.acquire_extent(key)
        except Exception as err:  # the cache is an accelerator: any failure reads elsewhere
            self._warn(err, "weight cache pool unreadable")
            return None
        if extent is None:
            return None
        try:
            if extent.mappable(len(dst)) and map_file_over(address_of(dst), len(dst), extent.fd, extent.offset):
                return extent
        except MapError as err:
            self.release([extent])
            raise CheckpointMemoryError(str(err)) from err
        self.release([extent])
        return None

    def release(self, extents: list[DramExtent]) -> None:
        """Give back the pins of mapped blocks (safe after `close`, which dropped every pin already)."""
        if self._closed:
            return
        for extent in extents:
            with contextlib.suppress(Exception):  # a pool gone bad: its pins go with this process
                self.store.release_extent(extent)

    def _warn(self, err: Exception, what: str) -> None:
        if type(err) not in self._warned:
            self._warned.add(type(err))
            log.warning("kvprefetch loader: %s (%s: %s); reading the source", what, type(err).__name__, err)

    def _read_disk(self, key: bytes, dst: memoryview) -> bool:
        disk = self.store.disk
        assert disk is not None
        flags = os.O_RDONLY | os.O_NOFOLLOW | (os.O_DIRECT if disk.direct_io else 0)
        fd = os.open(disk.path_of(key), flags)
        try:
            st = os.fstat(fd)
            if disk.access.distrust(st) is not None:  # not the cache's own file: a miss, left for the store to judge
                return False
            if st.st_size != image_bytes(len(dst)):
                raise CorruptChunk(f"{st.st_size} B file for a {len(dst)} B block")
            head = self._header_page()
            got = _preadv_full(fd, [head, dst])
            if got != st.st_size:
                raise CorruptChunk(f"short read: {got} of {st.st_size} bytes")
        finally:
            os.close(fd)
        header = read_header(head)
        if header.key != key or header.payload_nbytes != len(dst):
            raise CorruptChunk("the file holds another block")
        if payload_checksum(dst) != header.checksum:
            raise CorruptChunk("payload checksum mismatch")
        return True

    def _header_page(self) -> memoryview:
        """This thread's page-aligned scratch page for chunk headers (O_DIRECT needs aligned memory)."""
        page = getattr(self._local, "page", None)
        if page is None:
            page = self._local.page = memoryview(mmap.mmap(-1, HEADER_BYTES))
        return page

    def put(self, key: bytes, view: memoryview) -> Future:
        try:
            return self.store.put([key], [view])
        except Exception as err:
            failed: Future = Future()
            failed.set_exception(err)
            return failed

    def close(self) -> None:
        """Close the store: every pin this process holds in the pool is dropped with it."""
        self._closed = True
        self.store.close()


def _preadv_full(fd: int, views: list[memoryview]) -> int:
    """Read into views, in order, from offset 0 until they are full or the file ends; return the bytes read."""
    done, total = 0, sum(len(v) for v in views)
    while done < total:
        rest, skip = [], done
        for v in views:
            if skip >= len(v):
                skip -= len(v)
                continue
            rest.append(v[skip:])
            skip = 0
        n = os.preadv(fd, rest, done)
        if n == 0:
            break
        done += n
    return done


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
