"""Prefix-cache hit ratio of a trace under one global LRU pool of a given block capacity.

This is the measurement behind Mooncake's Table 1 (arXiv 2407.00079) and the "cache ratio" column of
Table 2 in the FAST'25 paper: blocks are reusable only as a prefix (each hash id covers everything before
it), so a request hits its leading run of cached blocks and stops at the first miss.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from pathlib import Path

from kvprefetch.workload.request import Request

# Published hit ratios by trace file name -> {capacity in blocks (None = unbounded): ratio}.
PUBLISHED_HIT_RATIO: dict[str, dict[int | None, float]] = {
    # FAST'25 paper, Table 2: synthetic trace, 3,993 requests, cache ratio 66% (unbounded cache).
    "synthetic_trace": {None: 0.66},
    # FAST'25 paper, Table 2: conversation trace 40%, tool&agent trace 59% (unbounded cache).
    "conversation_trace": {None: 0.40},
    "toolagent_trace": {None: 0.59},
    # arXiv 2407.00079, Table 1, LRUCache row (the 23,608-request trace, later released as mooncake_trace).
    "mooncake_trace": {None: 0.51, 100000: 0.51, 50000: 0.50, 30000: 0.48, 10000: 0.40, 1000: 0.30},
}


def hit_ratio(requests: Sequence[Request], capacity_blocks: int | None) -> float:
    """Share of prompt blocks served from the pool, replaying `requests` in arrival order."""
    cache: OrderedDict[int, None] = OrderedDict()
    hits = total = 0
    for req in sorted(requests, key=lambda r: r.arrival_s):
        ids = req.hash_ids
        total += len(ids)
        n = 0
        for b in ids:
            if b not in cache:
                break
            cache.move_to_end(b)
            n += 1
        hits += n
        for b in ids[n:]:
            cache[b] = None
        if capacity_blocks is not None:
            while len(cache) > capacity_blocks:
                cache.popitem(last=False)
    return hits / total if total else 0.0


def hit_ratio_curve(requests: Sequence[Request], capacities: Sequence[int | None]) -> dict[int | None, float]:
    return {c: hit_ratio(requests, c) for c in capacities}


def published_for(trace: str | Path) -> dict[int | None, float]:
    """Published points for a trace, recognised by its file name (empty if we know none)."""
    return PUBLISHED_HIT_RATIO.get(Path(trace).stem, {})
