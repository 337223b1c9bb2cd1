"""The scenario contract: a new scenario is one module (here, one class) and its registry line, and the runner runs
it with the others, its rows checked as written and its section in results.json.

No engine runs here: the example's cells stand for what an engine would answer (the real scenarios' cells are
the end-to-end tests': test_bench_e2e, test_bench_two_instance_e2e, test_two_node_e2e), so what is under test is
the runner's and the lab's part: planning, running in the registry's order, rows, sections.
"""

from __future__ import annotations

from pathlib import Path

import pydantic
import pytest

from kvprefetch.bench import scenarios
from kvprefetch.bench.lab import Lab, Progress
from kvprefetch.bench.modes import StoreSizing
from kvprefetch.bench.options import BenchOptions, TwoNodeOptions
from kvprefetch.bench.plan import BenchPlan
from kvprefetch.bench.populate import Populated, RunFiles
from kvprefetch.bench.rounds import aggregate
from kvprefetch.bench.runner import Bench, plan_stages
from kvprefetch.bench.scenarios import SCENARIOS, Scenario, Sections, Stage
from kvprefetch.testbed import protocol as P


class Echo(Scenario):
    """An example scenario: every running mode's levels, each answered at once with one request per session,
    and a section of its own."""

    kind = "echo"

    def plan(self, plan: BenchPlan) -> Stage | None:
        return Stage(self.kind, tuple(plan.running), seconds=1.0)

    def run(self, lab: Lab, population: Populated, stage: Stage) -> Sections:
        for mode in stage.modes:
            lab.run_cells(mode, " (echo)", lambda c: (_answer(c), {"echoed": True}))
        return {"echo": {"modes": list(stage.modes), "prefill_tps": population.tps}}


def _answer(c: int) -> dict:
    """What an engine's `Run` answers for `c` requests, each with its first token 10 ms after its arrival."""
    recs = [{"sid": f"s{i}", "turn": 0, "arrival": 0.0, "first_token": 0.01, "finish": 0.02, "prompt_tokens": 256,
             "output_tokens": 8, "cached_tokens": 0} for i in range(c)]  # fmt: skip
    return {"records": recs, "wall_s": 0.02, "errors": []}


def _population() -> Populated:
    sizing = StoreSizing(chunk_tokens=256, dram_bytes=1 << 20, disk_bytes=1 << 30)
    ask = P.Calibrate(prompt_tokens=256, repeats=1, decode_tokens=8, vocab=1000)
    return Populated(tps=1000.0, chunk_tokens=256, calibrate=ask, chunk_bytes=1 << 20, engine_block_tokens=16,
                     regime={"asked": "native"}, sweep=[], sweep_info=[], info={}, placement={},
                     sizing=sizing)  # fmt: skip


def test_a_registered_scenario_runs_with_the_others_and_adds_its_section(monkeypatch, tmp_path):
    monkeypatch.setitem(SCENARIOS, Echo.kind, Echo())  # the registry line
    bench = Bench(BenchOptions(modes=["recompute", "prefetch", "shared-2x"], concurrency=[1, 2], regimes=(None,)))
    kinds = [s.kind for s in bench.stages]
    assert kinds == ["single", "two-instance", "echo"]  # the registry's order
    single, two, echo = bench.stages
    assert single.modes == ("recompute", "prefetch") and two.modes == ("shared-2x",)
    assert echo.modes == ("recompute", "prefetch", "shared-2x")

    lab = Lab(bench.plan, RunFiles("t", tmp_path), Progress(None), lambda row: None, lambda msg: None)
    sections = SCENARIOS["echo"].run(lab, _population(), echo)
    assert sections == {"echo": {"modes": ["recompute", "prefetch", "shared-2x"], "prefill_tps": 1000.0}}
    rows = aggregate(lab.rows)
    assert [(r["mode"], r["concurrency"]) for r in rows] == [
        (m, c) for m in ("recompute", "prefetch", "shared-2x") for c in (1, 2)]  # fmt: skip
    assert all(r["status"] == "ok" and r["echoed"] and r["completed"] == r["concurrency"] for r in rows)
    assert all(r["ttft_p50_s"] == pytest.approx(0.01) for r in rows)


def test_the_scenario_asked_decides_which_scenarios_run():
    two_node = plan_stages(Bench(BenchOptions(modes=["recompute"], concurrency=[1], regimes=(None,),
                                              scenario=TwoNodeOptions())).plan)  # fmt: skip
    assert [s.kind for s in two_node] == ["two-node"]
    single = plan_stages(Bench(BenchOptions(modes=["recompute"], concurrency=[1], regimes=(None,))).plan)
    assert [s.kind for s in single] == ["single"]


def test_a_malformed_row_fails_where_it_is_written(tmp_path):
    bench = Bench(BenchOptions(modes=["recompute"], concurrency=[1], regimes=(None,)))
    lab = Lab(bench.plan, RunFiles("t", tmp_path), Progress(None), lambda row: None, lambda msg: None)
    with pytest.raises(pydantic.ValidationError, match="concurrency"):
        lab.add_row({"mode": "recompute", "status": "ok"})
    with pytest.raises(pydantic.ValidationError, match="status"):
        lab.add_row({"mode": "recompute", "concurrency": 1, "status": "fine"})
    lab.unavailable("recompute", "not here")
    assert lab.rows == [{"workload": bench.plan.workload.name, "regime": "native", "mode": "recompute",
                         "concurrency": 1, "status": "unavailable", "reason": "not here"}]  # fmt: skip


def test_no_scenario_imports_another_or_the_runner():
    """What two scenarios share lives below them (the lab, the testbed, the modes)."""
    import ast

    folder = Path(scenarios.__file__).parent
    names = {p.stem for p in folder.glob("*.py")} - {"__init__", "base"}
    for p in folder.glob("*.py"):
        if p.stem == "__init__":
            continue
        imported = {n.module for n in ast.walk(ast.parse(p.read_text())) if isinstance(n, ast.ImportFrom)}
        assert not {f"kvprefetch.bench.scenarios.{n}" for n in names} & imported, p
        assert "kvprefetch.bench.runner" not in imported, p
