"""A replayable sample of a trace that keeps the trace's reuse: whole conversations, in order, with their past.

The turns of one conversation lie thousands of requests apart in a conversation trace, so a window of a few
dozen consecutive requests holds almost no reuse. The sample therefore takes *whole prefix groups*: from the
point `window_start` of the trace on, every request of a group is measured, in trace order, until each level
has what it needs; a group belongs to one level only, so one level never warms the cache for another. The
*prelude* is what those conversations held before the window: for each measured request, the leading blocks
it shares with its group's earlier requests, so a cache that kept everything would serve each measured
request exactly what the full trace's unbounded cache served it (`ReplaySample.ideal_hit_ratio`).
"""

from __future__ import annotations

import math
import random
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field

from kvprefetch.workload.analysis import HUB_FANOUT, group_key, hub_blocks, ideal_hits
from kvprefetch.workload.prefix_cache import in_arrival_order, prefix_hits
from kvprefetch.workload.request import BLOCK_TOKENS, Request

LOST_REUSE_SHARE = 0.5
"""A sample whose ideal hit ratio is below this share of the full trace's lost most of the trace's reuse."""


def fit_block_tokens(length_scale: float | None, chunk_tokens: int) -> tuple[float, str | None]:
    """The length scale to replay a trace with, so that one trace block is a whole number (>= 1) of chunks.

    A block below one chunk, or straddling two, is no chunk hit even when two requests share it. None picks
    the smallest scale that keeps a block one chunk. A scale whose block is a whole number of tokens but not
    of chunks is corrected up to the next whole number of chunks (the message says so); one whose block is
    not a whole number of tokens is refused (ValueError).
    """
    if chunk_tokens < 1:
        raise ValueError(f"chunk_tokens must be >= 1, got {chunk_tokens}")
    if length_scale is None:
        return chunk_tokens / BLOCK_TOKENS, None
    size = BLOCK_TOKENS * length_scale
    if length_scale <= 0 or abs(size - round(size)) > 1e-9:
        raise ValueError(
            f"length scale {length_scale} makes a {BLOCK_TOKENS}-token trace block {size:g} tokens; it must be a "
            f"whole number of {chunk_tokens}-token chunks, e.g. {chunk_tokens / BLOCK_TOKENS:g} (one chunk a block)"
        )
    block = round(size)
    if block % chunk_tokens == 0:
        return length_scale, None
    fixed = max(1, math.ceil(block / chunk_tokens)) * chunk_tokens
    scale = fixed / BLOCK_TOKENS
    return scale, (
        f"length scale {length_scale:g} makes a trace block {block} tokens, "
        f"{'below one' if block < chunk_tokens else 'not a whole number of'} {chunk_tokens}-token chunk"
        f"{'' if block < chunk_tokens else 's'}: two requests sharing it would hit no chunk; "
        f"replaying with length scale {scale:g} ({fixed}-token blocks) instead"
    )


@dataclass(frozen=True)
class SampleRule:
    """Which conversations a replay measures; declared next to every result that used it.

    `window_start`: where in the trace's time span (0 = first arrival, 1 = last) the measured window opens;
    conversations are taken as their requests arrive from there on. `max_prompt_tokens`: a group any of whose
    (scaled) prompts is longer is left out whole, so the engine can serve every prompt. `hub_fanout`: see
    `analysis.HUB_FANOUT`.
    """

    window_start: float = 0.5
    max_prompt_tokens: int = 2048
    hub_fanout: int = HUB_FANOUT
    strata: int = 8
    seed: int = 0

    def __post_init__(self) -> None:
        if not 0.0 <= self.window_start < 1.0:
            raise ValueError(f"window_start must be in [0, 1), got {self.window_start}")
        if self.max_prompt_tokens < 1:
            raise ValueError(f"max_prompt_tokens must be >= 1, got {self.max_prompt_tokens}")


@dataclass(frozen=True)
class LevelNeed:
    """What one level must measure at least: requests, and prompt tokens (so the engine's KV cannot hold it)."""

    requests: int
    prompt_tokens: int = 0


@dataclass
class ReplaySample:
    """The sample: per level its conversations (each its requests in trace order), and the prelude."""

    prelude: list[Request]
    levels: list[list[list[Request]]]
    window_start_s: float
    full_ideal_hit_ratio: float  # the whole trace, unbounded cache
    ideal_hit_ratio: float  # the measured requests, after the prelude, unbounded cache
    groups_left_out: int  # groups with a prompt over max_prompt_tokens
    declared: dict = field(default_factory=dict)

    def measured(self) -> list[Request]:
        return [r for level in self.levels for conv in level for r in conv]

    def lost_most_reuse(self) -> bool:
        return self.ideal_hit_ratio < LOST_REUSE_SHARE * self.full_ideal_hit_ratio

    def summary(self) -> dict:
        measured = self.measured()
        return {
            "full_trace_ideal_hit_ratio": self.full_ideal_hit_ratio,
            "sample_ideal_hit_ratio": self.ideal_hit_ratio,
            "sample_lost_most_reuse": self.lost_most_reuse(),
            "window_start_s": self.window_start_s,
            "conversations": sum(len(level) for level in self.levels),
            "measured_requests": len(measured),
            "prelude_prompts": len(self.prelude),
            "groups_left_out_too_long": self.groups_left_out,
            **self.declared,
        }


