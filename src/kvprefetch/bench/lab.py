"""The bench's lab: what every scenario runs on (`kvprefetch.bench.scenarios`).

A `Lab` holds the run's plan and files and the verbs that start, warm up, reset and pace engines, and it collects
what the run writes: one row per cell and round (validated as written, `CellRow`), and notes. A scenario drives
its engines through these verbs and nothing else of the runner: it never sees another scenario, and the runner
never sees its engines.
"""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Callable
from typing import Any, Literal

from pydantic import ConfigDict

from kvprefetch.bench.plan import EST_PREFILL_TPS, BenchPlan
from kvprefetch.bench.populate import Populated, RunFiles
from kvprefetch.bench.regime import Throttle
from kvprefetch.bench.stats import cell_metrics
from kvprefetch.results import Row
from kvprefetch.testbed import protocol as P
from kvprefetch.testbed.client import EngineError, EngineProcess

ENGINE_SETTLE_S = 1.5
"""Pause before a cell with the gpu-node topology when another engine ran last: vLLM's shared-memory queues
between an engine and its worker busy-poll for 1 s after their last message, so that engine keeps the model's
cores busy that long (a deployment runs one engine per accelerator and never sees it). Counted from when the other
engine finished; a cell after one of its own engine's (the levels of a mode follow each other) needs none."""
START_FAILURES = (EngineError, RuntimeError, OSError, TimeoutError)
"""What an engine's start may raise that fails its mode's rows and not the run."""

Cell = Callable[[int], tuple[dict, dict]]
"""One level of a mode: run at concurrency c, it returns (the engine's result, the row's extra fields)."""


class CellRow(Row):
    """One run of a cell (a round) as results.json's `runs` holds it: the reader's `Row` with what the writer
    adds, checked when the row is written, so that a scenario that writes a malformed row fails there and not in
    a report. Every other figure (`kvprefetch.bench.stats.cell_metrics`, a scenario's own) passes through."""

    model_config = ConfigDict(extra="allow", frozen=True)

    status: Literal["ok", "failed", "unavailable"] = "ok"
    workload: str
    regime: float | str
    round: int = 0
    reason: str | None = None


class Progress:
    """Weighted steps (estimated seconds); the callback gets (description, done, total)."""

    def __init__(self, callback: Callable[[str, float, float], None] | None):
        self.cb = callback
        self.total = 0.0
        self.done = 0.0

    def plan(self, seconds: float) -> None:
        self.total += seconds
        self.update("")

    def update(self, desc: str, advance: float = 0.0) -> None:
        self.done = min(self.total, self.done + advance)
        if self.cb is not None:
            self.cb(desc, self.done, self.total)


