"""Cache tiers below HBM: which blocks each holds (LRU, optionally pinning queued requests' blocks) and
a FIFO pipe that turns bytes into arrival times."""

from __future__ import annotations

import math
from collections import OrderedDict, deque
from dataclasses import dataclass, field


@dataclass(frozen=True)
class TierSpec:
    """A tier's capacity (in 512-token-class blocks; None = unbounded), read bandwidth, latency and parallelism.

    `read_bw` is what the tier delivers with enough reads in flight; `parallelism` is how many that takes: one
    read stream alone gets `read_bw / parallelism` (an array of striped drives, a network pool), so a reader
    with fewer streams than that leaves bandwidth unused (`bandwidth`)."""

    name: str
    capacity_blocks: int | None
    read_bw: float
    latency_s: float = 0.0
    parallelism: float = 1.0

    def __post_init__(self) -> None:
        if not self.read_bw > 0:
            raise ValueError(f"tier {self.name!r}: read_bw must be positive, got {self.read_bw}")
        if not self.parallelism >= 1:
            raise ValueError(f"tier {self.name!r}: parallelism must be at least 1 stream, got {self.parallelism}")

    def bandwidth(self, io_depth: int) -> float:
        """Read bandwidth with `io_depth` reads in flight: each stream at `read_bw / parallelism`, the tier's
        total capped at `read_bw`."""
        if io_depth < 1:
            raise ValueError(f"io_depth must be at least 1, got {io_depth}")
        return self.read_bw * min(1.0, io_depth / self.parallelism)


@dataclass(eq=False)
class Transfer:
    """One reservation on a `Pipe`: it moves `nbytes` from `begin` to `end`. A transfer ahead of it that is
    cancelled moves it earlier, so its owner reads `Pipe.done_at` rather than keeping a time."""

    start: float
    nbytes: float
    begin: float
    end: float


@dataclass
class Pipe:
    """A FIFO transfer channel: requests are served one after another at full bandwidth. A reservation not yet
    finished can be cancelled, as the connector cancels the reads of a request it decides to recompute: what has
    not been read yet is dropped, and the transfers behind it move up."""

    bw: float
    latency_s: float = 0.0
    free_at: float = 0.0
    bytes_moved: float = 0.0
    pending: deque[Transfer] = field(default_factory=deque)  # reservations not known to be finished, in order

    def reserve(self, start: float, nbytes: float) -> Transfer:
        """Reserve the channel for `nbytes` from `start` on."""
        while self.pending and self.pending[0].end <= start:  # finished: nothing can move them any more
            self.pending.popleft()
        begin = max(start, self.free_at)
        t = Transfer(start, nbytes, begin, begin + nbytes / self.bw)
        self.free_at = t.end
        self.bytes_moved += nbytes
        self.pending.append(t)
        return t

    def transfer(self, start: float, nbytes: float) -> float:
        """Reserve the channel for `nbytes` from `start` on; returns when the last byte lands."""
        if nbytes <= 0:
            return start
        return self.done_at(self.reserve(start, nbytes))

    def done_at(self, t: Transfer) -> float:
        return t.end + self.latency_s

    def estimate(self, start: float, nbytes: float) -> float:
        """When a transfer would finish, without reserving anything."""
        return max(start, self.free_at) + nbytes / self.bw + self.latency_s

    def cancel(self, t: Transfer, now: float) -> float:
        """Stop `t` at `now`: keep what it has read, drop the rest, move the transfers behind it up. Returns
        the bytes it keeps."""
        while self.pending and self.pending[0].end <= now:
            self.pending.popleft()
        if t not in self.pending:  # finished already
            return t.nbytes
        kept = max(0.0, (now - t.begin) * self.bw)
        self.bytes_moved -= t.nbytes - kept
        queue = list(self.pending)
        i = queue.index(t)
        free = now
        if not kept:  # not begun: gone, and the pipe is free when the transfer before it ends
            del self.pending[i]
            free = max(now, queue[i - 1].end) if i else now
        t.nbytes, t.end = kept, now
        for later in queue[i + 1 :]:
            later.begin = max(later.start, free)
            later.end = later.begin + later.nbytes / self.bw
            free = later.end
        self.free_at = free
        return kept


@dataclass
class BlockCache:
    """LRU set of block ids. Pinned ids (blocks of queued requests) are skipped by eviction."""

    capacity: int | None
    blocks: OrderedDict = field(default_factory=OrderedDict)
    pins: dict[int, int] = field(default_factory=dict)

    def __contains__(self, block: int) -> bool:
        return block in self.blocks

    def discard(self, block: int) -> None:
        """Forget a block that will not arrive after all (its read was cancelled)."""
        self.blocks.pop(block, None)

    def touch(self, block: int) -> None:
        """Mark as just used (re-inserting it if it was evicted since the lookup)."""
        self.insert(block)

    def insert(self, block: int) -> None:
        if block in self.blocks:
            self.blocks.move_to_end(block)
            return
        self.blocks[block] = None
        if self.capacity is not None and len(self.blocks) > self.capacity:
            self._evict_one()

    def room(self) -> float:
        """How many more blocks can come in without evicting a pinned one."""
        if self.capacity is None:
            return math.inf
        return self.capacity - sum(1 for b in self.pins if b in self.blocks)

    def _evict_one(self) -> None:
        for victim in self.blocks:
            if victim not in self.pins:
                del self.blocks[victim]
                return
        self.blocks.popitem(last=True)  # everything pinned: the newcomer stays out, the queue ahead keeps its KV

    def pin(self, blocks) -> None:
        for b in blocks:
            self.pins[b] = self.pins.get(b, 0) + 1

    def unpin(self, blocks) -> None:
        for b in blocks:
            left = self.pins.get(b, 0) - 1
            if left > 0:
                self.pins[b] = left
            else:
                self.pins.pop(b, None)
