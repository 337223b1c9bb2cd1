"""Simulator invariants, validation scenarios and speed."""

from __future__ import annotations

import time
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvprefetch.sim.catalog import ACCELERATORS, MODELS
from kvprefetch.sim.costs import Deployment
from kvprefetch.sim.engine import SimConfig, StepLoads, simulate
from kvprefetch.sim.fit import solve_one
from kvprefetch.sim.freeform import Load, Setup, run_setup
from kvprefetch.sim.hitratio import hit_ratio_curve
from kvprefetch.sim.policy import Policy
from kvprefetch.sim.report import mooncake_rows, whitepaper_rows
from kvprefetch.sim.scenarios import FIT, FITTED_BY, PUBLISHED, context_requests, run_whitepaper
from kvprefetch.sim.tiers import TierSpec
from kvprefetch.workload import ChatWorkload, generate_chat, read_mooncake_trace
from kvprefetch.workload.request import Request, TokenRecipe

TRACE = Path(__file__).resolve().parents[2] / "../shared/data/mooncake/synthetic_trace.jsonl"

# |error %| allowed on every predicted (non-fitted) row. The project goal is 15%; the rows that cannot get
# there carry the reason in their `note` (scenarios.C8_NOTE, GAIN_NOTE) and an honest bound here.
TOLERANCE_PCT = {"mooncake": 5.0, "seed-r1": 15.0, "seed-r2": 15.0, "seed-r2-recompute": 15.0, "seed-r3": 15.0}
ROW_TOLERANCE_PCT = {
    ("seed-r2", "ttft_p50_s ondemand-sync c8"): 20.0,
    ("seed-r2", "ttft_p50_s prefetch c8"): 26.0,
    ("seed-r2", "throughput_gain_pct c16"): 17.0,
}
FITTED_TOLERANCE_PCT = 3.0  # fitted rows must still match after any model change (refit otherwise)