class Lab:
    """A run's engines' verbs and what the run collects (`rows`, `notes`)."""

    def __init__(self, plan: BenchPlan, files: RunFiles, progress: Progress, on_row: Callable[[dict], None],
                 log: Callable[[str], None], throttle: Throttle | None = None):  # fmt: skip
        self.plan, self.files, self.progress, self.on_row, self.log = plan, files, progress, on_row, log
        self.throttle = throttle  # the regime's kernel read throttle (None: native, or none here)
        self.rows: list[dict] = []  # every cell of every round, in the order run
        self.notes: list[str] = []
        self.regime: float | str = plan.opts.regime if plan.opts.regime is not None else "native"  # of the cells now
        self.population: Populated | None = None  # what phase 1 measured and made, once it has run
        self._last_active: tuple[str, float] | None = None  # the engine that last ran something, and when

    def cgroup(self) -> str | None:
        """The cgroup an engine starts in, so that the regime's throttle holds its reads (None: none)."""
        return str(self.throttle.path) if self.throttle is not None else None

    # -- engines ------------------------------------------------------------------------------------------------
    def start(self, name: str, spec: P.EngineSpec) -> EngineProcess:
        """An engine started and warmed up."""
        return self.warm_up(name, self.launch(name, spec))

    def launch(self, name: str, spec: P.EngineSpec) -> EngineProcess:
        """An engine launched, not yet ready: engines launched together start at once."""
        self.progress.update(f"{name}: starting engine")
        return EngineProcess(spec, self.files.work / f"engine-{name}.log", wait=False)

    def warm_up(self, name: str, eng: EngineProcess) -> EngineProcess:
        """A launched engine, once ready, warmed up; killed if it fails either."""
        try:
            eng.wait_ready()
            self.progress.update(f"{name}: warm-up", 20)
            eng.call(P.Warmup(n=2, tokens=min(512, self.plan.max_model_len // 2), vocab=self.plan.model.vocab_size))
        except BaseException:
            eng.kill()
            raise
        self.progress.update(f"{name}: warm-up done", 5)
        return eng

    def reset(self, eng: EngineProcess, name: str, c: int) -> None:
        """Empty the engine's prefix cache before a cell (each level starts cold); say so if vLLM refused."""
        if not eng.call(P.Reset()).reset:
            self.notes.append(f"{name} c={c}: the engine's prefix cache could not be reset; the cell starts warm")

    def ran(self, name: str) -> None:
        """Engine `name` ran something just now (`settle` counts from it)."""
        self._last_active = (name, time.monotonic())

    def settle(self, name: str) -> None:
        """With the gpu-node topology, wait until another engine that ran last has stopped polling the model's
        cores (`ENGINE_SETTLE_S` after it finished)."""
        last = self._last_active
        if self.plan.topology.kind != "gpu-node" or last is None or last[0] == name:
            return
        time.sleep(max(0.0, last[1] + ENGINE_SETTLE_S - time.monotonic()))

    # -- rows -----------------------------------------------------------------------------------------------------
    def run_cells(self, mode: str, where: str, cell: Cell, round_: int = 0,
                  tags: dict[str, Any] | None = None) -> None:  # fmt: skip
        """One run per concurrency level: `cell(c)` runs it and returns (engine result, extra row fields);
        an engine error fails that run only. Every row carries `tags` (its engine's size)."""
        plan, pop = self.plan, self.population
        tps = pop.tps if pop is not None else EST_PREFILL_TPS
        chunk_tokens = pop.chunk_tokens if pop is not None else plan.opts.store.chunk_tokens
        for c in plan.opts.concurrency:
            est = plan.cell_estimate(mode, c, tps)
            self.progress.update(f"{mode} @ concurrency {c}: {plan.workload.requests(c)} requests{where}")
            try:
                res, extra = cell(c)
                metrics = cell_metrics(res, chunk_tokens)
                row = {"mode": mode, "concurrency": c, "status": "ok"} | metrics | extra
                with contextlib.suppress(OSError):
                    row["loadavg_1m"] = os.getloadavg()[0]
            except EngineError as err:
                self.notes.append(f"{mode} @ {c}: {str(err)[:2000]}")
                row = {"mode": mode, "concurrency": c, "status": "failed", "reason": str(err).splitlines()[0]}
            self.add_row(row | (tags or {}) | {"round": round_})
            self.progress.update(f"{mode} @ concurrency {c} done", est)

    def unavailable(self, mode: str, reason: str, tags: dict[str, Any] | None = None,
                    status: str = "unavailable") -> None:  # fmt: skip
        """A row per level saying the mode did not run, and why."""
        for c in self.plan.opts.concurrency:
            self.add_row({"mode": mode, "concurrency": c, "status": status, "reason": reason} | (tags or {}))

    def start_failed(self, mode: str, err: BaseException, tags: dict[str, Any] | None = None) -> None:
        self.notes.append(f"{mode}: engine failed to start: {str(err)[:2000]}")
        self.unavailable(mode, "engine start failed", tags, status="failed")

    def add_row(self, row: dict) -> None:
        """One run of a cell (a round), checked (`CellRow`); results.json's `rows` are their aggregates
        (`kvprefetch.bench.rounds`)."""
        row = {"workload": self.plan.workload.name, "regime": self.regime} | row
        CellRow.model_validate(row)
        self.rows.append(row)
        self.on_row(row)
