"""The one load-or-recompute rule (`kvprefetch.loadplan`): its decisions on chosen costs, and the connector's cost
model feeding it measured rates (a fake clock times the reads). The simulator's use of it, on its own costs:
`test_load_or_recompute.py`."""

from __future__ import annotations

import math

import pytest

from kvprefetch.loadplan import Rates, best_prefix, plan, ready_times
from kvprefetch.vllm.costmodel import CostModel, TierMeter

MIB = 1 << 20
# 10 ms to recompute a chunk, 1 ms to copy one into the engine, 15 ms to read one from disk
RATES = Rates(chunk_bytes=MIB, chunk_tokens=256, disk_bps=MIB / 0.015, copy_bps=MIB / 0.001, prefill_tps=256 / 0.01)


def test_ready_times_serve_disk_chunks_one_after_another_behind_the_queue():
    assert ready_times([False, False], RATES) == pytest.approx([0.001, 0.002])
    assert ready_times([True, True], RATES) == pytest.approx([0.016, 0.031])
    assert ready_times([True], RATES, queue_bytes=2 * MIB) == pytest.approx([0.046])
    assert ready_times([False, True, True], RATES, first=1) == pytest.approx([0.016, 0.031])


def test_an_async_load_costs_at_least_the_step_once_it_reaches_below_dram():
    assert ready_times([False, True, False], RATES, async_s=0.1) == pytest.approx([0.001, 0.1, 0.1])


def test_best_prefix_loads_what_gains_and_a_tie_recomputes():
    assert best_prefix([1.0], [2.0]) == 1
    assert best_prefix([2.0], [1.0]) == 0
    assert best_prefix([1.0], [1.0]) == 0
    assert best_prefix([0.1, 5.0, 5.1], [1.0, 2.0, 3.0]) == 1  # only the head pays: a split
    assert best_prefix([1.0], [1.5], margin=2.0) == 0  # a margin makes loading reluctant


def test_plan_splits_degrades_to_recompute_and_loads_all_before_any_prefill_is_measured():
    p = plan([False, False, True, True], RATES)
    assert (p.load_chunks, p.skipped_slower) == (2, 2) and p.est_load_s == pytest.approx(0.002)
    assert plan([False, True, False, False], RATES).load_chunks == 4  # one slow chunk inside a paying prefix
    assert plan([True, True], RATES, queue_bytes=100 * MIB).load_chunks == 0  # an overloaded tier: recompute
    unmeasured = plan([True, True, True], Rates(MIB, 256, 1.0, 1.0, None))
    assert unmeasured.load_chunks == 3 and math.isnan(unmeasured.est_recompute_s)
    assert plan([True, True], RATES, first=2).load_chunks == 2  # chunks the engine holds cost nothing


def test_the_cost_model_plans_on_the_disk_rate_its_meter_measured():
    """A read burst timed on a fake clock: the meter's bytes over busy seconds become the disk rate, and the
    plan, the shared rule on that rate, flips from recomputing to loading as the disk turns out fast."""
    now = [0.0]
    cm = CostModel(chunk_bytes=MIB, chunk_tokens=256, disk_bps=MIB / 0.1, copy_bps=MIB / 0.001,
                   prefill_tps=256 / 0.01)  # fmt: skip
    meter = TierMeter(cm.observe_disk, sample_ops=4, clock=lambda: now[0])
    assert cm.plan([True, True]).load_chunks == 0  # the prior: 100 ms a chunk, ten times recomputing it
    for _ in range(10):
        meter.started(4)
        for _ in range(4):
            now[0] += 0.001  # 4 chunks in 4 ms: 1 ms a chunk
            meter.completed(True, MIB)
    assert cm.snapshot()["disk_bps"] == pytest.approx(MIB / 0.001, rel=0.05)
    assert cm.rates() == Rates(MIB, 256, cm.disk_bps.value, MIB / 0.001, 256 / 0.01)
    assert cm.plan([True, True]).load_chunks == 2
