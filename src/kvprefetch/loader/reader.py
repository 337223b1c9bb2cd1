"""Shards into memory at storage speed, tensors out as soon as their bytes are in.

A shard is read into one page-aligned buffer (on reserved huge pages when the node has them: `shard_buffer`)
in blocks, by the I/O engine's threads, with O_DIRECT (no page cache: the bytes are read once and kept by the
model, so caching them only evicts something else), through the disk tier's read path (bytes on the device
capped as `kvprefetch iobench` tunes `disk.read_inflight_bytes`; optional staging buffers). Tensors are handed
out in file order as soon as the blocks under them have landed, so vLLM copies the first tensors into the
model while later blocks are still being read, and the next shard's reads start before the current shard's
tensors are handed out. With a plan (tensor parallelism, `kvprefetch.loader.tp_ranges`) only the planned
blocks are read up front, and `ensure` reads any other block before an op touches it.

Blocks double as the weight cache's chunks (`kvprefetch.loader.cache`): a block found in the cache is read
from there (straight into the shard buffer from the cache's disk file, or the DRAM pool's pages mapped into the
buffer) instead of from the source; a block read from the source is put into the cache.

Pins of mapped blocks. A block mapped from the DRAM pool is read from the pool's own pages, so its slot stays
pinned while anything can read the buffer: until the shard buffer's mapping is gone (the last tensor over it
collected: a finalizer gives the pins back), or until the load ends, when the blocks under any tensor vLLM still
holds are first made private copies (`_privatize_kept`): a kept tensor never changes when the slot is reused.

The timeline (`LoadCounters`): every block's start, end and source, the loading thread's waits for bytes and
the time vLLM spent on the tensors handed to it (its copies into the parameters), so a load's seconds can be
split into reading, waiting and copying.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import mmap
import os
import threading
import time
import weakref
from collections.abc import Iterator
from concurrent.futures import Future
from dataclasses import dataclass, field

from kvprefetch.io.engine import IOClass, IOEngine, IOTicket
from kvprefetch.loader.cache import Source, WeightCache
from kvprefetch.loader.settings import LoaderSettings
from kvprefetch.loader.shards import Checkpoint, CheckpointError, Shard, TensorEntry
from kvprefetch.store import DramExtent
from kvprefetch.tiers.chunk_format import ALIGN, align_up
from kvprefetch.tiers.inflight import InflightBytes
from kvprefetch.tiers.memory import address_of, privatize
from kvprefetch.tiers.staging import HUGE_PAGE, StagingBuffers, staged_read

log = logging.getLogger(__name__)

SOURCE = "weights"  # the I/O engine's tier name for source reads (its stats and rate limit key)


def _open_source(path, direct: bool) -> tuple[int, bool]:
    if direct and hasattr(os, "O_DIRECT"):
        try:
            return os.open(path, os.O_RDONLY | os.O_DIRECT), True
        except OSError as err:
            if err.errno != errno.EINVAL:
                raise
            log.info("kvprefetch loader: O_DIRECT not supported for %s, using buffered reads", path)
    return os.open(path, os.O_RDONLY), False


def shard_buffer(nbytes: int, huge: bool) -> tuple[mmap.mmap, bool]:
    """A zeroed, page-aligned buffer of at least nbytes for one shard, and whether it is on reserved huge pages.

    Why huge pages: O_DIRECT reads land faster in 2 MiB pages than in 4 KiB ones on a virtualised disk (the
    host maps and copies into guest memory page by page): fio's best read of our 2 GB test checkpoint was
    1.6-1.7 GB/s into huge-page buffers and 1.0 into malloc'd ones, and our reads followed (1.4 vs 0.8).
    Reserved (hugetlb) pages, because transparent huge pages are not always granted: on our test VM
    MADV_HUGEPAGE never got one. Without enough free reserved pages, ordinary memory (asking for THP).
    """
    if huge and hasattr(os, "MFD_HUGETLB"):
        size = align_up(nbytes, HUGE_PAGE)
        try:
            fd = os.memfd_create("kvprefetch-shard", os.MFD_HUGETLB)
            try:
                os.ftruncate(fd, size)
                return mmap.mmap(fd, size), True  # a shared hugetlb mapping reserves its pages now, or fails
            finally:
                os.close(fd)
        except OSError:
            pass
    raw = mmap.mmap(-1, nbytes)
    if hasattr(mmap, "MADV_HUGEPAGE"):
        with contextlib.suppress(OSError):
            raw.madvise(mmap.MADV_HUGEPAGE)
    return raw, False


@dataclass
class LoadCounters:
    """What one load read from where (bytes), for logs, the bench and the tests; updated by the I/O threads."""

    source_bytes: int = 0
    late_bytes: int = 0  # of them, read when vLLM touched them rather than up front (outside a TP plan)
    cache_bytes: int = 0
    cache_map_bytes: int = 0  # of them, the DRAM pool's pages mapped into the shard buffers (no copy)
    privatized_bytes: int = 0  # mapped bytes copied at the end of the load: under tensors vLLM kept
    cache_put_bytes: int = 0
    huge_page_bytes: int = 0  # shard buffer bytes on reserved huge pages (the rest on ordinary pages)
    shards: int = 0
    tensors: int = 0
    wait_s: float = 0.0  # the loading thread waiting for blocks to land
    handout_s: float = 0.0  # vLLM's time with the tensors handed to it (its copies into the parameters)
    blocks: list[tuple[float, float, str]] = field(default_factory=list)  # (start, end, source), s from the start
    waits: list[tuple[float, float]] = field(default_factory=list)  # the loading thread's waits (start, end)
    _t0: float = field(default_factory=time.perf_counter, repr=False)
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def add(self, name: str, n: float) -> None:
        with self._lock:
            setattr(self, name, getattr(self, name) + n)

    def block(self, start: float, source: str) -> None:
        """A block landed (start: its perf_counter when its read began; it ends now)."""
        with self._lock:
            self.blocks.append((start - self._t0, time.perf_counter() - self._t0, source))

    def waited(self, start: float) -> None:
        """The loading thread waited for bytes from `start` (its perf_counter) until now."""
        end = time.perf_counter()
        with self._lock:
            self.wait_s += end - start
            self.waits.append((start - self._t0, end - self._t0))

    def as_dict(self) -> dict:
        with self._lock:
            return {k: v for k, v in self.__dict__.items() if not k.startswith("_")}

    def timeline(self) -> dict:
        """The load's timeline: every block (start, end, source) and the loading thread's waits, in seconds from
        the reader's start."""
        with self._lock:
            return {"blocks": list(self.blocks), "waits": list(self.waits)}

    def summary(self) -> dict:
        """The counters without the timeline, and the timeline's span and blocks per source."""
        counters = self.as_dict()
        out = {k: v for k, v in counters.items() if k not in ("blocks", "waits")}
        blocks = counters["blocks"]
        if blocks:
            out["reads_span_s"] = max(e for _, e, _ in blocks) - min(s for s, _, _ in blocks)
            out["blocks_by_source"] = {src: sum(1 for *_, s in blocks if s == src) for src in {b[2] for b in blocks}}
        return out


