"""The contract every scenario of `kvprefetch bench` keeps (`kvprefetch.bench.scenarios` registers them).

A scenario is asked three things, in the pipeline's order:

- `plan(plan)`: which of the run's modes it runs and about how long it takes (a `Stage`), or None when the run
  is not its (`kvprefetch.bench.plan.BenchPlan` already holds the options, the model, the workload and the modes
  that can run here). Planning runs nothing.
- `run(lab, population, stage)`: its cells, on engines it starts through the `Lab` (`kvprefetch.bench.lab`) from
  the store phase 1 populated (`kvprefetch.bench.populate.Populated`). Its rows go to the lab as each cell ends
  (the live display prints them); it returns the sections of results.json that are its own (`Sections`).
- `report(results)`: report.md's lines that are its own, from results.json alone (a run reported again later
  has nothing else).

A scenario imports neither another scenario nor the runner: what two share lives below them (the lab, the
testbed, `kvprefetch.bench.modes`).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any, ClassVar

from kvprefetch.bench.lab import Lab
from kvprefetch.bench.plan import BenchPlan
from kvprefetch.bench.populate import Populated

Sections = dict[str, Any]
"""Top-level sections of results.json a scenario adds (`two_node`, `mode_calibrations`), by key."""


@dataclass(frozen=True)
class Stage:
    """What a scenario will run of a bench run: its modes (those that can run here), and the seconds the
    progress bar expects it to take."""

    kind: str
    modes: tuple[str, ...]
    seconds: float


class Scenario(ABC):
    """One way of running the bench's modes on engines (see the module's docstring)."""

    kind: ClassVar[str]  # its name in the registry and in `BenchOptions.scenario.kind`

    @abstractmethod
    def plan(self, plan: BenchPlan) -> Stage | None: ...

    @abstractmethod
    def run(self, lab: Lab, population: Populated, stage: Stage) -> Sections: ...

    def report(self, results: dict) -> list[str]:
        """report.md's lines of this scenario's own ([]: the shared tables say everything)."""
        return []
