"""Save admission: which requests' chunks are worth saving (``save_policy``, issue 64).

Saving costs every request: its chunks are copied out of the engine's blocks after the forward, put into the DRAM
pool and written back to disk, and that work runs on the cores the engine steps on. It pays only for a chunk that
is read again. With no reuse at all (every prompt new) ``save_policy: all`` wrote every chunk of every request to
DRAM and disk and none was ever read: prefetch ran 6% slower than vLLM alone at TTFT and 8% lower in throughput.

``save_policy: seen`` saves a prefix's chunks from the *second* time its leading chunk is seen (as TinyLFU admits
an item to a cache only once it has been seen before): a prompt nobody sends twice is never saved. Reuse keeps its
hits because a reused prefix is seen again: a chat's turn 2 starts with turn 1's leading chunk (and sessions that
share a system prompt share it from the first), an agent's next call starts with its task. What it costs is the
first reuse of a prefix nobody has seen before: its second request computes it (and saves it), the third hits.

``save_policy: seen`` is the default because it is what removed the cost: with no reuse, prefetch against vLLM
alone at c=8 went from TTFT +17% and throughput -8% (``all``) to a tie (+0%, -3%) in one bench run of three rounds.

``save_policy: probation`` keeps that first reuse: a prefix seen once is put into the DRAM pool only, on probation
(as a segmented LRU's probationary segment), and nothing of it goes to disk (nor to the shared tier); its second
request loads it from DRAM if it is still there, and from its second sighting on a prefix's chunks are written
back as under ``all``. No byte of a prompt nobody sends twice reaches the disk, but its copy out of the engine and
into DRAM remains, and that, not the write-back, is what cost the engine: the same run measured probation at TTFT
+18% and throughput -13% (the Mooncake trace kept all its hits under probation, 95% of them under seen).

Signals that override the sketch (`save_verdict`, strongest first):

* the request's own ``kv_transfer_params``: ``{"save": true|false}`` (or ``{"kvprefetch": {"save": ...}}``);
* a lease on finish (``keep_warm_s`` > 0, the request's or the connector's): the client expects a next turn;
* a warm-up call for the prefix (`SchedulerSide.warm`): it counts as a sighting, so the request it warms for is
  the second;
* a hit: a request whose leading chunk was in the store when it arrived, or that loaded it, is reuse by
  definition (another engine, or an earlier run, saved it: the sketch is this process's own and starts empty).

Invariant: a request's verdict is decided once, the first time it has a whole chunk to save, and never changes:
a request whose early chunks were skipped and later ones saved would leave chunks no lookup reaches (a prefix
lookup stops at its first miss).
"""

from __future__ import annotations

import hashlib
import threading
from collections.abc import Mapping
from typing import Any, Literal

import numpy as np

SavePolicy = Literal["all", "seen", "probation"]
# Why a request's chunks were not saved (`metrics.saves_skipped_counter`): exported as
# ``vllm:kvprefetch_saves_skipped_total{reason}``.
SKIP_REASONS: dict[str, str] = {
    "unseen": "the first time their prefix's leading chunk was seen (a prompt nobody sent before): not saved "
    "(save_policy seen) or kept in DRAM only, not written to disk (probation)",
    "request": 'the request asked not to be saved (kv_transfer_params {"save": false})',
}


class SeenSketch:
    """How often each leading chunk was seen lately: a count-min sketch of small saturating counters.

    ``depth`` rows of ``width`` uint8 counters (256 KiB by default); a key's count is the minimum of its cells, so it
    is never under-counted and over-counted only where every row collides (with the defaults, under 3% of keys
    never seen, at a full window). Updates are conservative (only the cells at the minimum grow), which keeps
    collisions from inflating counts. Every ``window`` sightings all counters are halved (TinyLFU's reset): a
    prefix seen once and not again within about a window is forgotten, so the sketch tracks recent traffic and
    never fills up.

    Fixed-size arrays and nothing else, so that the table can move into the node's shared DRAM pool (every engine
    on the node sharing one); for now each scheduler process has its own (a hit on a prefix another engine saved
    is the cross-engine signal: `save_verdict`). Thread-safe: warm-up calls come on the warm server's thread.
    """

    def __init__(self, width: int = 1 << 16, depth: int = 4, window: int = 1 << 15, max_count: int = 15):
        if width < 1 or not 1 <= depth <= 8 or window < 1 or not 1 <= max_count <= 255:
            raise ValueError("sketch: width >= 1, 1 <= depth <= 8, window >= 1, 1 <= max_count <= 255")
        self.width, self.depth, self.window, self.max_count = width, depth, window, max_count
        self.table = np.zeros((depth, width), np.uint8)
        self.sightings = 0  # since the last halving
        self._lock = threading.Lock()

    def _cells(self, key: bytes) -> list[int]:
        """The key's column in each row: 4-byte slices of the key (chunk keys are uniform hashes already),
        or of its BLAKE2 digest when it is too short to slice."""
        if len(key) < 4 * self.depth:
            key = hashlib.blake2b(key, digest_size=4 * self.depth).digest()
        return [int.from_bytes(key[4 * r : 4 * r + 4], "little") % self.width for r in range(self.depth)]

    def count(self, key: bytes) -> int:
        """Sightings of key lately (an estimate, never lower than the truth within the window)."""
        cells = self._cells(key)
        with self._lock:
            return min(int(self.table[r, c]) for r, c in enumerate(cells))

    def record(self, key: bytes) -> int:
        """Count one sighting of key; returns how often it had been seen before this one."""
        cells = self._cells(key)
        with self._lock:
            before = min(int(self.table[r, c]) for r, c in enumerate(cells))
            if before < self.max_count:
                for r, c in enumerate(cells):
                    if self.table[r, c] == before:
                        self.table[r, c] = before + 1
            self.sightings += 1
            if self.sightings >= self.window:
                self.table >>= 1
                self.sightings = 0
        return before


def save_wish(params: Any) -> bool | None:
    """What the request's ``kv_transfer_params`` ask of its saves: ``{"save": bool}``, or the same inside
    ``{"kvprefetch": {...}}`` (which wins); None when they say nothing (a value that is not a bool is ignored:
    a request is never failed for a hint)."""
    if not isinstance(params, Mapping):
        return None
    own = params.get("kvprefetch")
    for where in (own, params):
        value = where.get("save") if isinstance(where, Mapping) else None
        if isinstance(value, bool):
            return value
    return None


def save_verdict(policy: SavePolicy, wish: bool | None, *, seen_before: bool, leased: bool, hit: bool) -> str | None:
    """Whether a request's chunks are saved: None to save them, else the reason they are not (`SKIP_REASONS`).
    The request's own wish first, then the policy; under ``seen`` and ``probation`` any sign of reuse saves (the
    sketch's earlier sighting or a warm-up, a lease on finish, a hit). (What "unseen" then means is the policy's:
    `dram_only`.)"""
    if wish is not None:
        return None if wish else "request"
    if policy == "all" or seen_before or leased or hit:
        return None
    return "unseen"


def dram_only(policy: SavePolicy, skip: str | None) -> bool:
    """Whether a request whose verdict is `skip` still puts its chunks into DRAM (not written back): a prefix seen
    once, under ``probation``."""
    return policy == "probation" and skip == "unseen"
