"""Tier parallelism: storage that needs several reads in flight to reach its bandwidth, and the io depth that
kvprefetch gives it, from the tier's formula through the simulator to `kvprefetch sim`."""

from __future__ import annotations

import json

import numpy as np
import pytest
from tests.clitext import flat
from typer.testing import CliRunner

from kvprefetch.cli import app
from kvprefetch.config import IOConfig
from kvprefetch.sim.catalog import ACCELERATORS, MODELS, STORAGE
from kvprefetch.sim.costs import Deployment
from kvprefetch.sim.engine import SimConfig, simulate
from kvprefetch.sim.policy import Policy
from kvprefetch.sim.scenarios import PARALLEL_READS, R1_IO_DEPTH, context_requests
from kvprefetch.sim.tiers import TierSpec


def test_one_stream_gets_its_share_and_enough_streams_get_the_whole_tier():
    tier = TierSpec("array", None, 6e9, parallelism=3)
    assert tier.bandwidth(1) == pytest.approx(2e9)
    assert tier.bandwidth(2) == pytest.approx(4e9)
    assert tier.bandwidth(3) == tier.bandwidth(64) == pytest.approx(6e9)
    assert TierSpec("ssd", None, 6e9).bandwidth(1) == 6e9  # parallelism 1: today's single FIFO pipe


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [({"parallelism": 0.5}, "parallelism must be at least 1"), ({"read_bw": 0.0}, "read_bw must be positive")],
)
def test_a_tier_that_cannot_exist_is_refused_by_name(kwargs, message):
    args = {"name": "array", "capacity_blocks": None, "read_bw": 6e9} | kwargs
    with pytest.raises(ValueError, match=message):
        TierSpec(**args)
    with pytest.raises(ValueError, match="io_depth must be at least 1"):
        TierSpec("array", None, 6e9).bandwidth(0)


def _run(policy: Policy, tier: TierSpec, io_depth: int, conc: int = 4):
    dep = Deployment(MODELS["qwen3-coder-480b-fp8"], ACCELERATORS["mi308x"], tp=8, efficiency=0.05)
    reqs = context_requests(3 * conc, 16384, 512, 32)
    stored = [b for r in reqs for b in r.hash_ids[: 16384 // 512]]
    cfg = SimConfig(
        dep, policy, (TierSpec("dram", None, 400e9), tier), concurrency=conc, preload={tier.name: stored},
        load_vs_recompute=False, hbm_cache_blocks=0, io_depth=io_depth,
    )  # fmt: skip
    return simulate(cfg, reqs)


@pytest.mark.parametrize("policy", [Policy.PREFETCH, Policy.ONDEMAND, Policy.ONDEMAND_SYNC])
def test_too_few_reads_in_flight_read_the_array_as_a_slower_one(policy):
    wide = TierSpec("array", None, 6e9, 1e-4, parallelism=4)
    # with four reads in flight the array is the same as a one-stream tier of the same bandwidth
    full = _run(policy, wide, io_depth=4)
    np.testing.assert_allclose(full.ttft, _run(policy, TierSpec("array", None, 6e9, 1e-4), io_depth=1).ttft)
    np.testing.assert_allclose(_run(policy, wide, io_depth=16).ttft, full.ttft)
    # with one, it is a 1.5 GB/s tier: every load takes four times as long, and the run is slower for it
    one = _run(policy, wide, io_depth=1)
    np.testing.assert_allclose(one.ttft, _run(policy, TierSpec("array", None, 1.5e9, 1e-4), io_depth=1).ttft)
    assert one.ttft_p(50) > 1.5 * full.ttft_p(50)
    assert one.bytes_read == full.bytes_read


def test_the_whitepaper_array_is_read_serially_at_r1s_slow_point_and_in_parallel_elsewhere():
    nvmeof = STORAGE["nvmeof-100gbe-raid0"]
    tier = TierSpec("nvmeof", None, nvmeof.read_bw, nvmeof.latency_s, nvmeof.parallelism)
    assert tier.bandwidth(R1_IO_DEPTH["0.98GB/s"]) == pytest.approx(0.98e9)
    assert tier.bandwidth(R1_IO_DEPTH["5.23GB/s"]) == tier.bandwidth(PARALLEL_READS) == pytest.approx(5.23e9)
    assert tier.bandwidth(PARALLEL_READS - 1) < 5.23e9  # fewer would not have reached the published figure


def _sim(*args: str) -> str:
    """`kvprefetch sim` output, with rich's line wrapping undone."""
    res = CliRunner().invoke(app, ["sim", *args])
    assert res.exit_code == 0, res.output
    return flat(res.output)


def test_cli_says_what_the_io_depth_reads_and_the_run_follows_it(tmp_path):
    base = ["--efficiency", "0.05", "--concurrency", "4", "--policies", "prefetch,dram"]
    serial = _sim(*base, "--io-depth", "1", "--json", str(tmp_path / "serial.json"))
    assert "5.23 GB/s, 0.98 GB/s read with --io-depth 1" in serial
    assert "needs more reads in flight" in serial
    parallel = _sim(*base, "--io-depth", "8", "--json", str(tmp_path / "parallel.json"))
    assert "5.23 GB/s read with --io-depth 8" in parallel and "needs more" not in parallel
    rows = {name: json.loads((tmp_path / f"{name}.json").read_text()) for name in ("serial", "parallel")}
    ttft = {name: {r["policy"]: r["ttft_p50_s"] for r in got} for name, got in rows.items()}
    assert ttft["serial"]["prefetch"] > 2 * ttft["parallel"]["prefetch"]
    assert ttft["serial"]["dram"] == ttft["parallel"]["dram"]  # all in DRAM: storage is never read


def test_cli_default_io_depth_is_kvprefetchs_own_and_bad_values_are_refused():
    default = IOConfig.model_fields["threads"].default
    assert f"read with --io-depth {default}" in _sim("--concurrency", "2", "--policies", "dram")
    res = CliRunner().invoke(app, ["sim", "--io-depth", "0"])
    assert res.exit_code != 0 and "--io-depth" in flat(res.output)
    res = CliRunner().invoke(app, ["sim", "--storage", "tape"])
    assert res.exit_code != 0 and "unknown storage 'tape'" in flat(res.output)


def test_sweep_reports_full_bandwidth_and_the_share_the_io_depth_reads(tmp_path):
    out = _sim("--sweep", "--efficiency", "0.05", "--concurrency", "4", "--io-depth", "4")
    assert "of full bandwidth, of which --io-depth 4 reads 75%" in out
    # one client: no queue for the load-or-recompute rule to weigh, so the sweep shows the io depth alone
    runs = {}
    for depth in ("4", "8"):
        _sim("--sweep", "--efficiency", "0.05", "--concurrency", "1", "--io-depth", depth, "--json",
             str(tmp_path / f"d{depth}.json"))  # fmt: skip
        runs[depth] = json.loads((tmp_path / f"d{depth}.json").read_text())[0]
    pairs = [
        (s["prefetch_ttft_p50_s"], d["prefetch_ttft_p50_s"])
        for s, d in zip(runs["4"]["points"], runs["8"]["points"], strict=True)
    ]
    # where storage bounds the run (prefetch far from the all-in-DRAM bound), fewer streams than the array needs
    # are slower, or the same where the rule recomputes
    bound = runs["8"]["points"][0]["dram_ttft_p50_s"]
    storage_bound = [(s, d) for s, d in pairs if d > 2 * bound]
    assert all(s >= d for s, d in storage_bound) and sum(s > 1.2 * d for s, d in storage_bound) >= 3
