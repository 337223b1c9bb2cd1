"""The engine's block pool: vLLM's prefix cache lives in the free blocks and is evicted oldest-freed first;
the simulator admits requests against it."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvprefetch.sim.block_pool import BlockPool
from kvprefetch.sim.catalog import ACCELERATORS, MODELS
from kvprefetch.sim.costs import Deployment
from kvprefetch.sim.engine import SimConfig, Simulator, StepLoads, simulate
from kvprefetch.sim.policy import Policy
from kvprefetch.sim.tiers import TierSpec
from kvprefetch.workload import ChatWorkload, generate_chat
from kvprefetch.workload.request import Request, TokenRecipe


def test_freed_blocks_stay_cached_until_allocations_reach_them():
    pool = BlockPool(6, 1)
    held = pool.take([1, 2], hits=0, tokens=3)  # a prompt of two full blocks and an output block
    assert held == ([1, 2], 1)
    pool.release(*held)
    assert 1 in pool and 2 in pool and pool.free == 6

    pool.take([], hits=0, tokens=3)  # three never-used blocks are left: nothing cached is evicted
    assert 1 in pool and 2 in pool
    pool.take([], hits=0, tokens=2)  # the empty output block goes first, then the prompt's last block
    assert 1 in pool and 2 not in pool
    assert pool.cached_prefix([1, 2]) == 1


def test_hits_on_free_blocks_are_taken_back_without_evicting():
    pool = BlockPool(4, 1)
    pool.release(*pool.take([1, 2, 3], hits=0, tokens=4))
    assert pool.can_take([1, 2, 3], tokens=4)  # the hits are free blocks: four fit in four
    held = pool.take([1, 2, 3], hits=3, tokens=4)
    assert held == ([1, 2, 3], 1) and pool.free == 0
    assert not pool.can_take([], tokens=1)


def test_blocks_in_use_are_shared_and_outlive_their_first_holder():
    pool = BlockPool(8, 1)
    first = pool.take([1, 2], hits=0, tokens=3)
    assert pool.cached_prefix([1, 2, 9]) == 2  # cached as scheduled: the next request hits them
    assert pool.can_take([1, 2], tokens=3)  # needs one new block only
    second = pool.take([1, 2], hits=2, tokens=3)
    assert pool.free == 8 - 4
    pool.release(*first)
    pool.take([], hits=0, tokens=pool.free)  # every free block taken: 1 and 2 survive, held by the second
    assert 1 in pool and 2 in pool
    pool.release(*second)
    assert 1 in pool and 2 in pool and pool.free == 3


def test_a_duplicate_computed_while_the_first_copy_is_cached_stays_anonymous():
    pool = BlockPool(8, 1)
    a = pool.take([1, 2], hits=0, tokens=2)
    b = pool.take([1, 2], hits=0, tokens=2)  # admitted without hits (looked up before the first existed)
    assert a == ([1, 2], 0) and b == ([], 2)
    pool.release(*a)
    pool.release(*b)
    assert pool.free == 8 and 1 in pool and 2 in pool


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.lists(st.integers(0, 12), max_size=4, unique=True), st.integers(0, 3)), max_size=30))
def test_accounting_holds_under_any_sequence(requests):
    """Whatever is taken and released, blocks held and free add up to the capacity, and the free queue never
    holds more than the free blocks."""
    pool = BlockPool(10, 1)
    running = []
    for prompt, extra in requests:
        hits = pool.cached_prefix(prompt)
        total = len(prompt) + extra
        if pool.can_take(prompt[:hits], total):
            running.append(pool.take(prompt, hits, total))
        elif running:
            pool.release(*running.pop(0))
        assert pool.free + pool.anonymous + len(pool.refs) == pool.capacity
        assert pool.queued == sum(pool.free_queue.values())
        assert 0 <= pool.queued <= pool.free
    for held in running:
        pool.release(*held)
    assert pool.free == pool.capacity and not pool.refs and pool.anonymous == 0


# ---- the simulator with the engine's KV as a block pool ---------------------------------------------------------
DEP = Deployment(MODELS["llama-3-70b"], ACCELERATORS["h100"], tp=4)
RECIPE = TokenRecipe("session", 0, 256)


def _run(requests, kv_blocks: int, concurrency: int):
    cfg = SimConfig(DEP, Policy.RECOMPUTE, concurrency=concurrency, block_tokens=256, hbm_cache_blocks=kv_blocks,
                    engine_block_pool=True)  # fmt: skip
    return simulate(cfg, requests)


def test_a_previous_turn_is_cached_only_while_the_free_blocks_still_hold_it():
    """Session A's second turn comes after B and C ran (each request holds 5 blocks: 4 of prompt, 1 partial).
    C's blocks come from never-used ones first, then from the free queue's head, where A's first turn went
    first, its last block first. So A's second turn hits its whole first turn in a KV of 20 blocks, the first
    two blocks of it in 12 (an LRU cache of 12 blocks would still hold all of it), and nothing in 10."""
    a0 = Request(0.0, 0, 0, 1024, 1, (1, 2, 3, 4), RECIPE)
    a1 = Request(0.0, 0, 1, 1280, 1, (1, 2, 3, 4, 5), RECIPE, think_s=10.0)
    b0 = Request(0.0, 1, 0, 1024, 1, (11, 12, 13, 14), RECIPE)
    c0 = Request(0.0, 2, 0, 1024, 1, (21, 22, 23, 24), RECIPE)
    for kv_blocks, hit in ((20, 1024), (12, 512), (10, 0)):
        res = _run([a0, a1, b0, c0], kv_blocks=kv_blocks, concurrency=2)
        assert res.tokens_from == {"computed": 3 * 1024 + 1280 - hit, "hbm": hit}, kv_blocks


def test_running_requests_share_a_common_prefix_against_the_capacity():
    """Two prompts of four blocks with three in common fit together in eight blocks only because the common
    ones are held once: both get their first token in the same step."""
    x = Request(0.0, 0, 0, 1024, 1, (1, 2, 3, 4), RECIPE)
    y = Request(0.0, 1, 0, 1024, 1, (1, 2, 3, 5), RECIPE)
    shared = _run([x, y], kv_blocks=8, concurrency=2)
    assert shared.first_token[0] == shared.first_token[1]
    assert shared.tokens_from == {"computed": 1024 + 256, "hbm": 768}
    alone = _run([x, Request(0.0, 1, 0, 1024, 1, (6, 7, 8, 9), RECIPE)], kv_blocks=8, concurrency=2)
    assert alone.first_token[0] < alone.first_token[1]  # nothing in common: the second waits for the first


def _as_connector(policy: Policy, reqs: list[Request], preload: dict[str, list[int]], **kw):
    """`reqs` two at a time on a DRAM tier over a 0.5 GB/s disk, loaded as our connector loads
    (`sync_loads_in_step`, every hit loaded), the engine's KV a block pool of 64 blocks; `kw`: more settings."""
    tiers = (TierSpec("dram", None, 8e9), TierSpec("disk", None, 0.5e9, 1e-4))
    cfg = SimConfig(DEP, policy, tiers, concurrency=2, preload=preload, load_vs_recompute=False,
                    hbm_cache_blocks=64, block_tokens=256, engine_block_pool=True, sync_loads_in_step=True,
                    **kw)  # fmt: skip
    return simulate(cfg, reqs)


