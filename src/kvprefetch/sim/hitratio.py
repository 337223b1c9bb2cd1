"""Published prefix-cache hit ratios of the Mooncake traces, beside the model that reproduces them.

The model itself (one global LRU pool of blocks, reusable only as a prefix) lives in
`kvprefetch.workload.prefix_cache`, shared with the trace analysis and the bench's replay sampler.
"""

from __future__ import annotations

from pathlib import Path

from kvprefetch.workload.prefix_cache import hit_ratio, hit_ratio_curve

__all__ = ["PUBLISHED_HIT_RATIO", "hit_ratio", "hit_ratio_curve", "published_for"]

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


def published_for(trace: str | Path) -> dict[int | None, float]:
    """Published points for a trace, recognised by its file name (empty if we know none)."""
    return PUBLISHED_HIT_RATIO.get(Path(trace).stem, {})
