"""One queue, three priority classes: demand loads > prefetches > write-backs.

Every move between tiers is an op submitted here. Worker threads always take the most urgent op, so a
request that waits now is never stuck behind speculative prefetch or write-back traffic. Reads are
deduplicated by (tier, key): a demand load for a chunk already being prefetched joins that read (and lifts it
to demand priority if it has not started), so a chunk is never read twice. A prefetch can be cancelled (or
given a deadline) as long as it has not started and nobody else waits on it.

An op may also find, once it runs, that there is nothing to move (another process read the chunk first: the
shared DRAM pool lets it join that read). Such ops are submitted ``paced_inside`` and call `IOEngine.transfer`
around the bytes they really move, so the emulated storage caps and the byte counts apply to real transfers only.
"""

from __future__ import annotations

import contextlib
import heapq
import itertools
import threading
import time
from collections.abc import Callable, Collection, Iterator
from concurrent.futures import CancelledError, Future
from enum import IntEnum
from typing import Any

from kvprefetch.io.affinity import pin_thread
from kvprefetch.io.stats import IOStats
from kvprefetch.io.throttle import RateLimiter, wait_until


class IOClass(IntEnum):
    DEMAND = 0
    PREFETCH = 1
    WRITEBACK = 2

    @property
    def label(self) -> str:
        return self.name.lower()


class _Op:
    __slots__ = ("cls", "deadline", "dedup", "fn", "future", "holders", "moved", "nbytes", "paced_inside", "started",
                 "tier")  # fmt: skip

    def __init__(self, tier: str, cls: IOClass, fn: Callable[[], Any], nbytes: int, dedup, deadline,
                 paced_inside: bool = False):  # fmt: skip
        self.tier, self.cls, self.fn, self.nbytes, self.dedup, self.deadline = tier, cls, fn, nbytes, dedup, deadline
        self.future: Future = Future()
        self.holders = 0
        self.started = False
        self.paced_inside = paced_inside  # fn calls IOEngine.transfer() around what it really moves
        self.moved = False  # set once its transfer ran (a paced_inside op may find nothing to transfer)


class IOTicket:
    """A caller's handle on an op (several tickets may share one deduplicated op)."""

    def __init__(self, engine: IOEngine, op: _Op):
        self._engine, self._op, self._released = engine, op, False

    @property
    def tier(self) -> str:
        return self._op.tier

    @property
    def future(self) -> Future:
        return self._op.future

    def result(self, timeout: float | None = None) -> Any:
        return self._op.future.result(timeout)

    def done(self) -> bool:
        return self._op.future.done()

    def cancel(self) -> bool:
        """Withdraw this caller's interest; the op is dropped if it has not started and no one else waits."""
        if self._released:
            return False
        self._released = True
        return self._engine._release(self._op)


