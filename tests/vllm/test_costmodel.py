"""`costmodel.py`: the load-or-recompute rule's rates and decisions."""

from __future__ import annotations

import pytest

from kvprefetch.vllm.costmodel import CostModel


def test_cost_model_loads_only_what_pays():
    cm = CostModel(chunk_bytes=100 << 20, chunk_tokens=256, disk_bps=1e9, copy_bps=10e9)
    # Nothing measured yet: load everything.
    assert cm.plan([True, True, False]).load_chunks == 3
    cm.observe_prefill(256, 0.05)  # 5120 tok/s: recomputing a chunk takes 50 ms
    # DRAM chunk: 10 ms to copy -> load. Disk chunk: 110 ms -> recompute.
    p = cm.plan([False, False, True, True])
    assert p.load_chunks == 2 and p.skipped_slower == 2
    # A fast disk makes the disk chunks pay.
    for _ in range(20):
        cm.observe_disk(100 << 20, 0.02)
    assert cm.plan([False, True, True]).load_chunks == 3
    # A long queue in front of the disk makes them not pay again.
    assert cm.plan([False, True, True], queue_bytes=10 << 30).load_chunks == 1
    # Chunks the engine already holds are never counted.
    assert cm.plan([True, True], first=2).load_chunks == 2


def test_cost_model_prefix_rule_can_load_past_one_slow_chunk():
    # 10 ms to recompute a chunk, 1 ms to copy one, 15 ms to read one from disk.
    cm = CostModel(chunk_bytes=1 << 20, chunk_tokens=256, prefill_tps=256 / 0.01, copy_bps=(1 << 20) / 0.001,
                   disk_bps=(1 << 20) / 0.015)
    # One slow chunk followed by DRAM ones still pays as a whole prefix: all four are in after 18 ms < 40 ms.
    assert cm.plan([False, True, False, False]).load_chunks == 4
    # Disk chunks are served one after another (in after 16, 31, 46, 61 ms): no prefix beats recomputing it
    # (10, 20, 30, 40 ms): recompute all.
    assert cm.plan([True, True, True, True]).load_chunks == 0
    # Queued reads in front of the request push its chunks back: the DRAM head still pays, the disk tail not.
    p = cm.plan([False, False, True, True], queue_bytes=10 << 20)
    assert p.load_chunks == 2 and p.skipped_slower == 2
    # An async load waits at least one engine step: with 50 ms steps, reaching the fast disk chunk no longer pays.
    cm.disk_bps.value = 100e9
    assert cm.plan([False, False, True]).load_chunks == 3
    cm.observe_prefill(2, 0.05)  # a decode step: no prefill-speed sample, but a step time
    assert cm.prefill_tps.samples == 0 and cm.step_s.value == 0.05
    assert cm.plan([False, False, True], async_s=cm.expected_step_s(10_000)).load_chunks == 2
    assert cm.plan([False, False, True]).load_chunks == 3  # sync mode: no step to wait for
    assert cm.expected_step_s(0) == 0  # an idle engine: the async load is reported at once


def test_tier_meter_measures_busy_time_not_queueing():
    from concurrent.futures import Future

    from kvprefetch.vllm.costmodel import TierMeter

    now = [0.0]
    samples = []
    m = TierMeter(lambda b, s: samples.append(b / s), sample_ops=2, clock=lambda: now[0])
    futs = [Future() for _ in range(4)]
    m.track(futs, 100)
    assert m.outstanding == 4
    for i, f in enumerate(futs):
        now[0] = 0.1 * (i + 1)  # one read completes every 100 ms: 1000 B/s
        f.set_result(True)
    assert m.outstanding == 0 and samples == pytest.approx([1000, 1000])
    now[0] = 60.0  # idle for a minute: not counted
    f = Future()
    m.track([f], 100)
    now[0] = 60.05
    f.set_result(True)
    assert samples[-1] == pytest.approx(2000)
    g = Future()
    m.track([g], 100)
    g.cancel()  # a dropped read moves no bytes
    assert m.outstanding == 0 and len(samples) == 3


def test_auto_load_mode_reads_in_the_step_only_when_that_costs_the_batch_less():
    """`CostModel.finish_in_step`: reads inside the step stall every running request; parking the request
    costs it at least one step. (The cost model has no clock: its rates are what the test observes.)"""
    cm = CostModel(chunk_bytes=1 << 20, chunk_tokens=256, disk_bps=1e9, copy_bps=10e9)
    cm.observe_disk(100 << 20, 0.1)  # 1.05 GB/s: one chunk in ~1 ms
    one_chunk, many = 1 << 20, 64 << 20  # ~1 ms, ~64 ms of reads
    assert cm.finish_in_step(many, running=0, step_s=0.004)  # idle engine: nobody else waits, never park
    assert cm.finish_in_step(one_chunk, running=3, step_s=0.02)  # 4 x 1 ms < a 20 ms step: read it now
    assert not cm.finish_in_step(many, running=3, step_s=0.02)  # 4 x 64 ms > 64 ms alone: park
    assert not cm.finish_in_step(8 * one_chunk, running=3, step_s=0.0)  # 4 x 8 ms > the 5 ms floor of a step
    assert cm.finish_in_step(one_chunk, running=3, step_s=0.0)  # 4 x 1 ms within the floor
