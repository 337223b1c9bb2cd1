"""The simulator against our own benchmark: calibration from a run's measurements, replay of its sessions."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest
from tests.clitext import flat
from typer.testing import CliRunner

from kvprefetch.cli import app
from kvprefetch.results import PreludeCounters
from kvprefetch.sim.calibration import (
    MIN_ENGINE_CORES,
    Calibration,
    at_speed,
    calibration_from_results,
    charged_io_cpu,
    chunk_ids,
    cpu_deployment,
    io_cpu_per_byte,
    level_requests,
    load_path_measured,
    predict_bench,
    rebuild_workload,
    replay_cells,
    request_overhead,
    speed_factor,
)
from kvprefetch.workload.replay import ChatBench, chat_workload

CAL = Calibration(
    prefill_tokens_per_s=11000.0,
    decode_step_s=0.004,
    disk_read_gbps=0.5,
    chunk_bytes=1 << 20,
    chunk_tokens=256,
    prompt_tokens=3500,
    extend_tokens=256,
    extend_offset=3500,
    extend_s=0.045,
    decode_batch=4,
    decode_batch_ctx=3500,
    decode_batch_step_s=0.011,
    decode_wide=16,
    decode_wide_step_s=0.007,
    request_floor_s=0.012,
    reload_s=0.05,
    reload_tokens=3328,
    engine_kv_tokens=17408,
    max_num_seqs=16,
    dram_bytes=400 << 20,
)


def test_calibrated_cpu_reproduces_every_sample_it_was_built_from():
    dep = cpu_deployment(CAL)
    front = request_overhead(CAL, dep.accelerator.step_overhead_s)
    assert 0 < front < CAL.request_floor_s
    cold = front + dep.prefill_time(CAL.prompt_tokens)
    assert cold == pytest.approx(CAL.prompt_tokens / CAL.prefill_tokens_per_s, rel=0.01)
    assert front + dep.prefill_time(CAL.extend_tokens, CAL.extend_offset) == pytest.approx(CAL.extend_s, rel=0.01)
    assert dep.attention_efficiency != pytest.approx(1.0)  # the two samples were told apart
    assert float(dep.decode_steps(1, CAL.decode_step_ctx, 1)[0]) == pytest.approx(CAL.decode_step_s, rel=0.01)
    batch = float(dep.decode_steps(CAL.decode_batch, CAL.decode_batch * CAL.decode_batch_ctx, 1)[0])
    assert batch == pytest.approx(CAL.decode_batch_step_s, rel=0.01)
    wide = float(dep.decode_steps(CAL.decode_wide, CAL.decode_wide * CAL.decode_step_ctx, 1)[0])
    assert wide == pytest.approx(CAL.decode_wide_step_s, rel=0.01)
    assert dep.accelerator.seq_overhead_s > 0  # sixteen short sequences cost more than one: per-sequence work
    loaded = CAL.reload_tokens * dep.model.kv_bytes_per_token / dep.accelerator.host_link_bw
    rest = dep.prefill_time(CAL.prompt_tokens - CAL.reload_tokens, CAL.reload_tokens)
    assert front + loaded + rest == pytest.approx(CAL.reload_s, rel=0.01)
    assert dep.kv_capacity_tokens == 17408 and dep.max_seqs == 16


def test_a_reload_faster_than_its_own_compute_keeps_the_default_copy_rate():
    dep = cpu_deployment(replace(CAL, reload_s=0.001))
    assert dep.accelerator.host_link_bw == CAL.host_copy_gbps * 1e9


def test_without_the_optional_samples_one_rate_serves_prefill_and_attention():
    cal = replace(CAL, extend_s=None, decode_batch_step_s=None, request_floor_s=None, decode_wide_step_s=None,
                  reload_s=None)  # fmt: skip
    dep = cpu_deployment(cal)
    assert dep.attention_efficiency == pytest.approx(1.0)
    assert dep.accelerator.seq_overhead_s == 0 and dep.accelerator.host_link_bw == cal.host_copy_gbps * 1e9
    assert dep.prefill_time(cal.prompt_tokens) == pytest.approx(cal.prompt_tokens / cal.prefill_tokens_per_s, 0.01)


SPEC = ChatBench(system_tokens=512, history_tokens=1024, user_tokens=256, output_tokens=8, measured_turns=2)


def test_replayed_requests_share_exactly_the_chunks_the_bench_sessions_share():
    wl = chat_workload(SPEC, [2], vocab_size=4096)
    reqs = level_requests(wl.levels[2], 256)
    assert len(reqs) == wl.requests(2)
    by = {(r.session_id, r.turn): r for r in reqs}
    # every session starts with the same system prompt: its two chunks are the same ids everywhere
    assert len({r.hash_ids[:2] for r in reqs}) == 1
    # a later turn extends the earlier one: its chunks start with all of the earlier turn's full chunks
    assert by[(0, 1)].hash_ids[: len(by[(0, 0)].hash_ids)] == by[(0, 0)].hash_ids
    # other sessions diverge after the system prompt
    assert by[(1, 0)].hash_ids[2] != by[(0, 0)].hash_ids[2]
    # the measured first turn extends its prelude turn, whose chunks are on disk before the run
    prelude = chunk_ids(wl.prelude[0].turns[-1].tokens, 256)
    assert by[(0, 0)].hash_ids[: len(prelude)] == prelude


def _results(levels=(1, 4)) -> dict:
    """A bench results.json as the runner writes it, with made-up measurements."""
    declared = chat_workload(SPEC, list(levels), 4096).declared
    rows = [
        {"mode": m, "concurrency": c, "status": "ok", "ttft_p50_s": t * (1 + c / 4)}
        for m, t in (("recompute", 0.3), ("ondemand", 0.06), ("prefetch", 0.05), ("dram", 0.04))
        for c in levels
    ] + [{"mode": "vllm-example", "concurrency": 1, "status": "ok", "ttft_p50_s": 0.2}]
    return {
        "regime": {
            "prefill_tokens_per_s": 11000.0,
            "decode_step_s": 0.004,
            "read_bps": 5e8,
            "chunk_bytes": 1 << 20,
            "chunk_tokens": 256,
        },
        "config": {
            "concurrency": list(levels),
            "max_num_batched_tokens": 2048,
            "engine_kv_cache_tokens": 17408,
            "max_num_seqs": 16,
            "dram_tier_bytes": 400 << 20,
        },
        "model": {"vocab_size": 4096},
        "workload": declared,
        "populate": {
            "calibration": {
                "prompt_tokens": 3500,
                "extend_tokens": 256,
                "extend_offset": 3500,
                "extend_s": 0.045,
                "decode_batch": 4,
                "decode_batch_ctx": 3500,
                "decode_batch_step_s": 0.011,
                "decode_wide": 16,
                "decode_wide_step_s": 0.007,
                "reload_s": 0.05,
                "reload_tokens": 3328,
            }
        },
        "rows": rows,
    }


def test_prediction_covers_every_simulated_cell_and_orders_the_modes():
    results = _results()
    cal = calibration_from_results(results)
    assert (cal.decode_batch_step_s, cal.decode_wide_step_s, cal.reload_s) == (0.011, 0.007, 0.05)
    assert rebuild_workload(results).requests(4) == chat_workload(SPEC, [1, 4], 4096).requests(4)
    rows = predict_bench(results)
    assert {(r["mode"], r["concurrency"]) for r in rows} == {
        (m, c) for m in ("recompute", "ondemand", "prefetch", "dram") for c in (1, 4)
    }  # vllm-example is not a simulated mode
    pred = {(r["mode"], r["concurrency"]): r["predicted"] for r in rows}
    for c in (1, 4):
        assert pred[("recompute", c)] > 1.5 * pred[("ondemand", c)]
    # alone, a load from DRAM beats one from disk. (At c=4 the order may flip, as it does in half of our bench
    # runs: the opening burst's DRAM loads all run in one step, which waits for every copy, while the first
    # disk load done lets its request prefill at once; tests/sim/test_block_pool.py pins that down.)
    assert 0 < pred[("dram", 1)] < pred[("ondemand", 1)]
    assert pred[("recompute", 4)] > pred[("recompute", 1)]
    for r in rows:
        assert r["error_pct"] == pytest.approx(100 * (r["predicted"] - r["measured"]) / r["measured"])
        assert r["computed_tokens_measured"] is None  # these made-up rows do not say what the engine computed
    computed = {(r["mode"], r["concurrency"]): r["computed_tokens_predicted"] for r in rows}
    for c in (1, 4):  # every cache mode finds the whole prelude in a tier; recompute has only the engine's cache
        assert computed[("dram", c)] == computed[("ondemand", c)] == computed[("prefetch", c)]
        assert 0 < computed[("dram", c)] < computed[("recompute", c)]


def test_calibration_pools_every_engines_speeds_by_their_median():
    """The populating engine and each mode's engine measured the speeds; the replay takes each one's median, so
    one lucky or unlucky engine does not shift every prediction of the run."""
    results = _results()
    base = results["populate"]["calibration"] | {"prefill_tokens_per_s": 11000.0, "decode_step_s": 0.004}
    results["populate"]["calibration"] = base
    alone = calibration_from_results(results)
    assert alone.engines == 1 and alone.prefill_tokens_per_s == 11000.0
    fast = base | {"prefill_tokens_per_s": 30000.0, "decode_step_s": 0.002, "extend_s": 0.02, "reload_s": 0.03}
    slow = base | {"prefill_tokens_per_s": 8000.0, "decode_step_s": 0.006, "extend_s": 0.06, "reload_s": 0.09}
    results["mode_calibrations"] = {"ondemand": fast, "prefetch": slow}
    pooled = calibration_from_results(results)
    assert pooled.engines == 3
    assert replace(pooled, engines=1) == alone  # the middle engine's speeds, every one of them
    assert predict_bench(results) == predict_bench(results | {"mode_calibrations": {}})
    # an engine without a tier (recompute's) has no reload: the reload is the median of the engines that had one
    no_tier = fast | {"reload_s": None, "reload_tokens": None}
    results["mode_calibrations"] = {"recompute": no_tier, "prefetch": slow}
    pooled = calibration_from_results(results)
    assert pooled.prefill_tokens_per_s == 11000.0 and pooled.reload_s == pytest.approx((0.05 + 0.09) / 2)


def test_sim_cli_bench_scenario_compares_where_the_prompt_tokens_came_from(tmp_path):
    """With the shares a real run measures, the CLI also compares the prompt tokens the engine computed and
    those it found in its own prefix cache."""
    results = _results()
    replay = {(r["mode"], r["concurrency"]): r for r in predict_bench(results)}
    for row in results["rows"]:
        cell = replay.get((row["mode"], row["concurrency"]))
        if cell is not None:
            row["prompt_tokens"] = 100_000
            row["share_computed"] = cell["computed_tokens_predicted"] / 100_000
            row["share_engine"] = cell["engine_cached_tokens_predicted"] / 100_000
    results["rows"][0]["share_computed"] *= 1.5  # recompute c=1: vLLM computed half as much again
    results["rows"][1]["share_engine"] += 0.1  # recompute c=4: vLLM found 10,000 more tokens in its cache
    replayed = {cell: r["computed_tokens_predicted"] for cell, r in replay.items()}
    path, out = tmp_path / "results.json", tmp_path / "rows.json"
    path.write_text(json.dumps(results))
    res = CliRunner().invoke(app, ["sim", "--scenario", "bench", "--bench-results", str(path), "--json", str(out)])
    assert res.exit_code == 0, res.output
    assert "7 of 8 cells within 5% of the tokens vLLM computed" in flat(res.output)
    rows = {r["metric"]: r for r in json.loads(out.read_text())}
    first, want = rows["computed_tokens recompute c=1"], replayed[("recompute", 1)]
    assert first["published"] == round(1.5 * want) and first["simulated"] == want
    assert rows["computed_tokens dram c=4"]["error_pct"] == 0
    assert "7 of 8 cells within 5% of the tokens vLLM found in its prefix cache" in flat(res.output)
    cached = rows["engine_cached_tokens recompute c=4"]
    assert cached["published"] - cached["simulated"] == 10_000


def test_sim_cli_bench_scenario_prints_and_writes_rows(tmp_path):
    path = tmp_path / "results.json"
    path.write_text(json.dumps(_results()))
    out = tmp_path / "rows.json"
    res = CliRunner().invoke(app, ["sim", "--scenario", "bench", "--bench-results", str(path), "--json", str(out)])
    assert res.exit_code == 0, res.output
    assert "cells within 20%" in flat(res.output)
    assert "published" not in flat(res.output)  # the bench's figures are measured ones, and the table says so
    assert "did not measure the connector's CPU" in flat(res.output)  # no prelude measurement
    rows = json.loads(out.read_text())
    assert len(rows) == 8 and all(r["scenario"] == "bench" and not r["fitted"] for r in rows)
    assert "the engine computed" not in flat(res.output)  # the made-up rows have no shares to compare with


def test_sim_cli_bench_scenario_over_several_runs_compares_medians(tmp_path):
    slow = _results()
    for row in slow["rows"]:
        row["ttft_p50_s"] *= 3
    slow["populate"]["prelude"] = {"helper_cpu_s": 0.6, "loaded_chunks": 400, "saved_chunks": 400}
    slow["mode_calibrations"] = {"prefetch": slow["populate"]["calibration"], "dram": slow["populate"]["calibration"]}
    paths = []
    for k, results in enumerate((_results(), slow, _results())):
        paths += ["--bench-results", str(tmp_path / f"r{k}.json")]
        (tmp_path / f"r{k}.json").write_text(json.dumps(results))
    out = tmp_path / "rows.json"
    res = CliRunner().invoke(app, ["sim", "--scenario", "bench", *paths, "--json", str(out)])
    assert res.exit_code == 0, res.output
    assert "medians of 3 runs" in flat(res.output) and "inside the range the runs measured" in flat(res.output)
    assert "charged to the steps: -, 0.72, - ns/B" in flat(res.output)  # 0.6 s / 800 MiB
    assert "median over the run's engines (1, 3, 1 engines" in flat(res.output)
    one = {r["metric"]: r for r in json.loads(out.read_text())}
    base = {f"ttft_p50 {r['mode']} c={r['concurrency']}": r["ttft_p50_s"] for r in _results()["rows"]}
    assert one["ttft_p50 dram c=4"]["published"] == pytest.approx(base["ttft_p50 dram c=4"])  # the median run
    assert one["ttft_p50 dram c=4"]["note"].startswith("3 run(s)")


def test_sim_cli_bench_scenario_without_results_is_a_clear_error(tmp_path):
    res = CliRunner().invoke(app, ["sim", "--scenario", "bench", "--bench-results", str(tmp_path / "nope.json")])
    assert res.exit_code != 0
    assert "bench-results" in flat(res.output)
    bad = tmp_path / "bad.json"
    bad.write_text("{}")
    res = CliRunner().invoke(app, ["sim", "--scenario", "bench", "--bench-results", str(bad)])
    assert res.exit_code != 0 and "not a usable" in flat(res.output)
    bad.write_text("{not json")
    res = CliRunner().invoke(app, ["sim", "--scenario", "bench", "--bench-results", str(bad)])
    assert res.exit_code != 0 and "not a usable" in flat(res.output)
    res = CliRunner().invoke(app, ["sim", "--scenario", "bench", "--bench-results", str(tmp_path)])  # no results.json
    assert res.exit_code != 0 and "results.json" in flat(res.output) and "Traceback" not in res.output


def test_sim_cli_bench_scenario_takes_a_runs_directory_for_its_results_json(tmp_path):
    run = tmp_path / "20261203-105106"  # what `kvprefetch bench` writes: bench-results/<timestamp>/results.json
    run.mkdir()
    (run / "results.json").write_text(json.dumps(_results()))
    res = CliRunner().invoke(app, ["sim", "--scenario", "bench", "--bench-results", str(run)])
    assert res.exit_code == 0, res.output
    assert "cells within 20%" in flat(res.output)


def test_the_prelude_prices_the_connectors_cpu_per_byte_and_cache_modes_pay_it():
    prelude = {"helper_cpu_s": 0.9, "loaded_chunks": 200, "saved_chunks": 300, "bytes_disk_written": 300 << 20}
    assert io_cpu_per_byte(PreludeCounters(**prelude), 1 << 20) == pytest.approx(0.9 / (800 << 20))
    unmeasured = PreludeCounters(**{k: v for k, v in prelude.items() if k != "helper_cpu_s"})
    assert io_cpu_per_byte(unmeasured, 1 << 20) is None
    results = _results()
    plain = {(r["mode"], r["concurrency"]): r["predicted"] for r in predict_bench(results)}
    results["populate"]["prelude"] = prelude
    assert calibration_from_results(results).io_cpu_s_per_byte == pytest.approx(0.9 / (800 << 20))
    charged = {(r["mode"], r["concurrency"]): r["predicted"] for r in predict_bench(results)}
    assert charged[("recompute", 4)] == plain[("recompute", 4)]  # no connector, no copies
    assert charged[("ondemand", 4)] > plain[("ondemand", 4)]


def _plan(*args: str) -> tuple[int, str]:
    res = CliRunner().invoke(app, ["sim", *args])
    return res.exit_code, flat(res.output)


def test_sim_cli_plans_on_this_cpu_and_its_disk_as_a_bench_run_measured_them(tmp_path):
    path, out = tmp_path / "results.json", tmp_path / "rows.json"
    path.write_text(json.dumps(_results()))
    code, text = _plan("--accelerator", "this-cpu", "--storage", "this-disk", "--calibration", str(path),
                       "--workload", "context:3000,500,8", "--concurrency", "1", "--policies", "recompute,ondemand",
                       "--json", str(out))  # fmt: skip
    assert code == 0, text
    assert f"this-cpu: tiny-llama as {path} measured it (median of 1 engines)" in text
    assert "tiny-llama on 1x this-cpu, this-disk" in text
    assert "this-disk: 0.50 GB/s, 0.50 GB/s read with --io-depth 4" in text
    rows = {r["policy"]: r for r in json.loads(out.read_text())}
    # a fresh 3500-token prompt alone takes what the bench measured for one (the front end included)
    assert rows["recompute"]["ttft_p50_s"] == pytest.approx(3500 / 11000.0, rel=0.02)
    assert rows["recompute"]["hit_ratio"] == 0 and rows["ondemand"]["hit_ratio"] > 0.6
    # its 2560 stored tokens come from the measured disk at 0.5 GB/s, 4 KiB a token: 21 ms, less compute than that
    assert 0.02 < rows["ondemand"]["ttft_p50_s"] < rows["recompute"]["ttft_p50_s"]


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--accelerator", "this-cpu"], "this-cpu and this-disk are measured, not catalogued: pass --calibration"),
        (["--storage", "this-disk"], "pass --calibration OUT/results.json"),
        (["--accelerator", "this-cpu", "--model", "qwen-14b", "--calibration", "{good}"],
         "this-cpu was calibrated serving tiny-llama: pass --model tiny-llama"),
        (["--accelerator", "this-cpu", "--calibration", "{missing}"], "cannot read the bench results"),
        (["--accelerator", "this-cpu", "--calibration", "{bad}"], "is not a usable kvprefetch bench results.json"),
    ],
)  # fmt: skip
def test_sim_cli_this_cpu_without_a_usable_calibration_is_a_clear_error(tmp_path, args, message):
    (tmp_path / "good.json").write_text(json.dumps(_results()))
    (tmp_path / "bad.json").write_text('{"regime": {}}')
    paths = {"good": tmp_path / "good.json", "bad": tmp_path / "bad.json", "missing": tmp_path / "none.json"}
    code, text = _plan(*[a.format(**paths) for a in args], "--concurrency", "1")
    assert code != 0 and message in text


def test_the_results_schema_reads_older_runs_and_refuses_newer_ones():
    """A results.json without the schema key (older runs) reads as version 1; one from a newer schema is refused
    with the versions named, not misread."""
    from kvprefetch.results import SCHEMA_KEY, SCHEMA_VERSION, BenchResults

    results = _results()
    results.pop(SCHEMA_KEY, None)
    typed = BenchResults.from_json(results)
    assert typed.version == 1
    assert typed.config.topology.kind == "shared"  # runs before topologies computed on every core
    with pytest.raises(ValueError, match=f"reads up to {SCHEMA_VERSION}"):
        BenchResults.from_json(results | {SCHEMA_KEY: SCHEMA_VERSION + 1})


def test_the_context_workload_is_replayed_as_the_chat_shape_it_was_built_from():
    """The default workload declares kind "context" (a chat-shaped workload): its replay is those very sessions,
    each a stored context plus new tokens, so the engine computes only the new tokens in the connector's modes."""
    from kvprefetch.workload.replay import CONTEXT

    results = _results() | {"workload": chat_workload(CONTEXT, [1, 4], 4096).declared}
    assert results["workload"]["kind"] == "context"
    replayed, built = rebuild_workload(results), chat_workload(CONTEXT, [1, 4], 4096)
    assert replayed.levels == built.levels and replayed.prelude == built.prelude
    cells = replay_cells(calibration_from_results(results), replayed, ["prefetch"], [4])
    past_context = sum(len(t.tokens) - CONTEXT.history_tokens for s in built.levels[4] for t in s.turns)
    assert 0 < past_context < built.prompt_tokens(4) / 20
    assert cells[("prefetch", 4)].tokens_from["computed"] == past_context


