"""Leases: chunks kept in the node's DRAM tier for a while because a request is expected to need them soon.

Prefetch on arrival hides storage only behind a queue. In agents and multi-turn chat the next turn's head is
known earlier: it is the previous turn's prompt + answer, and the gap (a tool call, a person typing) is time in
which the cache would otherwise evict it under plain LRU. A lease pins such chunks in DRAM for ``ttl_s``:

* **on finish** (``keep_warm_s``, per request through ``kv_transfer_params``): a finished request's chunks, no
  client change;
* **on a warm-up call** (`SchedulerSide.warm`, served as ``POST /v1/kvprefetch/warm`` by `warm_api`): the chunks
  of a prefix the client names in its own terms; their reads below DRAM start at prefetch priority and each
  chunk is pinned as it lands.

Invariants:
* *Budget*: the chunks (keys: one per rank) pinned or still to be pinned for leases never exceed ``budget``
  (a share of the DRAM tier: leases must not flush the cache they mean to keep). A new lease makes room by
  ending the oldest ones; one larger than the whole budget keeps its leading chunks (a prefix is what a next
  turn can use).
* *Ends*: a lease ends at its expiry, when a request that will load all of its chunks holds them itself (the
  next turn arrived: `release_within`), or when asked (``DELETE``); ending unpins exactly what it pinned.
* *Pins are this process's*: a lease dies with the scheduler process, like every pin in the pool.

Thread-safety: one lock; reads land on I/O threads, warm-up calls come on the warm server's thread, the rest
on the scheduler's.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from kvprefetch.vllm.store_api import ReadHandle, SchedulerStore


@dataclass
class Lease:
    lease_id: str
    origin: str  # "finish" | "warm"
    keys: list[bytes]  # every rank's keys, chunk by chunk (as `_Req.flat_keys`)
    granted_at: float
    expires_at: float
    pinned: set[bytes] = field(default_factory=set)
    reads: ReadHandle | None = None  # a warm-up's reads into DRAM

    def remaining_s(self, now: float) -> float:
        return max(0.0, self.expires_at - now)


class Leases:
    """Every lease of this scheduler, under one DRAM budget (in keys: one DRAM slot each)."""

    def __init__(
        self,
        store: SchedulerStore,
        budget: int,
        count: Callable[[str, int], None] = lambda _name, _n: None,
        clock: Callable[[], float] = time.monotonic,
    ):
        """``count(name, n)``: the connector's counters (`metrics.COUNTERS`: leases_granted / _used / _expired /
        _evicted, lease_pinned_chunks and lease_unpinned_chunks, whose difference is what leases hold now)."""
        self.store = store
        self.budget = budget
        self.count = count
        self.clock = clock
        self._by_id: dict[str, Lease] = {}  # in grant order: the oldest first
        self._lock = threading.Lock()

    # ---- queries --------------------------------------------------------------------------------------------
    @property
    def reserved(self) -> int:
        """Keys leases hold or will hold once their reads and saves land (what the budget bounds)."""
        with self._lock:
            return sum(len(lease.keys) for lease in self._by_id.values())

    @property
    def pinned(self) -> int:
        with self._lock:
            return sum(len(lease.pinned) for lease in self._by_id.values())

    def get(self, lease_id: str) -> Lease | None:
        with self._lock:
            return self._by_id.get(lease_id)

    def snapshot(self) -> dict[str, int]:
        with self._lock:
            leases = list(self._by_id.values())
        return {
            "leases": len(leases),
            "lease_chunks_reserved": sum(len(x.keys) for x in leases),
            "lease_chunks_pinned": sum(len(x.pinned) for x in leases),
            "lease_budget_chunks": self.budget,
        }

    def describe(self) -> list[dict[str, object]]:
        """Every lease now, oldest first (for `kvprefetch status`): id, origin, keys reserved and pinned, seconds
        left."""
        now = self.clock()
        with self._lock:
            leases = list(self._by_id.values())
        return [{"id": x.lease_id, "origin": x.origin, "keys": len(x.keys), "pinned": len(x.pinned),
                 "remaining_s": round(x.remaining_s(now), 3)} for x in leases]  # fmt: skip

    # ---- granting ---------------------------------------------------------------------------------------------
    def grant(self, lease_id: str, origin: str, keys: Sequence[bytes], ttl_s: float, keys_per_chunk: int) -> Lease:
        """A lease on keys for ttl_s (replacing one of the same id): pins what is in DRAM now; `pin_landed` and
        `retry_pins` pin the rest as it arrives. Cut to the budget in whole chunks."""
        fit = min(len(keys), self.budget // max(keys_per_chunk, 1) * keys_per_chunk)
        keys = list(dict.fromkeys(keys[:fit]))
        self.end(lease_id)
        now = self.clock()
        lease = Lease(lease_id, origin, keys, now, now + ttl_s)
        evicted = self._make_room(len(keys))
        with self._lock:
            self._by_id[lease_id] = lease
        self.count("leases_granted", 1)
        self.count("leases_evicted", evicted)
        self.retry_pins([lease])
        return lease

    def _make_room(self, need: int) -> int:
        """End the oldest leases until `need` more keys fit the budget; how many ended."""
        victims: list[Lease] = []
        with self._lock:
            held = sum(len(x.keys) for x in self._by_id.values())
            for lease in list(self._by_id.values()):
                if held + need <= self.budget:
                    break
                victims.append(self._by_id.pop(lease.lease_id))
                held -= len(lease.keys)
        for lease in victims:
            self._unpin(lease)
        return len(victims)

    def pin_landed(self, lease: Lease, key: bytes) -> None:
        """A read for the lease put key in DRAM: pin it, if the lease is still on."""
        self.retry_pins([lease], only={key})

    def retry_pins(self, leases: Sequence[Lease] | None = None, only: set[bytes] | None = None) -> int:
        """Pin the keys of live leases that are in DRAM now and not pinned yet (saves that landed since); how
        many were pinned."""
        with self._lock:
            todo = [
                (lease, [k for k in lease.keys if k not in lease.pinned and (only is None or k in only)])
                for lease in (self._by_id.values() if leases is None else leases)
                if self._by_id.get(lease.lease_id) is lease
            ]
            n = 0
            for lease, keys in todo:
                for key, ok in zip(keys, self.store.pin(keys), strict=True):
                    if ok:
                        lease.pinned.add(key)
                        n += 1
        self.count("lease_pinned_chunks", n)
        return n

    # ---- ending -------------------------------------------------------------------------------------------
    def end(self, lease_id: str) -> bool:
        with self._lock:
            lease = self._by_id.pop(lease_id, None)
        if lease is None:
            return False
        self._unpin(lease)
        return True

    def expire(self) -> int:
        now = self.clock()
        return self._end_where(lambda x: x.expires_at <= now, "leases_expired")

    def release_within(self, keys: set[bytes]) -> int:
        """A request that will load keys holds them itself now: the leases all of whose keys it covers have done
        their job (the next turn arrived) and end early."""
        return self._end_where(lambda x: bool(x.keys) and set(x.keys) <= keys, "leases_used")

    def _end_where(self, ends: Callable[[Lease], bool], counter: str) -> int:
        with self._lock:
            gone = [x for x in self._by_id.values() if ends(x)]
            for lease in gone:
                del self._by_id[lease.lease_id]
        self.count(counter, len(gone))
        for lease in gone:
            self._unpin(lease)
        return len(gone)

    def close(self) -> int:
        """End every lease (unpinning what each holds); how many there were."""
        with self._lock:
            leases, self._by_id = list(self._by_id.values()), {}
        for lease in leases:
            self._unpin(lease)
        return len(leases)

    def _unpin(self, lease: Lease) -> None:
        if lease.reads is not None:
            lease.reads.cancel()
        with self._lock:
            keys, lease.pinned = list(lease.pinned), set()
        self.store.unpin(keys)
        self.count("lease_unpinned_chunks", len(keys))
