"""The simulator's step model against the engine's own steps, recorded by `kvprefetch bench --step-log`.

A recorded step is a batch (per request: tokens scheduled, tokens already computed) and its wall time. The
deployment calibrated from the same run prices that very batch, so the two totals compare step costs alone:
a TTFT error that these ratios do not show is in the scheduling (admission, queueing), not in the costs.
The scheduler's own time is split by whether requests were left waiting: vLLM looks the waiting head up in
the connector again on every step it cannot admit it, a cost the calibration's samples never see. Each cell
also carries the CPU its connector threads took (the bench's `helper_cpu_s`): the replay charges that work to
the steps per byte moved, which the step model here leaves out, so it is what a cache mode's measured steps
may exceed the model by.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from kvprefetch.results import BenchResults
from kvprefetch.sim.costs import Deployment

STEP_FILE = re.compile(r"(?P<mode>.+)-c(?P<c>\d+)\.jsonl")


@dataclass(frozen=True)
class StepTotals:
    """Measured and modelled seconds of one kind of step in one cell."""

    steps: int
    measured_s: float
    model_s: float


def price_step(dep: Deployment, batch: list[list[int]]) -> tuple[str, float]:
    """("decode" or "prefill", the model's seconds) of one recorded batch of [scheduled, computed] pairs.

    A request scheduled for one token is decoding (its context is what it has computed); more tokens are a
    prefill chunk at that offset."""
    chunks = [(done, n) for n, done in batch if n > 1]
    decodes = [done for n, done in batch if n == 1]
    kind = "prefill" if chunks else "decode"
    return kind, dep.step_time(chunks, len(decodes), float(sum(decodes)))


def check_cell(dep: Deployment, records: list[dict]) -> dict:
    """Totals per kind of step, and the scheduler's median time per step with and without requests waiting."""
    totals: dict[str, list[float]] = {"decode": [], "prefill": []}
    model: dict[str, float] = {"decode": 0.0, "prefill": 0.0}
    sched: dict[bool, list[float]] = {True: [], False: []}
    for rec in records:
        kind, seconds = price_step(dep, rec["batch"])
        totals[kind].append(float(rec["s"]))
        model[kind] += seconds
        if rec.get("sched_s") is not None:
            sched[bool(rec.get("waiting"))].append(float(rec["sched_s"]))
    out: dict = {k: StepTotals(len(v), float(sum(v)), model[k]) for k, v in totals.items()}
    out["sched_ms_waiting"] = 1e3 * float(np.median(sched[True])) if sched[True] else None
    out["sched_ms_idle"] = 1e3 * float(np.median(sched[False])) if sched[False] else None
    return out


def read_steps(folder: Path) -> dict[tuple[str, int], list[dict]]:
    """Every cell's recorded steps in a bench output's steps/ folder, by (mode, concurrency)."""
    cells = {}
    for path in sorted(folder.glob("*.jsonl")):
        m = STEP_FILE.fullmatch(path.name)
        if m is None:
            continue
        records = []
        for k, line in enumerate(path.read_text().splitlines(), 1):
            try:
                if line.strip():
                    records.append(json.loads(line))
            except ValueError:
                raise ValueError(f"{path} line {k} is not JSON (a truncated log?)") from None
        cells[(m["mode"], int(m["c"]))] = records
    return dict(sorted(cells.items(), key=lambda kv: (kv[0][1], kv[0][0])))


def check_run(results: BenchResults | dict, folder: Path) -> dict[tuple[str, int], dict]:
    """The step check of every recorded cell of one bench run, priced on that run's own calibration."""
    from kvprefetch.sim.calibration import calibration_from_results, cpu_deployment

    if not isinstance(results, BenchResults):
        results = BenchResults.from_json(results)
    dep = cpu_deployment(calibration_from_results(results))
    helper = {(r.mode, r.concurrency): r.helper_cpu_s for r in results.rows}
    return {
        cell: check_cell(dep, records) | {"helper_cpu_s": helper.get(cell)}
        for cell, records in read_steps(folder).items()
    }
