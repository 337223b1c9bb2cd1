"""Free-form planning runs: closed loops, Poisson open loops and traces, from `Load` through `kvprefetch sim`."""

from __future__ import annotations

import json

import numpy as np
import pytest
from typer.testing import CliRunner

from kvprefetch.cli import app
from kvprefetch.sim.freeform import Load, Setup, parse_workload, run_setup
from kvprefetch.sim.policy import Policy

SETUP = Setup(efficiency=0.05)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"concurrency": 4, "rate_per_s": 1.0}, "not both"),
        ({"concurrency": 0}, "concurrency must be at least 1"),
        ({"rate_per_s": 0.0}, "arrival rate must be positive"),
    ],
)
def test_a_load_is_one_closed_or_open_loop(kwargs, message):
    with pytest.raises(ValueError, match=message):
        Load(**kwargs)


def test_open_loop_sessions_start_as_a_poisson_process():
    rate = 2.0
    requests, warm = parse_workload("context:4096,256,16", Load(rate_per_s=rate), seed=3)
    assert warm and len(requests) == Load(rate_per_s=rate).sessions() == 240  # two minutes of arrivals
    starts = np.array([r.arrival_s for r in requests])
    gaps = np.diff(np.concatenate([[0.0], starts]))
    assert (gaps > 0).all()
    assert gaps.mean() == pytest.approx(1 / rate, rel=0.15) and gaps.std() == pytest.approx(1 / rate, rel=0.2)
    chat, _ = parse_workload("chat", Load(rate_per_s=0.1))
    assert len({r.session_id for r in chat}) == Load.MIN_SESSIONS  # a slow rate still runs enough sessions
    closed, _ = parse_workload("chat", Load(concurrency=4))
    assert {r.arrival_s for r in closed if r.turn == 0} == {0.0}


def test_trace_and_synthetic_workloads_refuse_the_load_they_cannot_take():
    with pytest.raises(ValueError, match="a trace brings its own arrival times"):
        parse_workload("trace:whatever.jsonl", Load(concurrency=8))
    with pytest.raises(ValueError, match="needs a concurrency or an arrival rate"):
        parse_workload("chat", Load())


def test_an_open_loop_past_what_recompute_serves_queues_while_prefetch_keeps_up():
    slow, fast = Load(rate_per_s=0.1), Load(rate_per_s=0.6)
    runs = {(p, load): run_setup(SETUP, p, "context", load) for p in (Policy.RECOMPUTE, Policy.PREFETCH) for load in
            (slow, fast)}  # fmt: skip
    # recompute serves ~0.3 prompts/s of 18k tokens here: at 0.6/s its queue grows for the whole two minutes
    assert runs[(Policy.RECOMPUTE, fast)].ttft_p(50) > 5 * runs[(Policy.RECOMPUTE, slow)].ttft_p(50)
    # prefetch loads from storage faster than the sessions arrive: its TTFT hardly moves, its output follows the rate
    assert runs[(Policy.PREFETCH, fast)].ttft_p(50) < 3 * runs[(Policy.PREFETCH, slow)].ttft_p(50)
    ratio = runs[(Policy.PREFETCH, fast)].output_tok_s / runs[(Policy.PREFETCH, slow)].output_tok_s
    assert ratio == pytest.approx(6.0, rel=0.25)


def _sim(*args: str) -> tuple[int, str]:
    res = CliRunner().invoke(app, ["sim", *args])
    return res.exit_code, " ".join(res.output.replace("│", " ").split())  # rich wraps lines in boxes


def test_cli_runs_open_loops_and_labels_them(tmp_path):
    out, plots = tmp_path / "rows.json", tmp_path / "plots"
    plots.mkdir()
    code, text = _sim("--efficiency", "0.05", "--rate", "0.1,0.6", "--policies", "recompute,prefetch",
                      "--json", str(out), "--plots", str(plots))  # fmt: skip
    assert code == 0, text
    rows = json.loads(out.read_text())
    assert [(r["load"], r["rate_per_s"], r["concurrency"]) for r in rows] == [
        ("0.1/s", 0.1, None), ("0.1/s", 0.1, None), ("0.6/s", 0.6, None), ("0.6/s", 0.6, None)
    ]  # fmt: skip
    assert "0.6/s" in text and (plots / "ttft_vs_concurrency.png").stat().st_size > 0


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--rate", "1", "--concurrency", "2"], "--concurrency (closed loop) or --rate (open loop), not both"),
        (["--rate", "fast"], "--rate takes comma-separated floats, got 'fast'"),
        (["--concurrency", "1.5"], "--concurrency takes comma-separated ints, got '1.5'"),
        (["--workload", "trace:t.jsonl", "--rate", "1"], "a trace brings its own arrival times"),
    ],
)
def test_cli_refuses_loads_that_conflict(args, message):
    code, text = _sim(*args)
    assert code != 0 and message in text
