"""What a trace offers a prefix cache: its conversations, its ideal hit ratio, how far apart its reuse lies.

A Mooncake trace does not say which requests belong to one conversation; it says which prefix blocks they
share. Requests are linked into one *prefix group* by their leading block ids: equal ids mean an equal prefix,
so two requests can share blocks only if they start alike. Blocks that start very many different prompts
(a system prompt that every conversation carries: a *hub*) are skipped when naming the group, or one shared
system prompt would make the whole trace one group; they stay in every request's blocks, and count as hits.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Sequence
from dataclasses import asdict, dataclass

import numpy as np

from kvprefetch.workload.prefix_cache import hit_ratio_curve, in_arrival_order, prefix_hits
from kvprefetch.workload.request import Request

HUB_FANOUT = 32
"""A block followed by more distinct next blocks than this starts unrelated prompts (a shared system prompt)."""

CAPACITY_SHARES = (0.01, 0.03, 0.1, 0.3, 0.5)
"""Cache sizes the analysis reports, as shares of the trace's distinct blocks (plus unbounded)."""


def hub_blocks(requests: Sequence[Request], fanout: int = HUB_FANOUT) -> frozenset[int]:
    """Prompt heads shared across conversations: blocks that more than `fanout` different next blocks follow,
    and every block before one of them (a block names its whole prefix, so those are shared as widely)."""
    nexts: dict[int, set[int]] = defaultdict(set)
    for r in requests:
        for a, b in zip(r.hash_ids, r.hash_ids[1:], strict=False):
            nexts[a].add(b)
    wide = {a for a, s in nexts.items() if len(s) > fanout}
    hubs = set(wide)
    for r in requests:
        last = max((j for j, b in enumerate(r.hash_ids) if b in wide), default=-1)
        hubs.update(r.hash_ids[: last + 1])
    return frozenset(hubs)


def group_key(ids: Sequence[int], hubs: frozenset[int]) -> int:
    """The block that names a request's prefix group: its first block that is not a hub."""
    return next((b for b in ids if b not in hubs), ids[-1])


def prefix_groups(requests: Sequence[Request], fanout: int = HUB_FANOUT) -> list[list[int]]:
    """Indices into `requests` (taken in the order given), grouped by shared leading blocks; each group in
    order, groups by their first request."""
    hubs = hub_blocks(requests, fanout)
    groups: dict[int, list[int]] = {}
    for i, r in enumerate(requests):
        groups.setdefault(group_key(r.hash_ids, hubs), []).append(i)
    return list(groups.values())


def _spread(values: Sequence[float]) -> dict[str, float]:
    if not values:
        return {"mean": 0.0, "p50": 0.0, "p90": 0.0, "max": 0.0}
    a = np.asarray(values, dtype=float)
    return {"mean": float(a.mean()), "p50": float(np.percentile(a, 50)), "p90": float(np.percentile(a, 90)),
            "max": float(a.max())}  # fmt: skip