def _prelude(history: list[Request], measured: list[Request]) -> list[Request]:
    """The prefixes of a group's history its measured requests reuse: each measured request's leading run of
    blocks the history holds, keeping only runs that no other run extends."""
    held = {b for r in history for b in r.hash_ids}
    runs: dict[tuple[int, ...], Request] = {}
    for r in measured:
        n = 0
        while n < len(r.hash_ids) and r.hash_ids[n] in held:
            n += 1
        if n:
            runs.setdefault(r.hash_ids[:n], r)
    keep = [ids for ids in runs if not any(len(o) > len(ids) and o[: len(ids)] == ids for o in runs)]
    out = []
    for ids in keep:
        r = runs[ids]
        size = r.recipe.block_tokens
        out.append(Request(0.0, r.session_id, 0, min(len(ids) * size, r.input_len), 1, ids, r.recipe))
    return out


def replay_ideal_hit_ratio(prelude: Sequence[Request], measured: Sequence[Request]) -> float:
    """Share of the measured requests' blocks an unbounded cache serves, the prelude replayed first."""
    hits = prefix_hits([r.hash_ids for r in [*prelude, *measured]], None)[len(prelude) :]
    blocks = sum(len(r.hash_ids) for r in measured)
    return sum(hits) / blocks if blocks else 0.0