def _context_run(policy: Policy, conc: int, bw: float = 5e9, ctx: int = 16384) -> object:
    dep = Deployment(MODELS["qwen3-coder-480b-fp8"], ACCELERATORS["mi308x"], tp=8, efficiency=0.05)
    reqs = context_requests(3 * conc, ctx, 1024, 64)
    stored = [b for r in reqs for b in r.hash_ids[: ctx // 512]]
    tiers = (TierSpec("dram", None, 400e9), TierSpec("nvme", None, bw, 1e-4))
    cfg = SimConfig(
        dep, policy, tiers, concurrency=conc, preload={"nvme": stored}, load_vs_recompute=False, hbm_cache_blocks=0
    )
    return simulate(cfg, reqs)


@settings(max_examples=8, deadline=None)
@given(conc=st.sampled_from([2, 8, 16]), bw=st.floats(0.5e9, 20e9), factor=st.floats(1.1, 8.0))
def test_more_bandwidth_is_never_slower(conc, bw, factor):
    # Judged on the whole run: in a closed loop, faster clients resubmit sooner, so TTFT alone can rise.
    for policy in (Policy.PREFETCH, Policy.ONDEMAND_SYNC):
        slow, fast = _context_run(policy, conc, bw), _context_run(policy, conc, bw * factor)
        assert fast.makespan <= slow.makespan * 1.01
        assert fast.output_tok_s >= slow.output_tok_s * 0.99


@pytest.mark.parametrize("conc", [1, 4, 16])
@pytest.mark.parametrize("bw", [1e9, 5e9])
def test_prefetch_is_never_slower_than_on_demand(conc, bw):
    # Against sync loading only the whole run is compared: stalled decodes slow sync clients down, which
    # in a closed loop lowers the load on storage and can make its TTFT look better at lower throughput.
    pf = _context_run(Policy.PREFETCH, conc, bw)
    od = _context_run(Policy.ONDEMAND, conc, bw)
    assert pf.ttft_p(50) <= od.ttft_p(50) * 1.01
    for other in (od, _context_run(Policy.ONDEMAND_SYNC, conc, bw)):
        assert pf.makespan <= other.makespan * 1.01


def test_sync_loading_stalls_and_async_does_not():
    assert _context_run(Policy.ONDEMAND_SYNC, 8).stall_s > 0
    assert _context_run(Policy.ONDEMAND, 8).stall_s == 0


SYNC_DEP = Deployment(MODELS["qwen3-coder-480b-fp8"], ACCELERATORS["mi308x"], tp=8, efficiency=0.05)


def _sync_burst(in_step: bool, conc: int = 4, bw: float = 2e9, step_loads: StepLoads = StepLoads.OVERLAPPED):
    """`conc` cold requests arriving at once, their 16k-token contexts on a 2 GB/s tier, sync loading."""
    reqs = context_requests(conc, 16384, 1024, 64)
    stored = [b for r in reqs for b in r.hash_ids[:32]]
    tiers = (TierSpec("dram", None, 400e9), TierSpec("nvme", None, bw, 1e-4))
    cfg = SimConfig(SYNC_DEP, Policy.ONDEMAND_SYNC, tiers, concurrency=conc, preload={"nvme": stored},
                    load_vs_recompute=False, hbm_cache_blocks=0, sync_loads_in_step=in_step,
                    step_loads=step_loads)  # fmt: skip
    return simulate(cfg, reqs), conc * 16384 * SYNC_DEP.model.kv_bytes_per_token / bw


def test_in_step_sync_loads_admit_the_burst_together_and_the_step_waits_for_every_load():
    res, load_all = _sync_burst(True)
    assert np.ptp(res.first_token) == 0  # one step prefills all four
    assert res.first_token.min() >= load_all  # ... and it ended only once all four loads had landed
    assert res.stall_s == pytest.approx(load_all, rel=0.01)
    serial, _ = _sync_burst(False)
    assert len(set(serial.first_token.round(9))) == 4  # the whitepaper's baseline admits them one by one


def test_a_serial_step_takes_its_loads_and_its_compute_an_overlapped_one_the_longer():
    """One request loading 16k tokens of context in the step that prefills its 1024 new ones: on a CPU engine
    (`StepLoads.SERIAL`) the step waits for the copies, then computes; with DMA engines (`OVERLAPPED`) the
    copies run beside the compute."""
    compute = SYNC_DEP.step_time([(16384, 1024)], 0, 0.0)
    overlapped, load = _sync_burst(True, conc=1)
    serial, _ = _sync_burst(True, conc=1, step_loads=StepLoads.SERIAL)
    host = 16384 * SYNC_DEP.model.kv_bytes_per_token / (SYNC_DEP.accelerator.host_link_bw * SYNC_DEP.tp)
    assert load > compute  # so the two differ by the whole compute
    assert overlapped.first_token[0] == pytest.approx(load + host, rel=1e-3)
    assert serial.first_token[0] == pytest.approx(load + host + compute, rel=1e-3)
    assert serial.stall_s == overlapped.stall_s


def test_recompute_does_no_loads():
    res = _context_run(Policy.RECOMPUTE, 8)
    assert all(v == 0 for v in res.bytes_read.values())
    assert set(k for k, v in res.tokens_from.items() if v) <= {"computed", "hbm"}
    assert res.tokens_from["computed"] == res.input_len.sum()


@pytest.mark.parametrize("engine", ["lru", "block-pool", "block-pool-in-step"])
@pytest.mark.parametrize("policy", list(Policy))
def test_requests_are_conserved(policy, engine):
    reqs = generate_chat(ChatWorkload(sessions=6, turns=3, first_user_tokens=3000, concurrency=3, seed=2))
    dep = Deployment(MODELS["llama-3-70b"], ACCELERATORS["h100"], tp=4)
    tiers = (TierSpec("dram", 40, 100e9), TierSpec("nvme", None, 5e9, 1e-4))
    cfg = SimConfig(dep, policy, tiers, concurrency=3, hbm_cache_blocks=8, engine_block_pool=engine != "lru",
                    sync_loads_in_step=engine.endswith("in-step"))  # fmt: skip
    res = simulate(cfg, reqs)
    assert res.requests == len(reqs)
    assert np.all(res.first_token >= res.submit) and np.all(res.done >= res.first_token)
    assert sum(res.tokens_from.values()) == sum(r.input_len for r in reqs)
    assert res.output_len.sum() == sum(r.output_len for r in reqs)


def test_reuse_is_found_across_turns():
    reqs = generate_chat(ChatWorkload(sessions=4, turns=3, concurrency=2, seed=5))
    dep = Deployment(MODELS["llama-3-70b"], ACCELERATORS["h100"], tp=4)
    tiers = (TierSpec("dram", None, 100e9), TierSpec("nvme", None, 5e9, 1e-4))
    res = simulate(
        SimConfig(dep, Policy.PREFETCH, tiers, concurrency=2, hbm_cache_blocks=0, load_vs_recompute=False), reqs
    )
    assert res.hit_ratio > 0.3 and res.tokens_from["dram"] > 0


def test_hit_ratio_grows_with_capacity():
    reqs = generate_chat(ChatWorkload(sessions=20, turns=4, arrival="poisson", seed=3))
    curve = hit_ratio_curve(reqs, [10, 100, 1000, None])
    values = list(curve.values())
    assert values == sorted(values) and values[-1] > values[0]


@pytest.mark.parametrize("scenario", ["seed-r1", "seed-r2", "seed-r2-recompute", "seed-r3"])
def test_whitepaper_scenario_within_documented_tolerance(scenario):
    rows = whitepaper_rows([scenario])
    assert rows and all(np.isfinite(r.simulated) for r in rows)
    for r in rows:
        if r.fitted:
            assert abs(r.error_pct) <= FITTED_TOLERANCE_PCT, r
        else:
            assert abs(r.error_pct) <= ROW_TOLERANCE_PCT.get((r.scenario, r.metric), TOLERANCE_PCT[scenario]), r
        if abs(r.error_pct) > 15.0:
            assert r.note, f"{r.metric}: a row beyond 15% must say why"


def test_each_free_parameter_is_fitted_on_one_row():
    fitted = [(p.scenario, p.metric) for p in PUBLISHED if p.fitted]
    assert sorted(fitted) == sorted(FITTED_BY.values())
    assert len(fitted) == len(set(fitted)) == len(FIT.__dataclass_fields__)


@pytest.mark.parametrize("name", list(FITTED_BY))
def test_frozen_free_parameters_are_what_the_fit_finds(name):
    # `python -m kvprefetch.sim.fit` must reproduce scenarios.FIT: a model change that moves a fitted row
    # needs a refit, not a stale constant (efficiency is frozen to 3 significant digits)
    found = getattr(solve_one(FIT, name), name)
    assert found == pytest.approx(getattr(FIT, name), rel=1e-3)


def test_sync_baseline_queues_in_admission_not_in_decode():
    # the whitepaper's shape: no-prefetch TTFT grows about linearly with concurrency, and is above prefetch
    sync = {c: run_whitepaper(Policy.ONDEMAND_SYNC, c) for c in (8, 32)}
    pf = run_whitepaper(Policy.PREFETCH, 32)
    assert sync[32].ttft_p(50) > 3 * sync[8].ttft_p(50)
    assert sync[32].ttft_p(50) > 1.2 * pf.ttft_p(50)
    decode = sync[32].done - sync[32].first_token
    assert np.median(decode) < 0.5 * sync[32].ttft_p(50)


@pytest.mark.skipif(not TRACE.exists(), reason="Mooncake trace not present")
def test_mooncake_hit_ratio_and_full_trace_speed():
    reqs = read_mooncake_trace(TRACE)
    for r in mooncake_rows(reqs, TRACE.name):
        assert abs(r.error_pct) <= TOLERANCE_PCT["mooncake"], r
    started = time.perf_counter()
    res = run_setup(
        Setup("llama-3-70b", "h200", 8, "local-nvme", 0.4, dram_gb=500), Policy.PREFETCH, f"trace:{TRACE}", Load()
    )
    assert res.requests == 3993
    assert time.perf_counter() - started < 60


def _one_load(policy: Policy, io_cpu_s_per_byte: float):
    """One request whose 8k-token context sits on NVMe, plus 1k new tokens and a 16-token answer."""
    dep = Deployment(MODELS["llama-3-70b"], ACCELERATORS["h100"], tp=4)
    reqs = context_requests(1, 8192, 1024, 16)
    tiers = (TierSpec("dram", None, 100e9), TierSpec("nvme", None, 5e9, 1e-4))
    cfg = SimConfig(
        dep, policy, tiers, preload={"nvme": reqs[0].hash_ids[:16]}, load_vs_recompute=False,
        hbm_cache_blocks=0, io_cpu_s_per_byte=io_cpu_s_per_byte,
    )  # fmt: skip
    return simulate(cfg, reqs), dep.model.kv_bytes_per_token


def test_copies_on_the_compute_cores_delay_the_steps_by_the_bytes_they_move():
    base, kv_per_token = _one_load(Policy.ONDEMAND, 0.0)
    slow, _ = _one_load(Policy.ONDEMAND, 1e-9)
    # the load ran while the engine had nothing else to do: it costs its transfer time, no step time
    assert slow.first_token[0] == pytest.approx(base.first_token[0])
    assert slow.bytes_read == base.bytes_read and base.bytes_read["nvme"] > 0
    # the prompt's two new blocks are saved to DRAM and NVMe; the decode steps after the prefill pay for it
    saved = 2 * 2 * 512 * kv_per_token
    assert slow.done[0] - base.done[0] == pytest.approx(1e-9 * saved)
    # recompute moves nothing, so it is not slowed at all
    assert _one_load(Policy.RECOMPUTE, 1e-9)[0].done[0] == _one_load(Policy.RECOMPUTE, 0.0)[0].done[0]


def test_the_engine_caches_the_previous_turn_to_its_own_block_size():
    # one session of two turns; the second extends the first (1000 tokens: three 256-token blocks and 232 more)
    dep = Deployment(MODELS["llama-3-70b"], ACCELERATORS["h100"], tp=4)
    first = Request(0.0, 0, 0, 1000, 4, (1, 2, 3), TokenRecipe("session", 0, 256))
    second = Request(0.0, 0, 1, 1300, 4, (1, 2, 3, 4, 5), TokenRecipe("session", 0, 256), think_s=0.1)

    def run(engine_block_tokens):
        cfg = SimConfig(dep, Policy.RECOMPUTE, concurrency=1, block_tokens=256,
                        engine_block_tokens=engine_block_tokens)  # fmt: skip
        return simulate(cfg, [first, second])

    blocks, engine = run(None), run(128)
    # whole 256-token blocks only: 768 of the first turn's tokens; to vLLM's 128-token blocks: 896 of them
    assert blocks.tokens_from == {"computed": 1000 + 1300 - 768, "hbm": 768}
    assert engine.tokens_from == {"computed": 1000 + 1300 - 896, "hbm": 896}
    assert engine.ttft[1] < blocks.ttft[1] and engine.ttft[0] == blocks.ttft[0]


def _sessions(policy: Policy, queue_aware: bool):
    """Eight chat sessions in flight, 5 s of thinking between turns; no engine prefix cache, so every turn's history
    comes from the tiers, and a 20-block DRAM tier that holds only a few sessions' history."""
    reqs = generate_chat(ChatWorkload(sessions=16, turns=4, concurrency=8, think_s=5.0, seed=1))
    dep = Deployment(MODELS["llama-3-70b"], ACCELERATORS["h100"], tp=4)
    tiers = (TierSpec("dram", 20, 100e9), TierSpec("nvme", None, 2e9, 1e-4))
    cfg = SimConfig(dep, policy, tiers, concurrency=8, hbm_cache_blocks=0, load_vs_recompute=False,
                    queue_aware_eviction=queue_aware)  # fmt: skip
    return simulate(cfg, reqs)


def test_session_aware_prefetch_moves_the_next_turn_during_the_think_time_if_dram_keeps_it():
    on_arrival, session = _sessions(Policy.PREFETCH, True), _sessions(Policy.SESSION, True)
    # the next turn's history is read while its user thinks: it waits less, and nothing is read twice
    assert session.ttft_p(50) < 0.85 * on_arrival.ttft_p(50)
    assert session.bytes_read["nvme"] <= on_arrival.bytes_read["nvme"]
    # under plain LRU, the other sessions' traffic evicts what was fetched early: read again at admission
    lru_arrival, lru_session = _sessions(Policy.PREFETCH, False), _sessions(Policy.SESSION, False)
    assert lru_session.bytes_read["nvme"] > 1.5 * lru_arrival.bytes_read["nvme"]
    assert lru_session.ttft_p(50) > session.ttft_p(50)
