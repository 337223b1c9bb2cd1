"""What the connector needs of the store: the `TieredStore` methods its two halves call, as Protocols.

vLLM's own offloading connector drives its store through an abstract interface (``OffloadingManager``); ours
is structural (`typing.Protocol`): `TieredStore` implements it without naming it, and so does a test's fake.
Each half depends on the narrowest part it uses:

* `SchedulerStore`: the scheduler side (`SchedulerSide`, `DramHolds`, `Leases`) finds where chunks are, moves
  them up into DRAM and pins them there; it never touches a chunk's bytes.
* `WorkerStore`: the worker side (`Loader`, `Saver`) copies chunk bytes between DRAM and the engine's blocks.
* `ConnectorStore`: both, plus what the connector needs to report on and close the store it opened.

Invariant: these name exactly what the connector calls on a store (``tests/vllm/test_store_api.py`` reads the
connector's source to keep it so), so a method the connector starts to call is added here, where every fake
store has to provide it too.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from concurrent.futures import Future
from contextlib import AbstractContextManager
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

if TYPE_CHECKING:
    from kvprefetch.config import StoreConfig
    from kvprefetch.io.engine import IOEngine
    from kvprefetch.tiers.errors import ErrorTally


@runtime_checkable
class Lookup(Protocol):
    """Where the leading cached chunks of a lookup are (`LookupResult`): ``tiers[i]`` is chunk i's fastest tier
    (a `Tier`, a StrEnum: ``"dram"``, ``"disk"``, ``"remote"``); the first miss ends it."""

    @property
    def tiers(self) -> Sequence[str]: ...


@runtime_checkable
class ReadHandle(Protocol):
    """Reads into DRAM in flight (`PrefetchHandle`): a prefetch, a warm-up's reads, a disk probe."""

    @property
    def num_reads(self) -> int:
        """Chunks it reads from below DRAM (the others were in DRAM already)."""
        ...

    def pending(self) -> int:
        """Reads not finished yet."""
        ...

    def cancel(self, keys: Sequence[bytes] | None = None) -> int:
        """Drop the reads (of keys, default all) not started yet; how many were dropped."""
        ...

    def on_ready(self, callback: Callable[[bytes, bool], None]) -> None:
        """``callback(key, in_dram)`` once per read as it finishes (on an I/O thread)."""
        ...

    def wait(self, timeout: float | None = None) -> bool:
        """Until every read has finished; False on timeout."""
        ...


@runtime_checkable
class SchedulerStore(Protocol):
    """What the scheduler side calls: lookups, reads into DRAM, and pins that keep chunks there."""

    def lookup(self, keys: Sequence[bytes]) -> Lookup: ...

    def in_dram(self, keys: Sequence[bytes]) -> list[bool]: ...

    def residency(self, keys: Sequence[bytes]) -> list[frozenset[str]]:
        """Every tier holding each key now (`Tier` values), asked of the tiers themselves (the KV events)."""
        ...

    def writing(self, key: bytes) -> bool:
        """Whether key is being written into DRAM now, by any process: a miss about to be a hit."""
        ...

    def prefetch(self, keys: Sequence[bytes]) -> ReadHandle:
        """Start reading the keys below DRAM into DRAM (prefetch priority); keys in DRAM need no read."""
        ...

    def measure_reads(self, keys: Sequence[bytes]) -> ReadHandle:
        """Read the keys into scratch memory, not DRAM, only to time the tier they are on."""
        ...

    def pin(self, keys: Sequence[bytes]) -> list[bool]:
        """Keep keys in DRAM until `unpin`; False where a key is not in DRAM."""
        ...

    def unpin(self, keys: Sequence[bytes]) -> None: ...

    def drop_local(self) -> int:
        """Remove what this node's DRAM pool and disk tier hold (pinned chunks stay; the shared tier is left)."""
        ...


@runtime_checkable
class WorkerStore(Protocol):
    """What the worker side calls: chunk bytes in and out, and its config's I/O cores for its threads."""

    config: StoreConfig

    def view(self, keys: Sequence[bytes]) -> AbstractContextManager[Sequence[memoryview]]:
        """Zero-copy views of the leading keys in DRAM, pinned until the block exits."""
        ...

    def get_into(self, keys: Sequence[bytes], buffers: Sequence[Any]) -> int:
        """Copy the leading hits into buffers (reading below DRAM as needed); how many were copied."""
        ...

    def put(self, keys: Sequence[bytes], buffers: Sequence[Any], write_back: bool = True) -> Future[Any]:
        """Store chunks in DRAM now; the future resolves once they are written back (``write_back`` False: DRAM
        only, resolved at once)."""
        ...

    def flush(self, timeout: float | None = None) -> bool:
        """Until every write-back queued so far has finished; False on timeout."""
        ...


@runtime_checkable
class ConnectorStore(SchedulerStore, WorkerStore, Protocol):
    """The store a connector opens (`TieredStore`): both halves' calls, plus its I/O statistics (vLLM's
    metrics, `StatsTracker`), its counters (`Reporter`) and closing it at shutdown."""

    io: IOEngine
    errors: ErrorTally  # failures per (tier, kind), for /metrics

    def stats(self) -> dict[str, Any]: ...

    def close(self) -> None: ...