class _Done:
    """The ticket of a block read late, in the calling thread: already complete."""

    def result(self) -> None:
        return None

    def cancel(self) -> bool:
        return False


@dataclass
class _PendingShard:
    shard: Shard
    buffer: memoryview | None  # None once the shard's tensors are all handed out (see late)
    fd: int
    late: weakref.ref  # the buffer's mapping, alive while any tensor of it is: for blocks read late
    addr: int  # the buffer's address, to find the shard of a tensor seen by ensure()
    keys: list[bytes] | None = None
    tickets: list[IOTicket | _Done | None] = field(default_factory=list)  # per block, in file order; None: unread
    waited: int = 0  # blocks known complete
    mapped: list[tuple[int, DramExtent]] = field(default_factory=list)  # blocks mapped from the pool, their pins
    handed: list[tuple[weakref.ref, int, int]] = field(default_factory=list)  # tensors handed out: (ref, begin, end)


Plan = dict[str, frozenset[int]]
"""Per shard file name, the blocks to read up front (tensor parallelism: the rank's byte ranges)."""


class ShardReader:
    """Reads a checkpoint's shards block by block, in parallel; one per load."""

    def __init__(self, settings: LoaderSettings, cache: WeightCache | None = None, plan: Plan | None = None):
        self.settings = settings
        self.plan = plan
        self._shards: list[_PendingShard] = []  # every shard started, for ensure()
        self._lock = threading.Lock()
        self.block = int(settings.block_bytes)
        self.io = IOEngine(threads=settings.threads, name="kvprefetch-load")
        self.gate = InflightBytes(int(settings.read_inflight_bytes))
        self.staging = StagingBuffers(self.block, settings.threads) if settings.staging == "auto" else None
        self.cache = cache
        self.counters = LoadCounters()
        self._puts: list[Future] = []

    # ---- reads -------------------------------------------------------------------------------------------
    def _start(self, shard: Shard) -> _PendingShard:
        """Allocate the shard's buffer and queue one read per block, in file order (cache first where it has it).

        One op per block, not per group of blocks: the first tensors wait for their own block only.
        """
        nblocks = -(-shard.size // self.block)
        keys = self.cache.block_keys(shard, nblocks) if self.cache is not None else None
        # a shard the pool holds whole is mapped from it: huge pages under it would be reserved for nothing
        huge = self.settings.huge_pages and not (keys is not None and self.cache.all_in_dram(keys))
        raw, huge = shard_buffer(max(ALIGN, nblocks * self.block), huge)
        self.counters.add("huge_page_bytes", len(raw) if huge else 0)
        fd, _ = _open_source(shard.path, self.settings.direct_io)
        pending = _PendingShard(shard, memoryview(raw), fd, weakref.ref(raw), address_of(raw), keys)
        if self.cache is not None:  # the pins of blocks mapped from the pool go back with the mapping
            weakref.finalize(raw, _release_mapped, self.cache, pending.mapped)
        planned = None if self.plan is None else self.plan.get(shard.path.name)
        for i in range(nblocks):
            if planned is not None and i not in planned:
                pending.tickets.append(None)
                continue
            fn = self._block_fn(pending, i)
            pending.tickets.append(self.io.submit(SOURCE, IOClass.DEMAND, fn, nbytes=0))
        self._shards.append(pending)
        return pending

    def ensure(self, lo: int, hi: int) -> bool:
        """Make sure the bytes at addresses [lo, hi) have landed, if they lie in one of our shard buffers (then
        True): blocks left out by the plan are read now, in the calling thread. Called before vLLM reads them."""
        for p in self._shards:
            raw = p.late()
            if raw is None or not p.addr <= lo < p.addr + len(raw):
                continue
            first, last = (lo - p.addr) // self.block, (min(hi, p.addr + len(raw)) - 1 - p.addr) // self.block
            for i in range(first, last + 1):
                if i * self.block >= p.shard.size:
                    break
                if p.tickets[i] is not None:
                    p.tickets[i].result()
                else:
                    self._read_late(p, raw, i)
            return True
        return False

    def _read_late(self, p: _PendingShard, raw: mmap.mmap, i: int) -> None:
        """Read block i now, in this thread; after the shard's tensors were handed out too (a tensor vLLM kept),
        through the mapping that tensor keeps alive and the file opened again."""
        with self._lock:
            if p.tickets[i] is not None:
                return
            reopened = p.fd < 0
            if reopened:
                p.fd, _ = _open_source(p.shard.path, self.settings.direct_io)
            had, p.buffer = p.buffer, p.buffer if p.buffer is not None else memoryview(raw)
            try:
                self._block_fn(p, i)()
                self.counters.add("late_bytes", min(self.block, p.shard.size - i * self.block))
                p.tickets[i] = _Done()
            finally:
                p.buffer = had  # (a view made here lives as long as its slices: the cache may still be writing one)
                if reopened:
                    os.close(p.fd)
                    p.fd = -1

    def _block_fn(self, p: _PendingShard, i: int):
        key = None if p.keys is None else p.keys[i]

        def run() -> None:
            assert p.buffer is not None
            view = p.buffer[i * self.block : (i + 1) * self.block]
            start = time.perf_counter()
            if key is not None and self.cache is not None:
                with self.gate.admit(self.block):  # the cache is a local disk too: its reads count as in flight
                    hit = self.cache.read_block(key, view)
                if hit is not None:
                    source, extent = hit
                    if extent is not None:
                        p.mapped.append((i, extent))
                        self.counters.add("cache_map_bytes", self.block)
                    self.counters.add("cache_bytes", self.block)
                    self.counters.block(start, source)
                    return
            self._read_block(p, i)
            self.counters.block(start, Source.SOURCE)
            if key is not None and self.cache is not None:
                self._puts.append(self.cache.put(key, view))
                self.counters.add("cache_put_bytes", self.block)

        return run

    def _read_block(self, p: _PendingShard, i: int) -> None:
        offset = i * self.block
        want = min(self.block, p.shard.size - offset)
        dst = p.buffer[offset : offset + align_up(want)]

        def check(_buf: memoryview, got: int) -> None:
            if got < want:
                raise CheckpointError(
                    p.shard.path, f"truncated while loading: {got} of {want} bytes at offset {offset} "
                                  f"(the file had {p.shard.size} bytes when its header was checked)",
                )  # fmt: skip

        staged_read(p.fd, dst, offset, self.gate, self.staging, check)
        self.counters.add("source_bytes", want)

    def _wait_through(self, p: _PendingShard, end: int) -> None:
        """Block until every byte of [0, end) of the shard has landed (raises the first read's error)."""
        need = -(-end // self.block)
        if p.waited >= need:
            return
        t0 = time.perf_counter()
        while p.waited < need:
            ticket = p.tickets[p.waited]
            if ticket is not None:
                ticket.result()
            p.waited += 1
        self.counters.waited(t0)

    def _finish(self, p: _PendingShard) -> None:
        self._wait_through(p, p.shard.size)
        with self._lock:
            os.close(p.fd)
            p.fd = -1
            p.buffer = None  # the mapping lives on only while vLLM holds a tensor of it

    # ---- tensors -----------------------------------------------------------------------------------------
    def tensors(self, checkpoint: Checkpoint) -> Iterator[tuple[str, object]]:
        """(name, tensor) for every tensor of every shard, in file order; tensors are views of the shard buffer.

        The next `lookahead_shards` shards are read while this one's tensors are handed out; a shard's header
        bytes are compared with the ones verified up front before its first tensor is handed out.
        """
        shards = list(checkpoint.shards)
        started: list[_PendingShard | None] = []
        try:
            for i in range(len(shards)):
                while len(started) < i + 1 + self.settings.lookahead_shards and len(started) < len(shards):
                    started.append(self._start(shards[len(started)]))
                p = started[i]
                assert p is not None
                self._wait_through(p, p.shard.data_start)
                assert p.buffer is not None
                if bytes(p.buffer[: p.shard.data_start]) != p.shard.header:
                    raise CheckpointError(p.shard.path, "changed while loading: header differs from the one checked")
                for t in p.shard.tensors:
                    self._wait_through(p, t.end)
                    tensor = as_tensor(p.buffer, t)
                    if p.mapped:
                        p.handed.append((weakref.ref(tensor), t.begin, t.end))
                    handed = time.perf_counter()
                    yield t.name, tensor
                    del tensor
                    self.counters.add("handout_s", time.perf_counter() - handed)
                    self.counters.add("tensors", 1)
                self._finish(p)
                self.counters.add("shards", 1)
                started[i] = None  # drop the buffer once its tensors are copied
        finally:
            for p in started:
                if p is not None:
                    for t in p.tickets:
                        if t is not None:
                            t.cancel()
                    with contextlib.suppress(BaseException):
                        self._wait_all(p)
                    if p.fd >= 0:
                        os.close(p.fd)

    def _wait_all(self, p: _PendingShard) -> None:
        for t in p.tickets:
            if isinstance(t, IOTicket) and not t.future.cancelled():
                t.future.exception()

    def wait_cache(self) -> int:
        """Wait until every block put into the cache is durable; return how many failed (logged, not raised)."""
        failed = 0
        for fut in self._puts:
            try:
                fut.result()
            except Exception as err:  # a cache that cannot take the weights degrades to no cache
                failed += 1
                if failed == 1:
                    log.warning("kvprefetch loader: weight cache write failed (%s); the next load reads the source",
                                err)  # fmt: skip
        self._puts.clear()
        return failed

    def close(self) -> None:
        """End the load: blocks under tensors still held are made private, every pin goes back to the pool."""
        self.io.close(wait=False)
        self._privatize_kept()
        self._shards.clear()  # the buffers of shards an error left unfinished
        if self.staging is not None:
            self.staging.close()


    def _privatize_kept(self) -> None:
        """The load is over and the pool's pins go back now: the mapped blocks under a tensor that something
        still holds (vLLM's loop keeps its last tensor; a model may keep one) become private copies first, so
        that tensor's bytes cannot change when the pool reuses the slot. Buffers already collected gave their
        pins back through their finalizers."""
        for p in self._shards:
            raw = p.late()
            if raw is None or not p.mapped:
                continue
            mapped = dict(p.mapped)
            alive = [(b, e) for ref, b, e in p.handed if ref() is not None]
            kept = {i for b, e in alive for i in range(b // self.block, -(-e // self.block))}
            for i in sorted(kept & mapped.keys()):
                if not privatize(p.addr + i * self.block, self.block):
                    raise MemoryError(f"could not copy a kept tensor's block out of the DRAM pool ({p.shard.path})")
                self.counters.add("privatized_bytes", self.block)
            if self.cache is not None:
                _release_mapped(self.cache, p.mapped)


def _release_mapped(cache: WeightCache, mapped: list[tuple[int, DramExtent]]) -> None:
    """A shard buffer's mapping is gone: nothing reads its mapped blocks any more; their pins go back."""
    cache.release([extent for _, extent in mapped])
    mapped.clear()


def as_tensor(buffer: memoryview, t: TensorEntry):
    """A tensor viewing t's bytes in buffer (no copy)."""
    import torch

    dtype = _torch_dtype(t.dtype)
    count = (t.end - t.begin) // dtype.itemsize
    flat = torch.frombuffer(buffer, dtype=dtype, count=count, offset=t.begin) if count else torch.empty(0, dtype=dtype)
    return flat.view(t.shape)


def _torch_dtype(name: str):
    import torch

    table = {
        "BOOL": torch.bool, "U8": torch.uint8, "I8": torch.int8, "I16": torch.int16, "I32": torch.int32,
        "I64": torch.int64, "F16": torch.float16, "BF16": torch.bfloat16, "F32": torch.float32,
        "F64": torch.float64, "F8_E5M2": torch.float8_e5m2, "F8_E4M3": torch.float8_e4m3fn,
        "U16": getattr(torch, "uint16", None), "U32": getattr(torch, "uint32", None),
        "U64": getattr(torch, "uint64", None), "F8_E8M0": getattr(torch, "float8_e8m0fnu", None),
    }  # fmt: skip
    dtype = table.get(name)
    if dtype is None:
        raise ValueError(f"safetensors dtype {name} has no torch dtype in this torch build")
    return dtype