def _burst(where: tuple[str, ...]):
    """Two requests at once, sharing a 4-block prefix, each with 4 blocks of its own, every block stored in
    `where`; loaded as our connector loads (`sync_loads_in_step`)."""
    x = Request(0.0, 0, 0, 8 * 256 + 10, 2, (1, 2, 3, 4, 5, 6, 7, 8), RECIPE)
    y = Request(0.0, 1, 0, 8 * 256 + 10, 2, (1, 2, 3, 4, 15, 16, 17, 18), RECIPE)
    stored = [b for r in (x, y) for b in r.hash_ids]
    return _as_connector(Policy.ONDEMAND, [x, y], {name: stored for name in where})


def test_loads_from_dram_run_in_the_step_and_are_cached_for_the_burst_at_once():
    """All in DRAM: both are loaded inside one step, so both get their first token at the end of it, and the
    second finds the shared prefix already cached by the first (vLLM caches blocks as it schedules them)."""
    res = _burst(("dram", "disk"))
    assert res.first_token[0] == res.first_token[1]
    assert res.tokens_from == {"computed": 2 * 10, "hbm": 4 * 256, "dram": 12 * 256, "disk": 0}


def test_loads_from_disk_run_beside_the_steps_and_are_cached_once_arrived():
    """On disk only: each request waits for its own reads and prefills as soon as they land, and the second
    loads the shared prefix itself (from DRAM, where the first one's reads put it): the first one's blocks are
    not cached in the engine until its load has arrived."""
    res = _burst(("disk",))
    assert res.first_token[0] < res.first_token[1]
    assert res.tokens_from == {"computed": 2 * 10, "hbm": 0, "dram": 4 * 256, "disk": 12 * 256}


