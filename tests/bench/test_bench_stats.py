"""Statistics of one mode x concurrency cell, the regime arithmetic, and the CLI's argument parsing."""

from __future__ import annotations

import numpy as np
import pytest
import typer
from hypothesis import given, settings
from hypothesis import strategies as st

from kvprefetch.bench.bench_cli import parse_engine_args, parse_list
from kvprefetch.bench.regime import measured_regime, parse_regime, target_bps
from kvprefetch.bench.stats import cell_metrics, percentile, ratio


@settings(max_examples=50, deadline=None)
@given(
    xs=st.lists(st.floats(0, 1e4, allow_nan=False), min_size=1, max_size=50), q=st.sampled_from([0, 50, 90, 99, 100])
)
def test_percentile_matches_numpy(xs, q):
    assert percentile(xs, q) == pytest.approx(float(np.percentile(xs, q)), rel=1e-9, abs=1e-9)


def test_percentile_edges():
    assert percentile([], 50) is None
    assert percentile([3.0], 99) == 3.0
    with pytest.raises(ValueError):
        percentile([1.0], 101)
    assert ratio(1.0, 0) is None and ratio(None, 1.0) is None and ratio(3.0, 2.0) == 1.5


def _rec(arrival, first, times, prompt=1000, cached=600, local=200, ext=400, error=None):
    return {"arrival": arrival, "first_token": first, "itl": list(np.diff(times)), "output_tokens": len(times),
            "prompt_tokens": prompt, "cached_tokens": cached, "cached_local": local, "cached_external": ext,
            "error": error}  # fmt: skip


def test_cell_metrics_from_records_and_counter_deltas():
    recs = [
        _rec(0.0, 0.5, [0.5, 0.6, 0.7]),
        _rec(0.0, 1.5, [1.5, 1.7, 1.9]),
        _rec(1.0, 2.0, [2.0, 2.1, 2.2]),
        _rec(1.0, None, [], error="finish_reason=abort"),
    ]
    before = {
        "counters": {"loaded_chunks": 10, "prefetch_in_time": 1},
        "io": {"disk/prefetch": {"bytes": 100, "ops": 1}},
        "proc": {"read_bytes": 5},
    }
    after = {
        "counters": {"loaded_chunks": 14, "prefetch_in_time": 3, "prefetch_late": 1, "prefetch_cancelled_chunks": 2},
        "io": {"disk/prefetch": {"bytes": 300, "ops": 2}, "disk/demand": {"bytes": 100, "ops": 1},
               "disk/writeback": {"bytes": 1000, "ops": 9}},
        "proc": {"read_bytes": 405},
    }  # fmt: skip
    m = cell_metrics({"records": recs, "wall_s": 4.0, "before": before, "after": after, "errors": []})
    assert m["requests"] == 4 and m["completed"] == 3 and m["errors"] == 1
    assert m["ttft_p50_s"] == pytest.approx(1.0)
    assert m["ttft_p99_s"] == pytest.approx(1.5 - 0.02 * 0.5)
    assert m["itl_p50_s"] == pytest.approx(0.1)
    assert m["output_tok_s"] == pytest.approx(9 / 4.0)
    assert m["requests_per_s"] == pytest.approx(3 / 4.0)
    # 4000 prompt tokens; cached 1800 (600 local, 1200 external); 2 of 4 loaded chunks came from disk
    assert m["hit_ratio"] == pytest.approx(1800 / 4000)
    assert m["share_engine"] == pytest.approx(600 / 4000)
    assert m["share_disk"] == pytest.approx(600 / 4000)
    assert m["share_dram"] == pytest.approx(600 / 4000)
    assert m["share_computed"] == pytest.approx(2200 / 4000)
    total = m["share_engine"] + m["share_dram"] + m["share_disk"] + m["share_computed"]
    assert total == pytest.approx(1.0)
    assert m["bytes_disk_read"] == 300 and m["bytes_disk_written"] == 1000
    assert m["bytes_storage_read_proc"] == 400
    assert (m["prefetch_in_time"], m["prefetch_late"], m["prefetch_wasted_chunks"]) == (2, 1, 2)
    assert m["ttft_samples_s"] == sorted(m["ttft_samples_s"]) and len(m["ttft_samples_s"]) == 3


def test_cell_metrics_without_connector_or_requests():
    m = cell_metrics({"records": [], "wall_s": 0.0})
    assert m["ttft_p50_s"] is None and m["output_tok_s"] is None and m["hit_ratio"] == 0.0
    r = _rec(0.0, 0.3, [0.3], cached=256, local=None, ext=None)
    m = cell_metrics({"records": [r], "wall_s": 1.0, "errors": ["cell timed out after 5s"]})
    assert m["share_engine"] == pytest.approx(256 / 1000) and m["share_disk"] == 0.0
    assert m["errors"] == 1 and m["itl_p50_s"] is None


def test_regime_arithmetic():
    assert parse_regime("native") is None
    assert parse_regime("10") == parse_regime("10x") == 10.0
    for bad in ("0", "-1", "fast"):
        with pytest.raises(ValueError):
            parse_regime(bad)
    # 4 KiB per token, 2000 tokens/s: R=10 needs 10 * 4096 * 2000 B/s
    bps = target_bps(10, 4096, 2000)
    assert bps == 81_920_000
    assert measured_regime(2000, 256, 256 * 4096, bps) == pytest.approx(10.0)


def test_cli_parsers():
    assert parse_engine_args(["max-num-batched-tokens=4096", "enforce_eager=false", "dtype=bfloat16"]) == {
        "max_num_batched_tokens": 4096, "enforce_eager": False, "dtype": "bfloat16"}  # fmt: skip
    with pytest.raises(typer.BadParameter):
        parse_engine_args(["novalue"])
    assert parse_list("1, 4,8") == [1, 4, 8]
    for bad in ("0", "a,b", ""):
        with pytest.raises(typer.BadParameter):
            parse_list(bad)


def test_kernel_throttle_set_and_remove(tmp_path):
    from kvprefetch.bench.regime import block_device_of, make_throttle

    if block_device_of(tmp_path) is None:
        pytest.skip("the temp dir is not on a block device")
    t, why = make_throttle(tmp_path, f"kvb-test-{id(tmp_path):x}")
    if t is None:
        pytest.skip(f"no kernel throttle here: {why}")
    try:
        t.set(12_345_678)
        f = "blkio.throttle.read_bps_device" if t.kind == "cgroup-v1-blkio" else "io.max"
        assert "12345678" in (t.path / f).read_text()
    finally:
        t.remove()
    assert not t.path.exists()