def test_a_gpu_node_run_does_not_charge_the_connectors_cpu_to_the_models_steps():
    """With `gpu-node` the connector's threads ran on cores of their own: their CPU per byte is still read from
    the prelude, but the replay charges the model's steps nothing for it."""
    results = _results()
    results["populate"]["prelude"] = {"helper_cpu_s": 0.9, "loaded_chunks": 200, "saved_chunks": 300}
    shared = calibration_from_results(results)
    assert shared.shared_cores and charged_io_cpu(shared) == pytest.approx(0.9 / (500 << 20))
    results["config"]["topology"] = {"kind": "gpu-node", "model_cpus": [0], "host_cpus": [1]}
    apart = calibration_from_results(results)
    assert apart.io_cpu_s_per_byte == shared.io_cpu_s_per_byte and not apart.shared_cores
    assert charged_io_cpu(apart) == 0.0


def test_each_cell_runs_at_the_share_of_the_machine_its_neighbours_left_the_engine():
    """On a shared machine the calibration and every cell see other processes' load: a cell whose neighbours took
    less CPU than they did while the engine calibrated replays faster, by the engine's share of the cores."""
    cal = replace(CAL, machine_cpus=2, foreign_cpu_cores=1.0)
    assert speed_factor(cal, 1.0) == 1.0 and speed_factor(cal, 0.0) == 2.0 and speed_factor(cal, 1.5) == 0.5
    assert speed_factor(cal, 9.0) == pytest.approx(MIN_ENGINE_CORES)  # a saturated reading stays finite
    assert speed_factor(CAL, 0.0) == 1.0 and speed_factor(cal, None) == 1.0  # unknown: the calibration's speed
    assert speed_factor(replace(cal, shared_cores=False), 0.0) == 1.0  # gpu-node: the model's cores its own
    dep = cpu_deployment(cal)
    assert at_speed(dep, 2.0).prefill_time(2048) == pytest.approx(dep.prefill_time(2048) / 2)

    results = _results()
    results["machine"] = {"cpus": 2}
    results["populate"]["calibration"]["foreign_cpu_cores"] = 1.0
    ttft = {}
    for foreign in (1.0, 0.0):
        for row in results["rows"]:
            row["foreign_cpu_cores"] = foreign
        ttft[foreign] = {(p["mode"], p["concurrency"]): p["predicted"] for p in predict_bench(results)}
    plain = {(p["mode"], p["concurrency"]): p["predicted"] for p in predict_bench(_results())}
    assert ttft[1.0] == plain  # neighbours as busy as when it calibrated: the calibration's speed
    assert all(ttft[0.0][cell] < ttft[1.0][cell] for cell in plain)