def _late_burst(late_loads: str):
    """Two requests at once, 4 blocks each on disk only, prefetched on arrival: their reads are still running
    when the idle engine's scheduler reaches them."""
    x = Request(0.0, 0, 0, 4 * 256 + 10, 2, (1, 2, 3, 4), RECIPE)
    y = Request(0.0, 1, 0, 4 * 256 + 10, 2, (5, 6, 7, 8), RECIPE)
    return _as_connector(Policy.PREFETCH, [x, y], {"disk": list(range(1, 9))}, late_loads=late_loads)


def test_an_idle_engine_finishes_late_prefetches_in_the_step_under_auto_and_parks_them_under_async():
    """The connector's `load_mode: auto` (`loadplan.finish_in_step`): with nothing running, waiting for the reads
    inside the step costs no other request anything, so both requests are prefilled in one step once both reads
    have landed (as the bench's prefetch c=8 cell's first step does: four requests, their reads finished in
    it). Parked (async), each is prefilled on its own when its load lands."""
    auto, parked = _late_burst("auto"), _late_burst("async")
    assert auto.first_token[0] == auto.first_token[1]
    assert parked.first_token[0] < parked.first_token[1]
    assert auto.steps < parked.steps


def _adding_burst(policy: Policy, add_s: float):
    """Three requests submitted at once, sharing a 4-block prefix in DRAM, each with 4 blocks of its own on a
    disk that reads 4 blocks in 67 ms; the engine takes `add_s` to add each request."""
    reqs = [Request(0.0, s, 0, 8 * 256 + 10, 2, (1, 2, 3, 4, *range(10 * s + 10, 10 * s + 14)), RECIPE)
            for s in range(3)]  # fmt: skip
    tiers = (TierSpec("dram", None, 8e9), TierSpec("disk", None, 5e9))
    preload = {"dram": [1, 2, 3, 4], "disk": [b for r in reqs for b in r.hash_ids]}
    cfg = SimConfig(DEP, policy, tiers, concurrency=3, preload=preload, load_vs_recompute=False,
                    hbm_cache_blocks=64, block_tokens=256, engine_block_pool=True, sync_loads_in_step=True,
                    request_overhead_s=add_s)  # fmt: skip
    return simulate(cfg, reqs)


def test_a_burst_is_reached_once_added_and_a_prefetch_landed_meanwhile_caches_the_shared_prefix():
    """The engine adds requests one at a time between steps, as the bench's in-process vLLM does. Added 40 ms
    apart, the first request's prefetch (67 ms) lands before the third is added: the scheduler then loads it in
    the step and caches the shared prefix, which the other two find in the engine. Their own reads are still
    queued, so they load asynchronously. On demand the reads start only when the scheduler reaches them: all
    three load asynchronously, each its own copy of the prefix, as when the adds take no time."""
    added = _adding_burst(Policy.PREFETCH, 0.04)
    assert added.tokens_from["hbm"] == 2 * 4 * 256
    assert added.first_token.min() >= 3 * 0.04  # nothing is scheduled before the whole burst is added
    assert _adding_burst(Policy.PREFETCH, 0.0).tokens_from["hbm"] == 0
    assert _adding_burst(Policy.ONDEMAND, 0.04).tokens_from["hbm"] == 0


