"""The step model against recorded engine steps (`kvprefetch bench --step-log`)."""

from __future__ import annotations

import json

import pytest
from tests.clitext import flat
from tests.sim.test_bench_prediction import _results
from typer.testing import CliRunner

from kvprefetch.cli import app
from kvprefetch.sim.calibration import calibration_from_results, cpu_deployment
from kvprefetch.sim.stepcheck import check_cell, check_run, price_step

DECODE = [[1, 3600], [1, 3500], [1, 900]]
PREFILL = [[300, 3328], [1, 3600]]


def _dep():
    return cpu_deployment(calibration_from_results(_results()))


def test_a_batch_is_priced_as_the_simulator_prices_the_same_step():
    dep = _dep()
    assert price_step(dep, DECODE) == ("decode", pytest.approx(dep.step_time([], 3, 8000.0)))
    assert price_step(dep, PREFILL) == ("prefill", pytest.approx(dep.step_time([(3328, 300)], 1, 3600.0)))


def test_cell_totals_split_by_kind_and_the_scheduler_by_waiting():
    dep = _dep()
    decode_s, prefill_s = price_step(dep, DECODE)[1], price_step(dep, PREFILL)[1]
    records = [
        {"s": 2 * decode_s, "batch": DECODE, "sched_s": 0.001, "waiting": 3},
        {"s": 2 * decode_s, "batch": DECODE, "sched_s": 0.0002, "waiting": 0},
        {"s": prefill_s, "batch": PREFILL, "sched_s": 0.0003, "waiting": 0},
    ]
    check = check_cell(dep, records)
    assert check["decode"].steps == 2 and check["decode"].measured_s == pytest.approx(2 * check["decode"].model_s)
    assert check["prefill"].steps == 1 and check["prefill"].measured_s == pytest.approx(check["prefill"].model_s)
    assert check["sched_ms_waiting"] == pytest.approx(1.0)
    assert check["sched_ms_idle"] == pytest.approx(0.25)


def test_sim_cli_bench_scenario_checks_recorded_steps(tmp_path):
    dep = _dep()
    run = tmp_path / "run"
    (run / "steps").mkdir(parents=True)
    results = _results()
    next(r for r in results["rows"] if (r["mode"], r["concurrency"]) == ("dram", 4))["helper_cpu_s"] = 0.37
    (run / "results.json").write_text(json.dumps(results))
    decode_s = price_step(dep, DECODE)[1]
    line = json.dumps({"t": 0.0, "s": 1.5 * decode_s, "sched_s": 0.0004, "waiting": 1, "batch": DECODE})
    (run / "steps" / "dram-c4.jsonl").write_text(line + "\n" + line + "\n")
    (run / "steps" / "notes.txt").write_text("not a step log")  # ignored: not <mode>-c<c>.jsonl
    assert set(check_run(_results(), run / "steps")) == {("dram", 4)}
    out = tmp_path / "rows.json"
    res = CliRunner().invoke(
        app, ["sim", "--scenario", "bench", "--bench-results", str(run / "results.json"), "--json", str(out)]
    )
    assert res.exit_code == 0, res.output
    assert "engine steps" in flat(res.output) and "cells within 20%" in flat(res.output)
    rows = {r["metric"]: r for r in json.loads(out.read_text())}
    step = rows["step_s decode dram c=4"]
    assert step["scenario"] == "steps run" and step["error_pct"] == pytest.approx(100 * (1 / 1.5 - 1))
    assert step["note"].startswith("2 steps;") and "0.40 with requests waiting" in step["note"]
    assert step["note"].endswith("connector threads 0.37 s CPU in the cell")
    assert sum(r.startswith("ttft_p50") for r in rows) == 8  # the TTFT rows are unchanged


def test_a_corrupt_step_log_is_a_clear_error(tmp_path):
    (tmp_path / "steps").mkdir()
    (tmp_path / "results.json").write_text(json.dumps(_results()))
    (tmp_path / "steps" / "dram-c4.jsonl").write_text('{"t": 0, "s": 0.01, "batch": [[1, 10]]}\n{truncated')
    res = CliRunner().invoke(app, ["sim", "--scenario", "bench", "--bench-results", str(tmp_path / "results.json")])
    text = flat(res.output)
    assert res.exit_code != 0 and "not a usable step log" in text and "line 2 is not JSON" in text