@dataclass(frozen=True)
class TraceAnalysis:
    """A trace's shape and reuse. Hit ratios are shares of prompt blocks (the prefix-cache model); a reuse
    distance is how far back (in requests, and in seconds) the request that last touched a request's
    longest hit block lies."""

    requests: int
    duration_s: float
    arrival_rate_per_s: float
    input_tokens: dict[str, float]
    output_tokens: dict[str, float]
    blocks: int
    distinct_blocks: int
    hub_blocks: int
    groups: int
    multi_request_groups: int
    requests_in_multi_request_groups: int
    largest_group: int
    group_span_s: dict[str, float]  # first to last request of each multi-request group
    ideal_hit_ratio: float
    hit_ratio_by_capacity: dict[int, float]  # capacity in blocks -> hit ratio (LRU)
    reuse_distance_requests: dict[str, float]
    reuse_distance_s: dict[str, float]

    def to_json(self) -> dict:
        out = asdict(self)
        out["hit_ratio_by_capacity"] = {str(k): v for k, v in self.hit_ratio_by_capacity.items()}
        return out

    def curve(self) -> dict[int | None, float]:
        """Hit ratio by capacity, the unbounded pool under None (the simulator's plot takes this)."""
        return {**self.hit_ratio_by_capacity, None: self.ideal_hit_ratio}

    def lines(self) -> list[str]:
        """A human summary, one fact a line."""
        inp, out = self.input_tokens, self.output_tokens
        caps = ", ".join(f"{c:,} blocks {100 * v:.0f}%" for c, v in self.hit_ratio_by_capacity.items())
        return [
            f"{self.requests:,} requests over {self.duration_s:,.0f} s ({self.arrival_rate_per_s:.2f}/s); input "
            f"tokens mean {inp['mean']:,.0f}, p50 {inp['p50']:,.0f}, p90 {inp['p90']:,.0f}, max {inp['max']:,.0f}; "
            f"output mean {out['mean']:,.0f}, max {out['max']:,.0f}",
            f"{self.groups:,} prefix groups (conversations): {self.multi_request_groups:,} with more than one "
            f"request, holding {self.requests_in_multi_request_groups:,} requests; largest {self.largest_group}; "
            f"median span {self.group_span_s['p50']:,.0f} s; {self.hub_blocks} hub blocks",
            f"ideal prefix hit ratio (unbounded cache): {100 * self.ideal_hit_ratio:.1f}% of "
            f"{self.blocks:,} prompt blocks ({self.distinct_blocks:,} distinct); by LRU cache size: {caps}",
            f"reuse distance: p50 {self.reuse_distance_requests['p50']:,.0f} requests / "
            f"{self.reuse_distance_s['p50']:,.0f} s, p90 {self.reuse_distance_requests['p90']:,.0f} requests / "
            f"{self.reuse_distance_s['p90']:,.0f} s",
        ]


def ideal_hits(requests: Sequence[Request]) -> list[int]:
    """Each request's leading blocks an unbounded prefix cache holds when it arrives (requests in the order
    given, which must be arrival order)."""
    return prefix_hits((r.hash_ids for r in requests), None)


def analyse(requests: Sequence[Request], fanout: int = HUB_FANOUT) -> TraceAnalysis:
    """The analysis of a trace's requests (as `read_mooncake_trace` returns them)."""
    reqs = in_arrival_order(requests)
    if not reqs:
        raise ValueError("the trace holds no requests")
    hits = ideal_hits(reqs)
    last_seen: dict[int, int] = {}
    dist_req: list[float] = []
    dist_s: list[float] = []
    for i, (r, h) in enumerate(zip(reqs, hits, strict=True)):
        if h:
            j = last_seen[r.hash_ids[h - 1]]
            dist_req.append(i - j)
            dist_s.append(r.arrival_s - reqs[j].arrival_s)
        for b in r.hash_ids:
            last_seen[b] = i
    groups = prefix_groups(reqs, fanout)
    multi = [g for g in groups if len(g) > 1]
    distinct = len(last_seen)
    caps = sorted({max(1, round(s * distinct)) for s in CAPACITY_SHARES})
    curve = hit_ratio_curve(reqs, caps)
    duration = reqs[-1].arrival_s - reqs[0].arrival_s
    blocks = sum(len(r.hash_ids) for r in reqs)
    return TraceAnalysis(
        requests=len(reqs),
        duration_s=duration,
        arrival_rate_per_s=(len(reqs) - 1) / duration if duration > 0 else 0.0,
        input_tokens=_spread([r.input_len for r in reqs]),
        output_tokens=_spread([r.output_len for r in reqs]),
        blocks=blocks,
        distinct_blocks=distinct,
        hub_blocks=len(hub_blocks(reqs, fanout)),
        groups=len(groups),
        multi_request_groups=len(multi),
        requests_in_multi_request_groups=sum(map(len, multi)),
        largest_group=max(map(len, groups)),
        group_span_s=_spread([reqs[g[-1]].arrival_s - reqs[g[0]].arrival_s for g in multi]),
        ideal_hit_ratio=sum(hits) / blocks if blocks else 0.0,
        hit_ratio_by_capacity={c: v for c, v in curve.items() if c is not None},
        reuse_distance_requests=_spread(dist_req),
        reuse_distance_s=_spread(dist_s),
    )


