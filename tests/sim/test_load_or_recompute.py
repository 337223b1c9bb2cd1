"""The load-or-recompute rule as the connector applies it: when the scheduler reaches a request, its load counts the
reads queued ahead of it (a prefetch in flight: what it has left), against recomputing on an idle engine; the
reads of a request it recomputes are cancelled."""

from __future__ import annotations

import numpy as np
import pytest

from kvprefetch.sim.catalog import ACCELERATORS, MODELS
from kvprefetch.sim.costs import Deployment
from kvprefetch.sim.engine import SimConfig, simulate
from kvprefetch.sim.freeform import Load, Setup, run_setup
from kvprefetch.sim.policy import Policy
from kvprefetch.sim.scenarios import context_requests
from kvprefetch.sim.tiers import Pipe, TierSpec

MODEL = MODELS["qwen3-coder-480b-fp8"]
CONTEXT = 16384  # 4.16 GB of the 480B's KV; recomputing it alone takes 5.66 s at 5% of peak
REQUEST_BYTES = CONTEXT * MODEL.kv_bytes_per_token


def _burst(policy: Policy, bw: float, rule: bool = True):
    """Four cold requests at once on 8x MI308X (5% of peak), their contexts on one storage tier of `bw`."""
    dep = Deployment(MODEL, ACCELERATORS["mi308x"], tp=8, efficiency=0.05)
    reqs = context_requests(4, CONTEXT, 512, 16)
    stored = [b for r in reqs for b in r.hash_ids[: CONTEXT // 512]]
    tiers = (TierSpec("dram", None, 400e9), TierSpec("nvme", None, bw, 1e-4))
    config = SimConfig(
        dep,
        policy,
        tiers,
        concurrency=4,
        preload={"nvme": stored},
        load_vs_recompute=rule,
        hbm_cache_blocks=0,
    )
    return simulate(config, reqs)


def test_a_cancelled_transfer_moves_the_ones_behind_it_up():
    pipe = Pipe(bw=1.0)
    first, second, third = pipe.reserve(0.0, 2.0), pipe.reserve(0.0, 3.0), pipe.reserve(0.0, 1.0)
    assert pipe.done_at(third) == 6.0
    assert pipe.cancel(second, now=1.0) == 0.0  # not begun: nothing of it is read
    assert pipe.done_at(third) == 3.0 and pipe.free_at == 3.0 and pipe.bytes_moved == 3.0
    assert pipe.cancel(third, now=2.5) == pytest.approx(0.5)  # in flight: what it has read is kept
    assert pipe.free_at == 2.5 and pipe.bytes_moved == pytest.approx(2.5)
    assert pipe.cancel(first, now=9.0) == 2.0  # finished long ago: nothing to cancel


def test_loads_queued_longer_than_recomputing_are_recomputed_and_read_nothing():
    # at 1 GB/s one request's KV takes 4.2 s, two in a row 8.3 s: longer than the 5.7 s a recompute takes
    ruled, always = _burst(Policy.ONDEMAND, 1e9), _burst(Policy.ONDEMAND, 1e9, rule=False)
    assert ruled.tokens_from["nvme"] == 2 * CONTEXT and ruled.bytes_read["nvme"] == 2 * REQUEST_BYTES
    # storage and compute both work: the burst ends sooner than loading everything or recomputing everything
    assert ruled.makespan < 0.8 * always.makespan
    assert ruled.makespan < 0.6 * _burst(Policy.RECOMPUTE, 1e9).makespan


def test_prefetch_read_while_queued_loads_what_storage_alone_could_not_deliver_in_time():
    # at 0.7 GB/s even a lone read (5.9 s) is slower than recomputing: on demand, every request recomputes
    ondemand, prefetch = _burst(Policy.ONDEMAND, 0.7e9), _burst(Policy.PREFETCH, 0.7e9)
    assert ondemand.tokens_from["nvme"] == 0 and ondemand.bytes_read["nvme"] == 0
    # prefetch reads from arrival; the requests the engine reaches after recomputing the first ones find their KV
    # (almost) in DRAM and load it; the reads of the ones it recomputes are cancelled before they start
    assert prefetch.tokens_from["dram"] == 2 * CONTEXT
    assert prefetch.bytes_read["nvme"] == pytest.approx(2 * REQUEST_BYTES)
    assert prefetch.ttft_p(50) < 0.8 * ondemand.ttft_p(50) and prefetch.makespan < 0.6 * ondemand.makespan


@pytest.mark.parametrize("concurrency", [1, 8])
def test_prefetch_where_the_engine_outruns_storage_loads_only_what_queueing_hid(concurrency):
    # 480B at 40% of peak prefills a 16k-token context faster than the array's 3.9 GB/s brings its KV
    res = run_setup(Setup(), Policy.PREFETCH, "context", Load(concurrency=concurrency))
    recompute = run_setup(Setup(), Policy.RECOMPUTE, "context", Load(concurrency=concurrency))
    if concurrency == 1:  # nothing queues: each read is cancelled the moment the request is reached
        assert res.hit_ratio == 0 and res.bytes_read["nvmeof-100gbe-raid0"] == 0
        assert np.array_equal(res.ttft, recompute.ttft)
    else:  # requests waiting for the engine have their KV read meanwhile, and load it
        assert res.hit_ratio > 0.2 and res.output_tok_s > 1.15 * recompute.output_tok_s