def test_a_run_preloaded_with_another_runs_tiers_starts_where_it_ended():
    """The bench runs its levels one after another on one store: what a level read into DRAM is there for the
    next. `tier_contents` hands a run's tiers on, least recently used first."""
    req = Request(0.0, 0, 0, 4 * 256 + 10, 2, (1, 2, 3, 4), RECIPE)
    tiers = (TierSpec("dram", None, 8e9), TierSpec("disk", None, 0.5e9, 1e-4))

    def run(preload):
        cfg = SimConfig(DEP, Policy.ONDEMAND, tiers, concurrency=1, preload=preload, load_vs_recompute=False,
                        hbm_cache_blocks=64, block_tokens=256, engine_block_pool=True)  # fmt: skip
        sim = Simulator(cfg, [req])
        return sim.run(), sim.tier_contents()

    first, after = run({"disk": [1, 2, 3, 4]})
    assert first.tokens_from["disk"] == 4 * 256 and after == {"dram": [1, 2, 3, 4], "disk": [1, 2, 3, 4]}
    second, _ = run(after)
    assert second.tokens_from["dram"] == 4 * 256 and second.bytes_read["disk"] == 0
    assert second.first_token[0] < first.first_token[0]


@settings(max_examples=40, deadline=None)
@given(st.integers(0, 10_000), st.integers(2, 40), st.sampled_from(list(Policy)), st.booleans())
def test_every_request_is_served_whatever_the_kv_size(seed, kv_blocks, policy, in_step):
    """Small or large KV, any policy: every request runs, and its prompt's tokens come from somewhere once."""
    reqs = generate_chat(ChatWorkload(sessions=5, turns=3, first_user_tokens=1500, concurrency=2, seed=seed))
    tiers = (TierSpec("dram", 20, 100e9), TierSpec("nvme", None, 5e9, 1e-4))
    cfg = SimConfig(DEP, policy, tiers, concurrency=2, hbm_cache_blocks=kv_blocks, engine_block_pool=True,
                    sync_loads_in_step=in_step)  # fmt: skip
    res = simulate(cfg, reqs)
    assert res.requests == len(reqs) and np.all(res.first_token >= res.submit)
    assert sum(res.tokens_from.values()) == sum(r.input_len for r in reqs)


def _copy_beside_decode(step_loads: StepLoads):
    """One request decoding a long answer while another, its KV on disk only, loads beside the steps (parked)."""
    x = Request(0.0, 0, 0, 300, 400, (), RECIPE)
    y = Request(0.0, 1, 0, 4 * 256 + 10, 2, (1, 2, 3, 4), RECIPE)
    return _as_connector(Policy.ONDEMAND, [x, y], {"disk": [1, 2, 3, 4]}, step_loads=step_loads)


def test_a_parked_requests_copy_into_the_engine_takes_the_models_time_on_a_cpu_engine():
    """`StepLoads.SERIAL` (our CPU engine): the copies of a load beside the steps take the model's time as
    in-step ones do, so the decoding request finishes later by that copy's time; with DMA engines
    (`OVERLAPPED`) they cost the batch nothing."""
    serial, overlapped = _copy_beside_decode(StepLoads.SERIAL), _copy_beside_decode(StepLoads.OVERLAPPED)
    copy_s = 4 * 256 * DEP.model.kv_bytes_per_token / (DEP.accelerator.host_link_bw * DEP.tp)
    assert serial.done[0] - overlapped.done[0] == pytest.approx(copy_s, rel=0.02)
