"""Why a tier failed, in the few words an operator alerts on: every failure the store meets is counted by the tier
it asked and a kind, and shows as ``vllm:kvprefetch_tier_errors_total{tier, kind}``.

Each failure is still a miss (the request recomputes), so nothing else makes it visible: a damaged disk, a full
one and a shared store that went down all look like a lower hit ratio. The kinds say which it was (the store,
which meets every tier's exceptions, names them: `kvprefetch.store.error_kind`).
"""

from __future__ import annotations

import threading
from collections import Counter
from enum import StrEnum


class ErrorKind(StrEnum):
    CORRUPT = "corrupt"  # failed verification (header, checksum, size): dropped, never served
    MISSING = "missing"  # an index said the chunk was there; it was gone when read (removed behind our back)
    NO_SPACE = "no_space"  # a write found the tier full
    UNAVAILABLE = "unavailable"  # the tier could not be reached (a shared store down or timing out)
    REJECTED = "rejected"  # the shared store is up but refused a write (full, or the object busy)
    IO = "io"  # any other operating-system error


class ErrorTally:
    """Failures per (tier, kind), counted once where they are met; thread-safe, cumulative (readers take deltas)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._counts: Counter[tuple[str, str]] = Counter()

    def add(self, tier: str, kind: ErrorKind, n: int = 1) -> None:
        with self._lock:
            self._counts[(tier, kind.value)] += n

    def totals(self) -> dict[str, int]:
        """{"tier/kind": count} of every pair seen so far."""
        with self._lock:
            return {f"{tier}/{kind}": n for (tier, kind), n in self._counts.items()}
