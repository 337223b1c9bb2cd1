"""The tiered store: the API the engine connectors use.

    lookup(keys)            -> which leading chunks are cached, and in which tier
    prefetch(keys, to=DRAM) -> start moving hits up now (async, cancellable, optional deadline)
    get_into(keys, buffers) -> copy the leading hits into caller memory (demand priority)
    put(keys, buffers)      -> store new chunks in DRAM now, write them back to disk asynchronously
    pin / unpin / stats / close

DRAM is the hub: a chunk read from disk lands in a DRAM slot (promotion) and is copied from there, and a
new chunk is written to DRAM and written back from its slot. Failures never propagate as errors to a
request: a chunk that cannot be read is a miss, and `get_into` reports how many leading chunks it loaded.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field
from enum import StrEnum

import numpy as np

from kvprefetch.config import StoreConfig
from kvprefetch.crashpoints import crash_point
from kvprefetch.episodes import EpisodeLog
from kvprefetch.io.engine import IOClass, IOEngine, IOTicket
from kvprefetch.tiers.access import FileAccess
from kvprefetch.tiers.chunk_format import HEADER_BYTES, CorruptChunk, image_bytes, write_header
from kvprefetch.tiers.disk import ChunkMissing, DiskFullError, DiskTier, aligned_buffer
from kvprefetch.tiers.dram import SHM_DIR, SharedChunkPool, pool_directory
from kvprefetch.tiers.errors import ErrorKind, ErrorTally
from kvprefetch.tiers.memory import Segments, copy_bytes
from kvprefetch.tiers.remote import RemoteRejected, RemoteTier, RemoteUnavailable, open_backend
from kvprefetch.tiers.staging import StagingBuffers

log = logging.getLogger(__name__)


class Tier(StrEnum):
    DRAM = "dram"
    DISK = "disk"
    REMOTE = "remote"


def error_kind(err: BaseException) -> ErrorKind:
    """The kind of a failure the tiers raise (checked most specific first: the remote's errors are OSErrors)."""
    if isinstance(err, CorruptChunk):
        return ErrorKind.CORRUPT
    if isinstance(err, ChunkMissing):
        return ErrorKind.MISSING
    if isinstance(err, RemoteUnavailable):
        return ErrorKind.UNAVAILABLE
    if isinstance(err, RemoteRejected):
        return ErrorKind.REJECTED
    if isinstance(err, DiskFullError) or (isinstance(err, OSError) and err.errno == errno.ENOSPC):
        return ErrorKind.NO_SPACE
    return ErrorKind.IO


@dataclass
class LookupResult:
    """The longest cached prefix: tiers[i] holds chunk i, for i < num_hit_chunks."""

    tiers: list[Tier]

    @property
    def num_hit_chunks(self) -> int:
        return len(self.tiers)

    def count(self, tier: Tier) -> int:
        return sum(1 for t in self.tiers if t is tier)


@dataclass(frozen=True)
class DramExtent:
    """A chunk's payload pinned in the DRAM pool, where its bytes lie in the pool's file (`acquire_extent`)."""

    slot: int
    fd: int
    offset: int
    nbytes: int
    page_bytes: int  # the file's page size: a mapping's offset and length are multiples of it

    def mappable(self, length: int) -> bool:
        """Whether `length` bytes mapped from here cover exactly the payload, on the file's page boundaries."""
        return length == self.nbytes and self.offset % self.page_bytes == 0 and length % self.page_bytes == 0


@dataclass
class PrefetchHandle:
    """Tickets of one prefetch; keys already in the target tier need no ticket."""

    keys: list[bytes]
    tickets: dict[bytes, IOTicket] = field(default_factory=dict)

    def done(self) -> bool:
        return all(t.done() for t in self.tickets.values())

    def wait(self, timeout: float | None = None) -> bool:
        deadline = None if timeout is None else time.monotonic() + timeout
        for ticket in self.tickets.values():
            remaining = None if deadline is None else max(0.0, deadline - time.monotonic())
            try:
                ticket.result(remaining)
            except TimeoutError:
                return False
            except Exception:  # a failed prefetch is a future miss, not an error here
                pass
        return True

    @property
    def num_reads(self) -> int:
        """Chunks this prefetch reads from below DRAM (the others were in DRAM already)."""
        return len(self.tickets)

    def pending(self) -> int:
        """Reads not finished yet (queued or running)."""
        return sum(1 for t in self.tickets.values() if not t.done())

    def cancel(self, keys: Sequence[bytes] | None = None) -> int:
        """Drop the reads (of ``keys``, default all) not started yet; return how many were dropped."""
        tickets = self.tickets.values() if keys is None else [self.tickets[k] for k in keys if k in self.tickets]
        return sum(1 for t in tickets if t.cancel())

    def on_ready(self, callback: Callable[[bytes, bool], None]) -> None:
        """Call ``callback(key, in_dram)`` once per read as it finishes (at once for reads already finished;
        otherwise on an I/O thread). ``in_dram`` is False for a read that failed or was dropped."""
        for key, ticket in self.tickets.items():
            ticket.future.add_done_callback(lambda _f, key=key, ticket=ticket: callback(key, ticket_ok(ticket, key)))

    def results(self) -> dict[bytes, bool | None]:
        """Per chunk: True once in DRAM, False if its read failed or was dropped, None while in flight.
        Keys that needed no read (already in DRAM) are True."""
        out: dict[bytes, bool | None] = {}
        for key in self.keys:
            ticket = self.tickets.get(key)
            if ticket is None:
                out[key] = True
            elif not ticket.done():
                out[key] = None
            else:
                out[key] = ticket_ok(ticket, key)
        return out


def ticket_ok(ticket: IOTicket, key: bytes) -> bool:
    """Whether a finished promotion put key in DRAM (batched promotions answer per key)."""
    fut = ticket.future
    if fut.cancelled() or fut.exception() is not None:
        return False
    result = fut.result()
    return bool(result.get(key, False)) if isinstance(result, dict) else bool(result)


def as_bytes_view(buffer) -> memoryview | Segments:
    """A writable flat byte view of a buffer (numpy array, bytearray, memoryview, CPU torch tensor); `Segments`
    (a chunk laid out in several runs of the caller's memory) as they are."""
    if isinstance(buffer, Segments):
        return buffer
    if hasattr(buffer, "numpy") and not isinstance(buffer, np.ndarray):  # torch.Tensor on CPU
        buffer = buffer.numpy()
    view = memoryview(buffer)
    if not view.c_contiguous:
        raise ValueError("buffer must be C-contiguous")
    return view.cast("B") if view.format != "B" or view.ndim != 1 else view


class TieredStore:
    """DRAM (shared memory) over disk, moved by one prioritized I/O engine."""

    def __init__(self, config: StoreConfig, chunk_bytes: int):
        if chunk_bytes <= 0:
            raise ValueError(f"chunk_bytes must be positive, got {chunk_bytes}")
        self.config = config
        self.chunk_bytes = chunk_bytes
        self.image_bytes = image_bytes(chunk_bytes)
        self.access = FileAccess.for_group(config.share_group)
        self.dram = open_pool(config, self.image_bytes, self.access)
        self.errors = ErrorTally()  # failures per (tier, kind), for /metrics
        self.disk: DiskTier | None = None
        if config.disk_enabled:
            d = config.disk
            staging = StagingBuffers(self.image_bytes, config.io.threads) if d.staging == "auto" else None
            self.disk = DiskTier(
                d.path, int(d.capacity_bytes), d.direct_io, d.fsync, staging, int(d.read_inflight_bytes), self.access
            )
        self.remote: RemoteTier | None = None
        if config.remote_enabled:
            r = config.remote
            self.remote = RemoteTier(open_backend(r), r.key_prefix, r.retry_after_s, self.errors)
            self.remote.backend.register_memory(self.dram.data_view())
        self._remote_written: set[bytes] = set()
        self._hits: dict[bytes, int] = {}
        self.io = IOEngine(threads=config.io.threads, cpus=config.io.cpus)
        if config.io.read_rate_limit_bps:
            self.io.set_rate_limit(Tier.DISK.value, int(config.io.read_rate_limit_bps))
        if config.io.read_stream_bps:
            self.io.set_stream_limit(Tier.DISK.value, int(config.io.read_stream_bps))
        self.counters = {
            "dram_hits": 0,
            "disk_hits": 0,
            "misses": 0,
            "load_errors": 0,
            "promoted": 0,
            "dram_full": 0,
            "put_chunks": 0,
            "put_skipped_present": 0,
            "put_present_not_durable": 0,
            "put_dram_only": 0,
            "writeback_errors": 0,
            "remote_hits": 0,
            "remote_writes": 0,
        }
        self._episodes = EpisodeLog(log)

    # ---- lookup ------------------------------------------------------------------------------------------
    def _tiers_of(self, keys: Sequence[bytes]) -> list[Tier | None]:
        """The fastest tier holding each key (None: nowhere). Stops probing at the first miss (the hit is a
        prefix) unless a remote tier may still hold what the local tiers miss: one batched remote round trip."""
        keys = list(keys)
        tiers: list[Tier | None] = []
        for key, hot in zip(keys, self.dram.contains_many(keys), strict=True):
            if hot:
                tiers.append(Tier.DRAM)
            elif self.disk is not None and self.disk.contains(key):
                tiers.append(Tier.DISK)
            elif self.remote is None:
                break
            else:
                tiers.append(None)
        tiers += [None] * (len(keys) - len(tiers))
        if self.remote is not None:
            first_miss = next((i for i, t in enumerate(tiers) if t is None), len(keys))
            missing = [i for i in range(first_miss, len(keys)) if tiers[i] is None]
            found = self.remote.contains_many([keys[i] for i in missing])
            for i, there in zip(missing, found, strict=True):
                if there:
                    tiers[i] = Tier.REMOTE
        return tiers

    def residency(self, keys: Sequence[bytes]) -> list[frozenset[Tier]]:
        """Every tier holding each key now, asked of each tier itself (the DRAM pool's node-wide index, the disk
        file, one batched remote round trip), whoever put it there or removed it: what the KV events announce.
        (`lookup` answers a different question: the fastest tier of each key of a prefix, from this process's
        disk index.) A remote that does not answer holds nothing."""
        keys = list(keys)
        dram = self.dram.contains_many(keys)
        disk = [self.disk.present(k) for k in keys] if self.disk is not None else [False] * len(keys)
        remote = self.remote.contains_many(keys) if self.remote is not None else [False] * len(keys)
        return [
            frozenset(t for t, there in ((Tier.DRAM, d), (Tier.DISK, f), (Tier.REMOTE, r)) if there)
            for d, f, r in zip(dram, disk, remote, strict=True)
        ]

    def in_dram(self, keys: Sequence[bytes]) -> list[bool]:
        """Per key: whether it is in the DRAM tier now (READY)."""
        return self.dram.contains_many(list(keys))

    def writing(self, key: bytes) -> bool:
        """Whether key is being written into DRAM now (a put or a promotion in flight, by any process on the
        node): a lookup reads it as a miss, yet it is about to be a hit."""
        return self.dram.writing(key)

    def lookup(self, keys: Sequence[bytes]) -> LookupResult:
        """Longest prefix of keys present in some tier, and the fastest tier holding each."""
        tiers = self._tiers_of(keys)
        end = next((i for i, t in enumerate(tiers) if t is None), len(tiers))
        return LookupResult([t for t in tiers[:end] if t is not None])

    # ---- promotion ---------------------------------------------------------------------------------------
    def _promote(self, key: bytes, source: Tier) -> bool:
        """Read key from disk or the remote tier into a DRAM slot. True when it is in DRAM afterwards."""
        slot = self.dram.allocate(key, self.chunk_bytes)
        if slot is None:
            if self.dram.contains(key) or self.dram.wait_ready(key, self.config.io.join_timeout_s):
                return True  # another thread or process promoted it: joined its read instead of reading twice
            self.counters["dram_full"] += 1
            return False
        try:
            with self.io.transfer():  # (a promote that joined another's read above moved nothing)
                if source is Tier.DISK:
                    assert self.disk is not None
                    self.disk.read_into(key, self.dram.image(slot))
                else:
                    assert self.remote is not None
                    self.remote.read_into(key, self.dram.image(slot))
            crash_point("store.promote.read")
        except (ChunkMissing, CorruptChunk, OSError) as err:  # RemoteUnavailable is a ConnectionError
            self.dram.abort(slot)
            self._load_failed(key, err, source)
            raise
        except BaseException:
            self.dram.abort(slot)
            raise
        self.dram.commit(slot)
        self.counters["promoted"] += 1
        return True

    def _submit_promote(self, key: bytes, source: Tier, cls: IOClass, deadline: float | None = None) -> IOTicket:
        return self.io.submit(
            source.value,
            cls,
            lambda: self._promote(key, source),
            nbytes=self.image_bytes,
            dedup=("promote", key),
            deadline=deadline,
            paced_inside=True,
        )

    def prefetch(self, keys: Sequence[bytes], to: Tier = Tier.DRAM, deadline: float | None = None) -> PrefetchHandle:
        """Start moving keys' disk/remote hits into DRAM in order; deadline (monotonic s) drops reads not
        started by then."""
        if to is not Tier.DRAM:
            raise ValueError(f"prefetch target must be {Tier.DRAM.value}, got {to}")
        handle = PrefetchHandle(list(keys))
        tiers = self.lookup(keys).tiers
        remote = [k for k, t in zip(keys, tiers, strict=False) if t is Tier.REMOTE]
        handle.tickets.update(self._submit_remote_promotes(remote, IOClass.PREFETCH, deadline))
        for key, tier in zip(keys, tiers, strict=False):
            if tier is Tier.DISK:
                handle.tickets[key] = self._submit_promote(key, tier, IOClass.PREFETCH, deadline)
        return handle

    def measure_reads(self, keys: Sequence[bytes]) -> PrefetchHandle:
        """Read keys' disk chunks into scratch memory, at prefetch priority and paced as promotions are, without
        promoting them: a measurement of the disk (the connector's disk probe). Nothing enters DRAM, so the
        chunks' own writes (the request that recomputes them saves them at once) are not kept out of DRAM by a
        slow read of the same keys. The handle's `on_ready` says which reads moved their bytes."""
        handle = PrefetchHandle(list(keys))
        disk = self.disk
        if disk is None:
            return handle

        def read(key: bytes) -> bool:
            with self.io.transfer():
                disk.read_bounce(key, self.chunk_bytes)
            return True

        for key in keys:
            if not self.dram.contains(key) and disk.contains(key):
                handle.tickets[key] = self.io.submit(
                    Tier.DISK.value, IOClass.PREFETCH, lambda key=key: read(key), nbytes=self.image_bytes,
                    paced_inside=True,
                )  # fmt: skip
        return handle

    def _promote_remote_batch(self, keys: list[bytes]) -> dict[bytes, bool]:
        """One batched remote read straight into DRAM slots; per key, whether it is in DRAM afterwards."""
        assert self.remote is not None
        out: dict[bytes, bool] = {}
        slots: dict[bytes, int] = {}
        for key in keys:
            slot = self.dram.allocate(key, self.chunk_bytes)
            if slot is not None:
                slots[key] = slot
            elif self.dram.contains(key) or self.dram.wait_ready(key, self.config.io.join_timeout_s):
                out[key] = True
            else:
                self.counters["dram_full"] += 1
                out[key] = False
        if not slots:
            return out
        try:
            results = self.remote.read_many(list(slots), [self.dram.image(s) for s in slots.values()])
        except ConnectionError as err:
            results = [err] * len(slots)
        except BaseException:
            for slot in slots.values():
                self.dram.abort(slot)
            raise
        for (key, slot), result in zip(slots.items(), results, strict=True):
            if isinstance(result, Exception):
                self.dram.abort(slot)
                self._load_failed(key, result, Tier.REMOTE)
                out[key] = False
            else:
                self.dram.commit(slot)
                self.counters["promoted"] += 1
                out[key] = True
        return out

    def _submit_remote_promotes(
        self, keys: list[bytes], cls: IOClass, deadline: float | None = None
    ) -> dict[bytes, IOTicket]:
        """Join reads already in flight; batch the rest (one round trip per `backend.batch_size` chunks)."""
        tickets: dict[bytes, IOTicket] = {}
        fresh: list[bytes] = []
        for key in keys:
            joined = self.io.join(("promote", key), cls)
            if joined is not None:
                tickets[key] = joined
            else:
                fresh.append(key)
        step = self.remote.backend.batch_size if self.remote is not None else 1
        for i in range(0, len(fresh), step):
            batch = fresh[i : i + step]
            shared = self.io.submit_shared(
                Tier.REMOTE.value,
                cls,
                lambda b=batch: self._promote_remote_batch(b),
                nbytes=len(batch) * self.image_bytes,
                dedups=[("promote", k) for k in batch],
                deadline=deadline,
            )
            tickets.update(zip(batch, shared, strict=True))
        return tickets

    # ---- reads into caller memory ------------------------------------------------------------------------
    def get_into(self, keys: Sequence[bytes], buffers: Sequence, cls: IOClass = IOClass.DEMAND) -> int:
        """Copy the leading cached chunks into buffers; return how many were loaded (stops at the first miss).

        DRAM hits are pinned up front, so the promotions this call starts cannot evict them; every disk read
        starts at once, so they run in parallel while earlier chunks are copied.
        """
        if len(buffers) < len(keys):
            raise ValueError(f"{len(keys)} keys but only {len(buffers)} buffers")
        held: dict[bytes, int] = {}
        pending: dict[bytes, IOTicket] = {}
        tiers = self.lookup(keys).tiers
        remote = [k for k, t in zip(keys, tiers, strict=False) if t is Tier.REMOTE]
        pending.update(self._submit_remote_promotes(remote, cls))
        for key, tier in zip(keys, tiers, strict=False):
            if key in held:  # a key repeated in one call: its first place is loaded, the repeat ends the prefix
                break
            slot = self.dram.acquire(key) if tier is Tier.DRAM else None
            if slot is not None:
                held[key] = slot
            elif key in pending:
                continue
            elif self.disk is not None and self.disk.contains(key):
                pending[key] = self._submit_promote(key, Tier.DISK, cls)
            else:
                break
        loaded = 0
        try:
            for key, buffer in zip(keys, buffers, strict=False):
                dst = as_bytes_view(buffer)
                if key in held:
                    ok = self._copy_out(key, held.pop(key), dst, Tier.DRAM)
                elif key in pending:
                    ok = self._finish_promote(key, pending.pop(key), dst)
                else:
                    self.counters["misses"] += 1
                    ok = False
                if not ok:
                    break
                loaded += 1
        finally:
            for slot in held.values():
                self.dram.release(slot)
            for ticket in pending.values():
                ticket.cancel()
        return loaded

    def _finish_promote(self, key: bytes, ticket: IOTicket, dst: memoryview | Segments) -> bool:
        try:
            ticket.result()
        except (ChunkMissing, CorruptChunk, OSError):  # counted where the read failed, in _promote
            return False
        slot = self.dram.acquire(key) if ticket_ok(ticket, key) else None
        if slot is None:  # DRAM full of pinned chunks, or evicted again already: read around DRAM
            return self._load_direct(key, dst)
        return self._copy_out(key, slot, dst, Tier.REMOTE if ticket.tier == Tier.REMOTE.value else Tier.DISK)

    def _copy_out(self, key: bytes, slot: int, dst: memoryview | Segments, tier: Tier) -> bool:
        """Copy a pinned slot's payload to dst and release the pin."""
        try:
            payload = self.dram.payload(slot, key)
        except CorruptChunk as err:
            self._drop_corrupt(key, slot, err)
            return False
        try:
            if len(payload) != len(dst):
                self._load_failed(key, CorruptChunk(f"chunk of {len(payload)} B into a {len(dst)} B buffer"), Tier.DRAM)
                return False
            copy_bytes(dst, payload)
        finally:
            self.dram.release(slot)
        self.counters[f"{tier.value}_hits"] += 1
        self._count_hit(key)
        return True

    def _drop_corrupt(self, key: bytes, slot: int, err: CorruptChunk) -> None:
        """A pinned DRAM slot's image is damaged: a miss, counted, and the slot dropped (unless another reader
        pins it still)."""
        self.dram.release(slot)
        self._load_failed(key, err, Tier.DRAM)
        self.dram.discard(key)

    def _count_hit(self, key: bytes) -> None:
        """hit_count write policy: a chunk goes to the shared tier once it has been read min_hits times."""
        if self.remote is None or self.config.remote.write_policy != "hit_count" or key in self._remote_written:
            return
        self._hits[key] = hits = self._hits.get(key, 0) + 1
        if hits >= self.config.remote.min_hits:
            slot = self.dram.acquire(key)
            if slot is not None:
                self._remote_written.add(key)
                self._hits.pop(key, None)
                self._submit_remote_write(key, slot)

    def _load_direct(self, key: bytes, dst: memoryview | Segments) -> bool:
        if self.disk is None or not self.disk.contains(key):
            self.counters["dram_full"] += 1
            return False  # remote reads land in (registered) DRAM only
        try:
            image, nbytes = self.disk.read_bounce(key, self.chunk_bytes)
        except (ChunkMissing, CorruptChunk, OSError) as err:
            self._load_failed(key, err, Tier.DISK)
            return False
        copy_bytes(dst, image[HEADER_BYTES : HEADER_BYTES + nbytes])
        self.counters["disk_hits"] += 1
        return True

    def _load_failed(self, key: bytes, err: BaseException, tier: Tier) -> None:
        self.counters["load_errors"] += 1
        self._tally(tier, err)
        if isinstance(err, RemoteUnavailable):
            return  # the remote tier logged its outage
        cause = f"{tier.value}:{type(err).__name__}"
        self._episodes.warn(cause, "kvprefetch: %s chunk load failed (%s: %s); treating it as a miss (logged once"
                            " per episode)", tier.value, type(err).__name__, err)  # fmt: skip

    def _tally(self, tier: Tier, err: BaseException) -> None:
        """Count a failure by tier and kind. An unreachable remote is counted by the remote tier, once per failed
        attempt, not per chunk its outage turned into a miss (nor while it is marked down)."""
        if not isinstance(err, RemoteUnavailable):
            self.errors.add(tier.value, error_kind(err))

    @contextlib.contextmanager
    def view(self, keys: Sequence[bytes]):
        """Pinned, zero-copy views of the payloads of the leading keys that are in DRAM now.

        Yields a list of read-only memoryviews (shorter than keys where the DRAM prefix ends); the chunks
        cannot be evicted until the block exits. For copying straight into engine memory, layer by layer.
        """
        slots: list[int] = []
        try:
            views: list[memoryview] = []
            for key in keys:
                slot = self.dram.acquire(key)
                if slot is None:
                    break
                slots.append(slot)
                try:
                    views.append(self.dram.payload(slot, key).toreadonly())
                except CorruptChunk as err:  # a miss ends the prefix (the next get_into drops the slot)
                    self._load_failed(key, err, Tier.DRAM)
                    break
            self.counters["dram_hits"] += len(views)
            yield views
        finally:
            for slot in slots:
                self.dram.release(slot)

    def acquire_extent(self, key: bytes) -> DramExtent | None:
        """Pin key's chunk in DRAM and say where its payload lies in the pool's file, for mapping it elsewhere
        without a copy (the weight loader: `kvprefetch.loader.cache`); None if it is not in DRAM (or its image is
        damaged: then it is dropped, a miss). The pin holds until `release_extent`, or until this store closes."""
        slot = self.dram.acquire(key)
        if slot is None:
            return None
        try:
            fd, offset, nbytes = self.dram.payload_extent(slot, key)
        except CorruptChunk as err:
            self._drop_corrupt(key, slot, err)
            return None
        self.counters["dram_hits"] += 1
        return DramExtent(slot, fd, offset, nbytes, self.dram.page_bytes)

    def release_extent(self, extent: DramExtent) -> None:
        """Drop the pin `acquire_extent` took (what was mapped from it must not be read after this)."""
        self.dram.release(extent.slot)

    # ---- writes ------------------------------------------------------------------------------------------
    def put(self, keys: Sequence[bytes], buffers: Sequence, write_back: bool = True) -> Future:
        """Store chunks in DRAM now and write them back to disk asynchronously (``write_back`` False: DRAM only,
        neither the disk nor the remote tier; a key DRAM holds already, or cannot place, is left; the future
        resolves at once).

        The returned future resolves (to the number of chunks written to disk) once every chunk is durable;
        its exception is the first write-back error, e.g. DiskFullError, while DRAM keeps serving the chunks.
        Durable means on disk: a key already in the shared DRAM pool is not, since the process that put it
        there may have died before its write-back, or be writing it still. Such a key is written back from a
        private copy of the caller's bytes (a write-back finding the file already committed by another
        process skips it), so the future never acknowledges a chunk that only DRAM holds. With no disk tier,
        DRAM is as durable as the store gets and a key present there is skipped.
        """
        done: Future = Future()
        tickets: list[IOTicket] = []
        for key, buffer in zip(keys, buffers, strict=True):
            src = as_bytes_view(buffer)
            if len(src) != self.chunk_bytes:
                raise ValueError(f"chunk buffer holds {len(src)} B, the store's chunks are {self.chunk_bytes} B")
            slot = self.dram.allocate(key, len(src))
            if slot is not None:
                image = self.dram.image(slot)
                copy_bytes(image[HEADER_BYTES : HEADER_BYTES + len(src)], src)
                crash_point("store.put.payload_copied")
                write_header(image, key, len(src))
                crash_point("store.put.header_written")
                if self.disk is not None and write_back:
                    self.dram.pin_slot(slot)  # held until written back, so eviction cannot lose it
                self.dram.commit(slot)
                if not write_back:
                    self.counters["put_dram_only"] += 1
                    continue
            elif not write_back or self._durable(key):
                self.counters["put_skipped_present"] += 1
                continue
            else:  # in DRAM only (not durable), being written, or every slot is pinned: to disk from a copy
                present = self.dram.contains(key) or self.dram.writing(key)
                self.counters["put_present_not_durable" if present else "dram_full"] += 1
                if self.disk is None:
                    continue
                image = aligned_buffer(self.image_bytes)
                copy_bytes(image[HEADER_BYTES : HEADER_BYTES + len(src)], src)
                write_header(image, key, len(src))
            self.counters["put_chunks"] += 1
            if self.disk is not None:
                tickets.append(self._submit_writeback(key, image, slot))
            if slot is not None and self.remote is not None and self.config.remote.write_policy == "write_through":
                self.dram.pin_slot(slot)
                self._remote_written.add(key)
                tickets.append(self._submit_remote_write(key, slot))
        crash_point("store.put.queued")
        _gather(tickets, done)
        return done

    def _durable(self, key: bytes) -> bool:
        """Whether key survives this node's processes dying: on disk, or in DRAM when there is no disk tier."""
        return self.disk.contains(key) if self.disk is not None else self.dram.contains(key)

    def _submit_writeback(self, key: bytes, image: memoryview, slot: int | None) -> IOTicket:
        assert self.disk is not None
        disk = self.disk

        def write() -> bool:
            try:
                if disk.contains(key):
                    return False  # already committed (put again, or by another process): no I/O in the stats
                with self.io.transfer():
                    disk.write(key, image)
                crash_point("store.writeback.written")
                return True
            except OSError as err:
                self.counters["writeback_errors"] += 1
                self._tally(Tier.DISK, err)
                raise
            finally:
                if slot is not None:
                    self.dram.release(slot)

        return self.io.submit(Tier.DISK.value, IOClass.WRITEBACK, write, nbytes=self.image_bytes, paced_inside=True)

    def _submit_remote_write(self, key: bytes, slot: int) -> IOTicket:
        """Copy a pinned slot's image to the remote tier, then release the pin. Failure = not shared, no error."""
        assert self.remote is not None
        remote = self.remote

        def write() -> bool:
            try:
                crash_point("store.remote_write.sending")
                remote.write(key, self.dram.image(slot)[: self.image_bytes])
                crash_point("store.remote_write.acked")
                self.counters["remote_writes"] += 1
                return True
            except (ConnectionError, RemoteRejected) as err:
                self._remote_written.discard(key)
                self._tally(Tier.REMOTE, err)
                return False
            finally:
                self.dram.release(slot)

        return self.io.submit(Tier.REMOTE.value, IOClass.WRITEBACK, write, nbytes=self.image_bytes)

    # ---- pins, stats, lifecycle --------------------------------------------------------------------------
    def pin(self, keys: Sequence[bytes]) -> list[bool]:
        """Pin keys in DRAM (e.g. while a load into the engine is pending); False where not in DRAM."""
        return [self.dram.acquire(k) is not None for k in keys]

    def unpin(self, keys: Sequence[bytes]) -> None:
        for key in keys:
            self.dram.unpin(key)

    def flush(self, timeout: float | None = None) -> bool:
        """Wait until every queued write-back has finished."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.io.pending(Tier.DISK.value) or self.io.pending(Tier.REMOTE.value):
            if deadline is not None and time.monotonic() > deadline:
                return False
            time.sleep(0.002)
        return True

    def drop_local(self) -> int:
        """Remove every chunk this node's DRAM pool and this store's disk tier hold, except chunks a reader pins
        now; return how many were removed. For an engine's explicit "clear the cache" request (SGLang's
        `/clear_hicache_storage_backend`). Queued write-backs finish first, so none lands after the clear. The
        shared tier is left alone: other nodes read it."""
        self.flush()
        dropped = sum(self.dram.discard(key) for key in self.dram.unpinned_ticks())
        if self.disk is not None:
            stored = self.disk.keys()
            for key in stored:
                self.disk.delete(key)
            dropped += len(stored)
        return dropped

    # ---- states a benchmark starts from (the testbed's engine process) ---------------------------------------
    def preload_dram(self, keys: Sequence[bytes], batch: int = 256, timeout: float = 600) -> int:
        """Read `keys` up into the DRAM pool, `batch` at a time, each batch waited for (a cell that starts with
        DRAM warm); how many are in DRAM afterwards."""
        for i in range(0, len(keys), batch):
            self.prefetch(keys[i : i + batch]).wait(timeout=timeout)
        return sum(self.dram.contains_many(list(keys))) if keys else 0

    def cool_dram(self, keys: Sequence[bytes] | None = None) -> int:
        """Drop `keys` (None: every chunk no reader pins) from the DRAM pool, leaving the tiers below as they are
        (a cell that starts with only the disk tier warm; a probe that reads the same chunks from disk again);
        how many were dropped. Pinned chunks stay."""
        chosen = list(self.dram.unpinned_ticks()) if keys is None else keys
        return sum(1 for key in chosen if self.dram.discard(key))

    def set_disk_stream_limit(self, bps: float | None) -> None:
        """Cap each disk read stream at `bps` (None: uncapped), as ``io.read_stream_bps`` does at start; for a
        sweep that changes an emulated array's per-stream rate on a store already open."""
        self.io.set_stream_limit(Tier.DISK.value, bps)

    def seed_remote(self, keys: Sequence[bytes], source: DiskTier) -> int:
        """Copy `keys` from another disk tier's directory (`source`) into this store's remote tier only, each
        through a DRAM slot given back unpublished (so neither this DRAM pool nor this disk tier holds them after);
        how many were written. For a benchmark whose chunks start in the shared tier alone."""
        if self.remote is None:
            raise RuntimeError("seed_remote needs a store with a remote tier")
        written = 0
        for key in keys:
            slot = self.dram.allocate(key, self.chunk_bytes)
            if slot is None:
                continue
            try:
                source.read_into(key, self.dram.image(slot))
                self.remote.write(key, self.dram.image(slot)[: self.image_bytes])
                written += 1
            finally:
                self.dram.abort(slot)
        return written

    def stats(self) -> dict:
        return {
            "chunk_bytes": self.chunk_bytes,
            "store": dict(self.counters),
            "dram": self.dram.stats(),
            "disk": self.disk.stats() if self.disk else None,
            "remote": self.remote.stats() if self.remote else None,
            "io": self.io.stats.snapshot(),
            "errors": self.errors.totals(),
        }

    def close(self) -> None:
        self.io.close(wait=True)
        if self.remote is not None:
            self.remote.close()
        self.dram.close()
        if self.disk is not None and self.disk.staging is not None:
            self.disk.staging.close()

    def __enter__(self) -> TieredStore:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def open_pool(config: StoreConfig, slot_bytes: int, access: FileAccess) -> SharedChunkPool:
    """Open (or create) the node's DRAM pool for this config, on huge pages where configured and possible."""
    d = config.dram
    directory = pool_directory(d.pool_name, d.backing, int(d.capacity_bytes))
    kwargs = dict(
        slot_bytes=slot_bytes,
        capacity_bytes=int(d.capacity_bytes),
        max_procs=d.max_processes,
        hugepages=d.hugepages,
        access=access,
        keep_idle_s=d.keep_idle_s,
        reserve="fallocate" if d.reserve == "at_open" else "first_write",
    )
    try:
        return SharedChunkPool(d.pool_name, directory=directory, **kwargs)
    except OSError as err:
        if directory == SHM_DIR or d.backing == "hugetlbfs":
            raise
        log.warning("kvprefetch: huge-page pool at %s failed (%s); using %s", directory, err, SHM_DIR)
        return SharedChunkPool(d.pool_name, directory=SHM_DIR, **kwargs)


def _gather(tickets: list[IOTicket], done: Future) -> None:
    """Resolve done when all tickets have, with the count of True results or the first error."""
    if not tickets:
        done.set_result(0)
        return
    remaining = [len(tickets)]
    results: list = []

    def on_done(fut: Future) -> None:
        results.append(fut)
        remaining[0] -= 1
        if remaining[0] == 0:
            errors = [f.exception() for f in results if not f.cancelled() and f.exception() is not None]
            if errors:
                done.set_exception(errors[0])
            else:
                done.set_result(sum(1 for f in results if not f.cancelled() and f.result()))

    for ticket in tickets:
        ticket.future.add_done_callback(on_done)