def _stratified_order(groups: dict[int, list[Request]], hits: dict[int, int], rule: SampleRule) -> list[int]:
    """The order groups are drawn in: stratified by reuse, allocated by blocks.

    Groups sorted by their own ideal hit ratio in the window are cut into `rule.strata` strata of about equal
    blocks, each shuffled (seeded); the next group always comes from the stratum that has given the fewest
    blocks so far. Any first n groups then hold about as many blocks of each level of reuse as the window
    does, so a small sample keeps the window's ideal hit ratio instead of leaving it to a few long groups.
    """

    def blocks(k: int) -> int:
        return sum(len(r.hash_ids) for r in groups[k])

    def ratio(k: int) -> float:
        return sum(hits[id(r)] for r in groups[k]) / blocks(k)

    ranked = sorted(groups, key=lambda k: (ratio(k), k))
    total = sum(map(blocks, ranked))
    n = max(1, min(rule.strata, len(ranked)))
    strata: list[list[int]] = [[] for _ in range(n)]
    seen = 0
    for k in ranked:
        strata[min(n - 1, seen * n // total)].append(k)
        seen += blocks(k)
    rng = random.Random(rule.seed)
    for st in strata:
        rng.shuffle(st)
    drawn = [0] * n
    order: list[int] = []
    while any(strata):
        i = min((i for i in range(n) if strata[i]), key=lambda i: (drawn[i], i))
        k = strata[i].pop()
        drawn[i] += blocks(k)
        order.append(k)
    return order


def sample_conversations(requests: Sequence[Request], needs: Sequence[LevelNeed], rule: SampleRule) -> ReplaySample:
    """Fill each level, in order, with whole conversations from the window on (see the module docstring).

    The groups with a request in the window (from `rule.window_start` to the trace's end) are drawn in a
    random order seeded by `rule.seed`; each goes, with all its requests in the window, to the first level
    that still needs requests or tokens, until every level has what it needs. Groups with a prompt longer
    than `rule.max_prompt_tokens` are left out whole. Drawing across the whole window, not a run of
    consecutive requests, keeps the sample's reuse close to the window's: neighbouring requests in a trace
    are often alike (one dataset, one burst of first turns).
    """
    reqs = in_arrival_order(requests)
    if not reqs:
        raise ValueError("the trace holds no requests")
    hubs = hub_blocks(reqs, rule.hub_fanout)
    keys = [group_key(r.hash_ids, hubs) for r in reqs]
    longest: dict[int, int] = {}
    for k, r in zip(keys, reqs, strict=True):
        longest[k] = max(longest.get(k, 0), r.input_len)
    t0 = reqs[0].arrival_s + rule.window_start * (reqs[-1].arrival_s - reqs[0].arrival_s)
    start = next(i for i, r in enumerate(reqs) if r.arrival_s >= t0)
    in_window: dict[int, list[Request]] = {}
    for k, r in zip(keys[start:], reqs[start:], strict=True):
        if longest[k] <= rule.max_prompt_tokens:
            in_window.setdefault(k, []).append(r)
    order = _stratified_order(in_window, dict(zip(map(id, reqs), ideal_hits(reqs), strict=True)), rule)
    level_of: dict[int, int] = {}
    got = [[0, 0] for _ in needs]  # requests, prompt tokens

    def short(i: int) -> bool:
        return got[i][0] < needs[i].requests or got[i][1] < needs[i].prompt_tokens

    for k in order:
        lvl = next((i for i in range(len(needs)) if short(i)), None)
        if lvl is None:
            break
        level_of[k] = lvl
        got[lvl][0] += len(in_window[k])
        got[lvl][1] += sum(r.input_len for r in in_window[k])
    if any(short(i) for i in range(len(needs))):
        raise ValueError(
            f"the trace's window (from {100 * rule.window_start:.0f}% of its time on) holds too few "
            f"conversations with prompts up to {rule.max_prompt_tokens} tokens for the levels: got "
            f"{[tuple(g) for g in got]} (requests, prompt tokens), needs "
            f"{[(n.requests, n.prompt_tokens) for n in needs]}; start the window earlier, allow longer "
            "prompts or ask for smaller levels"
        )
    # each level's conversations in the order their first measured request arrives (`in_window` keeps it)
    levels: list[dict[int, list[Request]]] = [{} for _ in needs]
    for k, conv in in_window.items():
        if k in level_of:
            levels[level_of[k]][k] = conv
    history: dict[int, list[Request]] = {}
    for k, r in zip(keys[:start], reqs[:start], strict=True):
        if k in level_of:
            history.setdefault(k, []).append(r)
    prelude = [p for level in levels for k, conv in level.items() for p in _prelude(history.get(k, []), conv)]
    measured = [r for level in levels for conv in level.values() for r in conv]
    blocks = sum(len(r.hash_ids) for r in reqs)
    return ReplaySample(
        prelude=prelude,
        levels=[list(level.values()) for level in levels],
        window_start_s=t0 - reqs[0].arrival_s,
        full_ideal_hit_ratio=sum(ideal_hits(reqs)) / blocks if blocks else 0.0,
        ideal_hit_ratio=replay_ideal_hit_ratio(prelude, measured),
        groups_left_out=sum(1 for v in longest.values() if v > rule.max_prompt_tokens),
        declared={
            "rule": "whole prefix groups with a request in the window, drawn stratified by reuse (seeded), "
            "each to one level, replayed in trace order",
            **asdict(rule),
        },
    )


def spaced_order(conversations: Sequence[Sequence[Request]], min_gap: int) -> list[Request]:
    """A level's requests one after another for a replay without timestamps, each conversation's in trace
    order: next goes the conversation that has the most requests left among those whose previous request lies
    at least `min_gap` prompt tokens of other requests back (ties: trace order), so long conversations
    spread over the whole level; when none can go, the earliest waiting request goes anyway.

    In the trace, minutes of everybody else's traffic pass between two turns of a conversation, so the
    engine's own KV cache has long moved on and the tiers serve the reuse; replayed back to back, the
    engine would still hold the previous turn and every mode would measure the same thing.
    """
    pending = sorted((r for conv in conversations for r in conv), key=lambda r: r.arrival_s)
    conv_of = {id(r): i for i, conv in enumerate(conversations) for r in conv}
    placed_at: dict[int, int] = {}  # conversation -> prompt tokens placed when its last request was
    left = [len(conv) for conv in conversations]
    out: list[Request] = []
    tokens = 0
    while pending:
        heads: dict[int, int] = {}  # conversation -> index in pending of its next request
        for j, r in enumerate(pending):
            heads.setdefault(conv_of[id(r)], j)
        ready = [(-left[c], j) for c, j in heads.items() if tokens - placed_at.get(c, -min_gap) >= min_gap]
        r = pending.pop(min(ready)[1] if ready else min(heads.values()))
        left[conv_of[id(r)]] -= 1
        tokens += r.input_len
        placed_at[conv_of[id(r)]] = tokens
        out.append(r)
    return out


def utilisation_time_factor(span_s: float, work_s: float, target: float) -> float | None:
    """The factor on a level's trace times that loads the engine to `target`: its work (seconds of engine
    time) over the compressed span. None when the level has no span to scale (one arrival)."""
    if target <= 0.0:
        raise ValueError(f"utilisation target must be > 0, got {target}")
    if span_s <= 0 or work_s <= 0:
        return None
    return work_s / (target * span_s)
