"""The two-instance scenario (`--scenario two-instance`, modes shared-2x and private-2x): two engines on one node
at once, each session's turns alternating between them (`kvprefetch.bench.modes.route_turn`), with one shared
node-local cache (shared-2x) or a cache each (private-2x); one round each, after the single scenario's cells.
Its rows carry the engines and the requests each served; it adds no section to results.json.
"""

from __future__ import annotations

import shutil
from dataclasses import replace

from kvprefetch.bench.lab import Lab
from kvprefetch.bench.modes import TWO_INSTANCE_MODES, kv_transfer_config, route_turn, two_instance_caches
from kvprefetch.bench.plan import BenchPlan
from kvprefetch.bench.populate import Populated, remove_pool
from kvprefetch.bench.scenarios.base import Scenario, Sections, Stage
from kvprefetch.testbed.alternating import drive_alternating, session_plan
from kvprefetch.testbed.client import EngineError, EngineProcess
from kvprefetch.tiers.disk import link_tree

ENGINES = 2


class TwoInstance(Scenario):
    kind = "two-instance"

    def plan(self, plan: BenchPlan) -> Stage | None:
        """The two-instance modes the run asks for (a single run may ask for them too), one round each."""
        if plan.opts.scenario.kind not in ("single", "two-instance"):
            return None
        modes = tuple(m for m in plan.running if m in TWO_INSTANCE_MODES)
        if not modes:
            return None
        return Stage(self.kind, modes, plan.stage_seconds(modes, ENGINES, 1))

    def run(self, lab: Lab, population: Populated, stage: Stage) -> Sections:
        for mode in stage.modes:
            run_mode(lab, population, mode)
        return {}


def run_mode(lab: Lab, pop: Populated, mode: str) -> None:
    """One mode's two engines started on their caches (hard-linked copies of the populated tier), its cells run
    (one round), everything it made removed."""
    plan, files = lab.plan, lab.files
    caches = two_instance_caches(mode, files.work, f"kvb-{files.run_id}", ENGINES)
    engines: list[EngineProcess] = []
    try:
        try:
            for d in dict.fromkeys(d for d, _ in caches):
                link_tree(files.populated, d)
            # the same DRAM on the node either way: one pool as large as the private pools together
            shared = len(set(caches)) == 1
            sizing = replace(pop.sizing, dram_bytes=pop.sizing.dram_bytes * len(caches)) if shared else pop.sizing
            for e, (d, pool) in enumerate(caches):
                spec = plan.engine_spec(kv_transfer_config(mode, sizing, d, pool), cgroup=lab.cgroup())
                engines.append(lab.start(f"{mode}-{e}", spec))
        except EngineError as err:
            lab.start_failed(mode, err)
            return
        lab.run_cells(mode, " on 2 engines", lambda c: _cell(lab, mode, engines, c))
    finally:
        for eng in engines:
            eng.close()
        for d, pool in dict.fromkeys(caches):
            remove_pool(pool)
            shutil.rmtree(d, ignore_errors=True)


def _cell(lab: Lab, mode: str, engines: list[EngineProcess], c: int) -> tuple[dict, dict]:
    """One level from cold engines, its turns alternating between them."""
    plan = lab.plan
    for eng in engines:
        lab.reset(eng, mode, c)
    res = drive_alternating(engines, session_plan(plan.workload.levels[c]), c, plan.opts.cell_timeout_s,
                            f"{mode}-c{c}", file=str(lab.files.workload), level=c,
                            route=lambda i, k: route_turn(k, len(engines)))  # fmt: skip
    per_engine = [sum(1 for r in res["records"] if r.get("engine") == e) for e in range(len(engines))]
    return res, {"engines": len(engines), "requests_per_engine": per_engine}