def test_copies_priced_by_the_reload_sample_are_not_charged_cpu_again():
    """The DRAM -> engine rate comes from a timed reload, the copying threads' CPU included; the replay then
    charges the steps CPU per byte only for the other traffic (disk reads, saves), not for those copies again."""
    from kvprefetch.sim.engine import SimConfig, simulate
    from kvprefetch.sim.policy import Policy
    from kvprefetch.sim.tiers import TierSpec

    assert load_path_measured(CAL)
    assert not load_path_measured(replace(CAL, reload_s=None))
    dep = cpu_deployment(CAL)
    workload = chat_workload(SPEC, [4], 4096)
    stored = [b for s in workload.prelude for t in s.turns for b in chunk_ids(t.tokens, 256)]
    requests = level_requests(workload.levels[4], 256)

    def ttft(on_loads: bool) -> float:
        config = SimConfig(dep, Policy.DRAM, (TierSpec("dram", None, dep.accelerator.host_link_bw),), concurrency=4,
                           preload={"dram": stored}, block_tokens=256, engine_block_pool=True,
                           sync_loads_in_step=True, io_cpu_s_per_byte=2e-9, io_cpu_on_loads=on_loads)  # fmt: skip
        return simulate(config, requests).ttft_p(50)

    assert ttft(on_loads=False) < ttft(on_loads=True)
