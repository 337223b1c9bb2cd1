"""A fake `SchedulerStore` for the scheduler side's tests (`test_store_api.py` checks that it is one): chunks
in the tiers the test puts them in, and reads into DRAM that finish when the test says so (a real store's reads
finish when its disk says so, which a test of the scheduler's decisions cannot wait on deterministically)."""

from __future__ import annotations

from collections.abc import Callable, Sequence

from kvprefetch.store import LookupResult, Tier


class FakeHandle:
    """`PrefetchHandle`'s API over reads that finish when the test says so."""

    def __init__(self, reads: Sequence[bytes]):
        self.reads = list(reads)
        self.finished = False
        self.landed: list[bytes] = []
        self.cancelled: list[bytes] = []  # keys asked to be dropped (`cancel`), in order
        self.callbacks: list[Callable[[bytes, bool], None]] = []

    @property
    def num_reads(self) -> int:
        return len(self.reads)

    def pending(self) -> int:
        return 0 if self.finished else len(self.reads) - len(self.landed)

    def cancel(self, keys: Sequence[bytes] | None = None) -> int:
        dropped = [k for k in (self.reads if keys is None else keys) if k in self.reads]
        if self.finished:
            return 0
        self.cancelled += dropped
        return len(dropped)

    def on_ready(self, callback: Callable[[bytes, bool], None]) -> None:
        self.callbacks.append(callback)

    def land(self, key: bytes) -> None:
        """One read finishes (as an I/O thread reports it)."""
        self.landed.append(key)
        for callback in self.callbacks:
            callback(key, True)

    def wait(self, timeout: float | None = None) -> bool:
        return self.finished


class FakeStore:
    """Chunks in the tiers the test puts them in (``tiers[key] = "dram" | "disk"``); every read started is kept
    in ``handles``, every pin in ``pins``."""

    def __init__(self) -> None:
        self.tiers: dict[bytes, str] = {}
        self.handles: list[FakeHandle] = []
        self.pins: list[bytes] = []

    def lookup(self, keys: Sequence[bytes]) -> LookupResult:
        out = []
        for k in keys:
            if k not in self.tiers:
                break
            out.append(Tier(self.tiers[k]))
        return LookupResult(out)

    def prefetch(self, keys: Sequence[bytes]) -> FakeHandle:
        h = FakeHandle([k for k in keys if self.tiers.get(k) == "disk"])
        self.handles.append(h)
        return h

    def measure_reads(self, keys: Sequence[bytes]) -> FakeHandle:
        return self.prefetch(keys)

    def pin(self, keys: Sequence[bytes]) -> list[bool]:
        self.pins += keys
        return [self.tiers.get(k) == "dram" for k in keys]

    def unpin(self, keys: Sequence[bytes]) -> None:
        for k in keys:
            self.pins.remove(k)

    def writing(self, key: bytes) -> bool:
        return False

    def in_dram(self, keys: Sequence[bytes]) -> list[bool]:
        return [self.tiers.get(k) == "dram" for k in keys]

    def residency(self, keys: Sequence[bytes]) -> list[frozenset[str]]:
        return [frozenset({self.tiers[k]}) if k in self.tiers else frozenset() for k in keys]

    def drop_local(self) -> int:
        dropped = [k for k in self.tiers if k not in self.pins]
        for k in dropped:
            del self.tiers[k]
        return len(dropped)
