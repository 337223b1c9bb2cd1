"""A tiny end-to-end two-instance run (shared vs private caches) plus the remote mode, on real vLLM CPU engines."""

from __future__ import annotations

import shutil

import pytest

from kvprefetch.bench.options import BenchOptions, EngineOptions, FileOptions, WorkloadOptions
from kvprefetch.workload.replay import ChatBench

pytest.importorskip("vllm")

pytestmark = [pytest.mark.slow, pytest.mark.engine]


def test_two_instance_and_remote_end_to_end(tmp_path):
    from kvprefetch.bench.bench_cli import run_and_report

    remote = shutil.which("redis-server") is not None
    modes = ["shared-2x", "private-2x"] + (["prefetch-remote"] if remote else [])
    opts = BenchOptions(
        modes=modes,
        concurrency=[2],
        regimes=(None,),
        repeats=1,
        workload=WorkloadOptions(chat=ChatBench(
            system_tokens=256,
            history_tokens=768,
            user_tokens=512,
            output_tokens=8,
            measured_turns=3,
            min_sessions=3,
            sessions_per_concurrency=1.0,
            think_s=0.05,
            prelude_turns=1,
        )),
        files=FileOptions(out=tmp_path / "out", cache_dir=tmp_path / "cache"),
        cell_timeout_s=300,
        # what this test is about (which caches the instances share) does not depend on where the threads run:
        # the gpu-node topology (a worker process per engine, ~14 s more to start each of the six) is
        # test_bench_e2e's to check; nothing here reads the modes' own calibrations either
        engine=EngineOptions(max_num_seqs=None, topology="shared"),
        calibrate_modes=False,
    )
    results = run_and_report(opts)
    rows = {r["mode"]: r for r in results["rows"]}
    assert set(rows) == set(modes)
    for r in rows.values():
        assert r["status"] == "ok", r
        assert r["errors"] == 0 and r["completed"] == r["requests"] == 9
        assert r["ttft_p50_s"] > 0 and r["ttft_p99_s"] >= r["ttft_p50_s"] and r["output_tok_s"] > 0
    for m in ("shared-2x", "private-2x"):
        assert rows[m]["requests_per_engine"] == [6, 3]  # turns 0 and 2 on engine 0, turn 1 on engine 1
        assert rows[m]["loaded_chunks"] > 0
    # turn 2 (engine 0) finds the chunks turn 1 (engine 1) computed only in the shared cache
    assert rows["shared-2x"]["hit_ratio"] > rows["private-2x"]["hit_ratio"]
    if remote:
        assert rows["prefetch-remote"]["bytes_remote_read"] > 0 and rows["prefetch-remote"]["loaded_chunks"] > 0
    assert (tmp_path / "out" / "report.md").stat().st_size > 0
    assert not list((tmp_path / "cache").iterdir())
