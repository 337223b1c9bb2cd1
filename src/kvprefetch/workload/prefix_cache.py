"""The prefix-cache hit-ratio model: one global LRU pool of blocks, reusable only as a prefix.

This is the measurement behind Mooncake's Table 1 (arXiv 2407.00079) and the "cache ratio" column of
Table 2 in the FAST'25 paper: each block id covers its block and everything before it, so a prompt hits its
leading run of cached blocks and stops at the first miss. The simulator, the trace analysis, the replay
sampler and the bench's reuse summary all count hits with `prefix_hits`, so their figures agree by
construction.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Hashable, Iterable, Sequence

from kvprefetch.workload.request import Request


def prefix_hits(prompts: Iterable[Sequence[Hashable]], capacity_blocks: int | None = None) -> list[int]:
    """For each prompt (its block ids), in the order given, how many of its leading blocks the pool held.

    Every prompt's blocks enter the pool after it is counted; with `capacity_blocks` the least recently
    used blocks leave once the pool is over capacity (None: an unbounded pool, the ideal).
    """
    cache: OrderedDict[Hashable, None] = OrderedDict()
    out: list[int] = []
    for ids in prompts:
        n = 0
        for b in ids:
            if b not in cache:
                break
            cache.move_to_end(b)
            n += 1
        out.append(n)
        for b in ids[n:]:
            cache[b] = None
        if capacity_blocks is not None:
            while len(cache) > capacity_blocks:
                cache.popitem(last=False)
    return out


def in_arrival_order(requests: Sequence[Request]) -> list[Request]:
    """Requests by arrival time; ties keep their given (trace) order."""
    return sorted(requests, key=lambda r: r.arrival_s)


def hit_ratio(requests: Sequence[Request], capacity_blocks: int | None) -> float:
    """Share of prompt blocks served from the pool, replaying `requests` in arrival order."""
    ordered = in_arrival_order(requests)
    total = sum(len(r.hash_ids) for r in ordered)
    return sum(prefix_hits((r.hash_ids for r in ordered), capacity_blocks)) / total if total else 0.0


def hit_ratio_curve(requests: Sequence[Request], capacities: Sequence[int | None]) -> dict[int | None, float]:
    return {c: hit_ratio(requests, c) for c in capacities}
