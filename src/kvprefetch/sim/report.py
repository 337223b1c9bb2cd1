"""Validation rows `{scenario, metric, published, simulated, error_pct, fitted}`: build, print, save."""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
from rich.console import Console
from rich.table import Table

from kvprefetch.sim.hitratio import hit_ratio, published_for
from kvprefetch.sim.scenarios import FIT, PUBLISHED, WhitepaperFit, simulate_metric
from kvprefetch.workload.request import Request


@dataclass(frozen=True)
class Row:
    scenario: str
    metric: str
    published: float
    simulated: float
    error_pct: float
    fitted: bool
    note: str = ""


def _row(scenario: str, metric: str, published: float, simulated: float, fitted: bool, note: str = "") -> Row:
    error = 100.0 * (simulated - published) / published
    return Row(scenario, metric, published, simulated, error, fitted, note)


def whitepaper_rows(
    scenarios: Iterable[str], fit: WhitepaperFit = FIT, progress: Callable[[], None] | None = None
) -> list[Row]:
    """Simulated vs published for every whitepaper figure of the given scenarios."""
    wanted = set(scenarios)
    rows = []
    for p in PUBLISHED:
        if p.scenario in wanted:
            rows.append(_row(p.scenario, p.metric, p.value, simulate_metric(p, fit), p.fitted, p.note))
            if progress:
                progress()
    return rows


def mooncake_rows(requests: Sequence[Request], trace_name: str) -> list[Row]:
    """Hit ratio vs capacity at every capacity the trace's paper published (none are fitted)."""
    rows = []
    for capacity, value in published_for(trace_name).items():
        label = "unbounded" if capacity is None else f"{capacity} blocks"
        rows.append(_row("mooncake", f"hit_ratio {label}", value, hit_ratio(requests, capacity), False))
    return rows


def bench_cells(
    predictions: Sequence[list[dict]], measured: str = "measured", predicted: str = "predicted"
) -> dict[tuple[str, int], tuple[list[float], list[float]]]:
    """(measured, predicted) values of every (mode, concurrency) cell over `kvprefetch bench` runs, from each
    run's `predict_bench` rows (the run replayed on its own calibration; nothing is fitted to the measurements).
    By default TTFT p50s; `computed_tokens_measured`/`_predicted` give the prompt tokens the engine computed."""
    cells: dict[tuple[str, int], tuple[list[float], list[float]]] = {}
    for rows in predictions:
        for p in rows:
            if p.get(measured):
                measured_values, predicted_values = cells.setdefault((p["mode"], p["concurrency"]), ([], []))
                measured_values.append(p[measured])
                predicted_values.append(p[predicted])
    return dict(sorted(cells.items(), key=lambda kv: (kv[0][1], kv[0][0])))


def bench_rows(
    cells: dict[tuple[str, int], tuple[list[float], list[float]]],
    name: str = "bench",
    metric: str = "ttft_p50",
    unit: str = "s",
) -> list[Row]:
    """One row per cell: median predicted vs median measured ("published"), the measured range in the note."""
    return [
        _row(
            name,
            f"{metric} {mode} c={c}",
            float(np.median(measured)),
            float(np.median(predicted)),
            False,
            f"{len(measured)} run(s); measured {min(measured):.3g}-{max(measured):.3g} {unit}",
        )
        for (mode, c), (measured, predicted) in cells.items()
    ]


def step_rows(checks: dict[tuple[str, int], dict], name: str = "bench-steps") -> list[Row]:
    """One row per cell and kind of step: the engine's measured seconds ("published") vs the step model's on
    the same batches (`kvprefetch.sim.stepcheck`)."""
    rows = []
    for (mode, c), check in checks.items():
        waiting, idle = check["sched_ms_waiting"], check["sched_ms_idle"]
        sched = f"scheduler {idle or 0:.2f} ms/step" + (f", {waiting:.2f} with requests waiting" if waiting else "")
        if check.get("helper_cpu_s") is not None:
            sched += f"; connector threads {check['helper_cpu_s']:.2f} s CPU in the cell"
        for kind in ("decode", "prefill"):
            t = check[kind]
            if t.steps and t.model_s > 0:
                rows.append(_row(name, f"step_s {kind} {mode} c={c}", t.measured_s, t.model_s, False,
                                 f"{t.steps} steps; {sched}"))  # fmt: skip
    return rows


def print_rows(
    rows: Sequence[Row],
    console: Console | None = None,
    title: str = "simulated vs published",
    reference: str = "published",
) -> None:
    """`reference` names the column simulated values are compared against (the bench's rows are measured ones)."""
    table = Table(title=title)
    for col in ("scenario", "metric", reference, "simulated", "error %", "fitted"):
        table.add_column(col, justify="right" if col not in ("scenario", "metric") else "left")
    for r in rows:
        table.add_row(
            r.scenario,
            r.metric,
            f"{r.published:.3g}",
            f"{r.simulated:.3g}",
            f"{r.error_pct:+.1f}",
            "yes" if r.fitted else "",
        )
    (console or Console()).print(table)


def write_json(rows: Sequence[Row], path: str | Path) -> None:
    Path(path).write_text(json.dumps([asdict(r) for r in rows], indent=2) + "\n")