class IOEngine:
    """Priority thread pool for tier I/O, with read deduplication, cancellation, throttles and stats."""

    def __init__(self, threads: int = 4, name: str = "kvprefetch-io", cpus: Collection[int] | None = None):
        self.stats = IOStats()
        self._limits: dict[str, RateLimiter] = {}
        self._stream_bps: dict[str, float] = {}
        self._read_s_per_byte: dict[str, float] = {}
        self._cv = threading.Condition()
        self._heap: list[tuple[int, int, _Op]] = []
        self._seq = itertools.count()
        self._inflight: dict[Any, _Op] = {}
        self._closed = False
        self._cpus = tuple(cpus) if cpus else None
        self._running = threading.local()  # .op: the op this I/O thread runs now (for transfer())
        self._threads = [threading.Thread(target=self._worker, name=f"{name}-{i}", daemon=True) for i in range(threads)]
        for t in self._threads:
            t.start()

    def set_rate_limit(self, tier: str, bytes_per_s: float | None) -> None:
        """Cap the read bandwidth of a tier (None removes the cap)."""
        if bytes_per_s is None:
            self._limits.pop(tier, None)
        else:
            self._limits[tier] = RateLimiter(bytes_per_s)

    def set_stream_limit(self, tier: str, bytes_per_s: float | None) -> None:
        """Cap what one read of a tier moves per second (None removes the cap): storage that needs several reads
        in flight to reach its bandwidth, as a networked array does (each I/O thread is one stream)."""
        if bytes_per_s is None:
            self._stream_bps.pop(tier, None)
        elif bytes_per_s <= 0:
            raise ValueError("bytes_per_s must be positive")
        else:
            self._stream_bps[tier] = float(bytes_per_s)

    def _emulated_end(self, op: _Op, t0: float) -> float | None:
        """When an emulated transfer of op would end: on the tier's pipe (`set_rate_limit`) and as one stream
        (`set_stream_limit`), whichever is later; None when neither applies (write-back is never capped)."""
        if op.cls == IOClass.WRITEBACK:
            return None
        limit, stream = self._limits.get(op.tier), self._stream_bps.get(op.tier)
        ends = [limit.reserve(op.nbytes)] if limit is not None else []
        if stream is not None:  # the part of one stream's transfer time the read itself will not take
            ends.append(t0 + op.nbytes * max(0.0, 1.0 / stream - self._read_s_per_byte.get(op.tier, 0.0)))
        return max(ends) if ends else None

    def _learn_read_time(self, op: _Op, seconds: float) -> None:
        """A stream-capped tier's recent read time per byte (moving average): a read the device or a kernel
        throttle already holds back is not slowed a second time by the stream cap (`_emulated_end`)."""
        if op.tier in self._stream_bps and op.nbytes > 0 and op.cls != IOClass.WRITEBACK:
            prev = self._read_s_per_byte.get(op.tier)
            now = seconds / op.nbytes
            self._read_s_per_byte[op.tier] = now if prev is None else 0.8 * prev + 0.2 * now

    def submit(
        self,
        tier: str,
        cls: IOClass,
        fn: Callable[[], Any],
        nbytes: int = 0,
        dedup: Any = None,
        deadline: float | None = None,
        paced_inside: bool = False,
    ) -> IOTicket:
        """Queue fn; with a dedup key, join an op already queued or running for the same key.

        paced_inside: fn may find nothing to move; it calls `transfer()` around the bytes it does move, and only
        then do the tier's emulated caps apply and do its nbytes count as moved."""
        if dedup is not None and (ticket := self.join(dedup, cls)) is not None:
            return ticket
        dedups = [dedup] if dedup is not None else []
        return self.submit_shared(tier, cls, fn, nbytes, dedups, deadline, paced_inside)[0]

    def join(self, dedup: Any, cls: IOClass) -> IOTicket | None:
        """A ticket on the op queued or running under dedup (lifted to cls if more urgent), or None."""
        with self._cv:
            op = self._inflight.get(dedup)
            if op is None:
                return None
            op.holders += 1
            if cls < op.cls and not op.started:
                self.stats.queued(op.tier, op.cls.label, -1)
                self.stats.queued(op.tier, cls.label, +1)
                op.cls = cls
                op.deadline = None
                heapq.heappush(self._heap, (int(cls), next(self._seq), op))
                self._cv.notify()
            return IOTicket(self, op)

    def submit_shared(
        self,
        tier: str,
        cls: IOClass,
        fn: Callable[[], Any],
        nbytes: int,
        dedups: list,
        deadline: float | None = None,
        paced_inside: bool = False,
    ) -> list[IOTicket]:
        """Queue one op that serves several dedup keys (e.g. a batched read); one ticket per key (at least one).
        Callers join first: a key already in flight is not registered again."""
        with self._cv:
            if self._closed:
                raise RuntimeError("I/O engine is closed")
            op = _Op(tier, cls, fn, nbytes, tuple(dedups), deadline, paced_inside)
            op.holders = max(1, len(dedups))
            for key in dedups:
                self._inflight.setdefault(key, op)
            heapq.heappush(self._heap, (int(cls), next(self._seq), op))
            self.stats.queued(tier, cls.label, +1)
            self._cv.notify()
            return [IOTicket(self, op) for _ in range(op.holders)]

    def _release(self, op: _Op) -> bool:
        with self._cv:
            op.holders -= 1
            if op.holders > 0 or op.started or op.future.done():
                return False
            self._drop(op, "cancelled")
            return True

    def _drop(self, op: _Op, reason: str) -> None:
        """Remove a not-started op (lazy deletion from the heap). Caller holds the lock."""
        op.started = True  # any stale heap entries are skipped
        self._forget(op)
        self.stats.dropped(op.tier, op.cls.label, reason)
        op.future.cancel()
        op.future.set_running_or_notify_cancel()

    def _forget(self, op: _Op) -> None:
        """Unregister an op's dedup keys. Caller holds the lock."""
        for key in op.dedup:
            if self._inflight.get(key) is op:
                del self._inflight[key]

    def _next(self) -> _Op | None:
        with self._cv:
            while True:
                while self._heap:
                    cls, _, op = heapq.heappop(self._heap)
                    if op.started or cls != op.cls:
                        continue  # stale entry: re-prioritised, cancelled or already taken
                    if op.deadline is not None and time.monotonic() > op.deadline:
                        self._drop(op, "expired")
                        continue
                    op.started = True
                    self.stats.started(op.tier, op.cls.label)
                    return op
                if self._closed:
                    return None
                self._cv.wait()

    def _worker(self) -> None:
        pin_thread(self._cpus)
        while (op := self._next()) is not None:
            if not op.future.set_running_or_notify_cancel():
                continue
            t0 = time.monotonic()
            self._running.op = op
            try:
                if op.paced_inside:
                    result = op.fn()
                else:
                    with self._paced(op):
                        result = op.fn()
            except BaseException as err:  # delivered to every waiter through the future
                self._finish(op, t0, ok=False)
                op.future.set_exception(err)
            else:
                self._finish(op, t0, ok=True)
                op.future.set_result(result)
            finally:
                self._running.op = None

    @contextlib.contextmanager
    def _paced(self, op: _Op) -> Iterator[None]:
        """Around op's real transfer: the emulated transfer first (the bytes appear when it would end), then the
        transfer itself, timed for `_learn_read_time`."""
        end = self._emulated_end(op, time.monotonic())
        if end is not None:
            wait_until(end)
        t = time.monotonic()
        yield
        self._learn_read_time(op, time.monotonic() - t)
        op.moved = True

    @contextlib.contextmanager
    def transfer(self) -> Iterator[None]:
        """What a `paced_inside` op runs its real transfer in (outside an op, or in any other op: nothing)."""
        op = getattr(self._running, "op", None)
        if op is None or not op.paced_inside:
            yield
            return
        with self._paced(op):
            yield

    def _finish(self, op: _Op, t0: float, ok: bool) -> None:
        with self._cv:
            self._forget(op)
        if ok and not op.moved:  # a paced_inside op that found nothing to move (another reader moved it)
            self.stats.joined(op.tier, op.cls.label)
        else:
            self.stats.finished(op.tier, op.cls.label, op.nbytes, time.monotonic() - t0, ok)

    def pending(self, tier: str | None = None) -> int:
        """Ops queued or running (for one tier or all)."""
        if tier is not None:
            return self.stats.queue_depth(tier)
        with self._cv:
            return sum(1 for _, _, op in self._heap if not op.started) + len(self._inflight)

    def close(self, wait: bool = True) -> None:
        """Stop accepting ops; run what is queued (wait=True) or cancel it."""
        with self._cv:
            self._closed = True
            if not wait:
                for _, _, op in self._heap:
                    if not op.started:
                        self._drop(op, "cancelled")
            self._cv.notify_all()
        for t in self._threads:
            t.join()


__all__ = ["CancelledError", "IOClass", "IOEngine", "IOTicket"]
