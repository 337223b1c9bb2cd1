"""The bench's default is the whitepaper's R2 in its dimensionless numbers, derived from the simulator's fit."""

from __future__ import annotations

import pytest

from kvprefetch.bench.options import BenchOptions
from kvprefetch.bench.regime import DEFAULT_REGIME, whitepaper_r2
from kvprefetch.workload.replay import CONTEXT, CONTEXT_MAX_NUM_SEQS, chat_workload, reuse_summary


def test_default_regime_is_r2s_derived_r():
    r2 = whitepaper_r2()
    assert pytest.approx(r2.r, abs=0.05) == DEFAULT_REGIME  # a refit of the sim moves the default with it
    assert r2.r_serial == pytest.approx(r2.r * r2.serial_read_bps / r2.read_bps)
    assert "R = 18.2" in r2.sentence() and "98.6%" in r2.sentence()


def test_default_workload_reuses_what_r2_reused_and_queues():
    opts = BenchOptions()
    assert opts.workload.chat is CONTEXT
    assert opts.engine.max_num_seqs == CONTEXT_MAX_NUM_SEQS < min(opts.concurrency[1:])
    w = chat_workload(CONTEXT, opts.concurrency, 1000)
    reuse = reuse_summary(w, 256)
    assert reuse["reusable_share"] == pytest.approx(whitepaper_r2().reused_share, abs=0.01)
    # two requests per client, each its own stored context (nothing shared between requests of a level)
    for c, sessions in w.levels.items():
        assert len(sessions) == 2 * c and all(len(s.turns) == 1 for s in sessions)
    firsts = {tuple(s.turns[0].tokens[:256]) for ss in w.levels.values() for s in ss}
    assert len(firsts) == sum(len(ss) for ss in w.levels.values())


def test_the_emulated_array_needs_parallel_reads_as_r1s_did():
    """One read stream gets 1/streams of a regime's bandwidth: serial reads see R2's serial R (3.4), and the
    parallel modes' reads in flight reach the whole bandwidth, as the whitepaper's parallel reader did."""
    from kvprefetch.bench.regime import stream_bps
    from kvprefetch.sim.scenarios import PARALLEL_READS

    r2 = whitepaper_r2()
    assert r2.streams == pytest.approx(5.23 / 0.98, rel=0.01)
    assert stream_bps(None) is None
    assert DEFAULT_REGIME * stream_bps(1e9) / 1e9 == pytest.approx(r2.r_serial, rel=0.01)
    assert PARALLEL_READS * stream_bps(1e9) >= 1e9
