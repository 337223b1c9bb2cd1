"""The single scenario: one engine per mode (and per engine KV size of an engine-memory sweep), modes x levels x
regimes x rounds.

Per mode, a new engine on its own hard-linked copy of the populated disk tier (so no mode sees another's writes)
and an empty DRAM pool of its own; warm-up; `dram` mode then reads the whole disk tier into DRAM; then each regime's
rounds, the modes interleaved within a round, each level on its own sessions with the engine's prefix cache reset
in between; then, for the modes the simulator replays, phase 1's speed measurements once more in that engine (the
replay's calibration pools every engine's). Its section of results.json: `mode_calibrations`.
"""

from __future__ import annotations

import json
import math
import shutil
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from pydantic import BaseModel

from kvprefetch.bench.lab import START_FAILURES, Lab
from kvprefetch.bench.modes import (
    CONNECTOR_MODES,
    PEER_MODES,
    REMOTE_MODES,
    TWO_INSTANCE_MODES,
    StoreSizing,
    kv_transfer_config,
    lmcache_env,
    remote_section,
)
from kvprefetch.bench.plan import CALIBRATE_EST_S, BenchPlan, EngineSize
from kvprefetch.bench.populate import Populated, RunFiles, remove_pool, seed_remote
from kvprefetch.bench.regime import stream_bps
from kvprefetch.bench.scenarios.base import Scenario, Sections, Stage
from kvprefetch.modes import MODE
from kvprefetch.modes import SIMULATED as BENCH_MODES
from kvprefetch.testbed import protocol as P
from kvprefetch.testbed.client import EngineError, EngineProcess
from kvprefetch.tiers.disk import link_tree

WARM_TTL_S = 30.0  # the warm mode's ttl_s (the API's default)


class LeaseFigures(BaseModel):
    """What a cell's agent figures say of the leases' DRAM (`kvprefetch.testbed.agent_client`)."""

    lease_peak_reserved_keys: int
    lease_budget_keys: int


@dataclass
class ModeEngine:
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


class Single(Scenario):
    kind = "single"

    def plan(self, plan: BenchPlan) -> Stage | None:
        """Every running mode but the two-instance ones, at each engine size, in every regime and round."""
        if plan.opts.scenario.kind not in ("single", "two-instance"):
            return None
        modes = tuple(m for m in plan.running if m not in TWO_INSTANCE_MODES)
        o, engines = plan.opts, len(plan.sizes)
        rounds = o.repeats * (1 + len(o.sweep)) * engines
        return Stage(self.kind, modes, plan.stage_seconds(modes, engines, rounds))

    def run(self, lab: Lab, population: Populated, stage: Stage) -> Sections:
        return {"mode_calibrations": SingleRun(lab, population).run(stage.modes)}


class SingleRun:
    """The scenario's phases on one run: every mode's engine opened, each regime's rounds, the engines closed
    (each simulated mode's measured first); `run` returns the modes' calibrations."""

    def __init__(self, lab: Lab, pop: Populated):
        self.lab, self.pop, self.plan = lab, pop, lab.plan
        self.calibrations: dict[str, dict] = {}  # the simulated modes' engines, each after its cells

    def run(self, modes: tuple[str, ...]) -> dict[str, dict]:
        """Every mode's engine opened at once on its copy of the populated store, then each regime's rounds, the
        modes interleaved within a round."""
        opened: dict[str, ModeEngine] = {}
        try:
            launched = [self._launch(m, size, opened) for size in self.plan.sizes for m in modes]
            for me in launched:
                if me is not None and not self._ready(me):
                    del opened[me.name]
            for label, bps in [(self.pop.regime["asked"], self.pop.regime.get("target_read_bps")), *self.pop.sweep]:
                self._run_regime(opened, label, bps)
        except BaseException:  # a failure or SIGINT/SIGTERM: close the engines now, without calibrating them
            for me in opened.values():
                self._close(me, calibrate=False)
            raise
        for me in opened.values():
            self._close(me)
        return self.calibrations

    def _run_regime(self, opened: dict[str, ModeEngine], label: float | str, bps: int | None) -> None:
        """One regime's rounds on the open engines, the modes interleaved within a round."""
        o, sweep, lab = self.plan.opts, self.pop.sweep, self.lab
        lab.regime = label
        if lab.throttle is not None:
            lab.throttle.set(bps)
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
                lab.run_cells(me.mode, where, lambda c, me=me, k=k: self._cell(me, c, k), k, me.tags)

    # -- an engine's life -----------------------------------------------------------------------------------------
    def _launch(self, mode: str, size: EngineSize, opened: dict[str, ModeEngine]) -> ModeEngine | None:
        """The mode's engine at `size` launched (not waited for: the modes' engines start at once), on its own
        copy of the populated disk tier and its own DRAM pool, and entered in `opened` (closed from there if the
        run stops); None if it failed to launch, or its size cannot start vLLM (its rows say so)."""
        plan, files, lab = self.plan, self.lab.files, self.lab
        name = f"{mode}@{size.label}" if plan.engine_sizes else mode
        if not size.fits:
            why = (f"engine KV of {size.tokens:,} tokens is below one request of max_model_len "
                   f"{plan.max_model_len:,} and the block vLLM reserves: vLLM does not start")  # fmt: skip
            lab.unavailable(mode, why, size.tags())
            return None
        slug = engine_slug(name)
        me = opened[name] = ModeEngine(mode, size, name, None, files.pool(slug), files.work / f"disk-{slug}")
        sizing = dram_sizing(plan, self.pop) if mode == "dram" else self.pop.sizing
        if mode in CONNECTOR_MODES:
            link_tree(files.populated, me.disk)
        else:
            me.disk.mkdir(parents=True, exist_ok=True)
        remote = None
        try:
            if mode in REMOTE_MODES:
                me.server, remote = start_remote_server(plan, self.pop, mode, files, lab.progress.update)
            env = lmcache_env(sizing, me.disk) if mode == "lmcache" else None
            spec = plan.engine_spec(kv_transfer_config(mode, sizing, me.disk, me.pool, remote=remote),
                                    cgroup=lab.cgroup(), env=env, kv_cache_bytes=size.bytes)  # fmt: skip
            me.eng = lab.launch(name, spec)
        except START_FAILURES as err:
            self._failed(opened.pop(name), err)
            return None
        return me

    def _ready(self, me: ModeEngine) -> bool:
        """A launched mode's engine ready and warmed up, its remote peer seeded, its starting state prepared
        (`_prepare`); False if it failed (closed, its rows say so)."""
        assert me.eng is not None
        lab = self.lab
        try:
            lab.warm_up(me.name, me.eng)
            if me.mode in REMOTE_MODES:
                lab.notes.append(seed_remote(self.plan, lab.files, me.mode, me.eng, lab.progress.update))
        except START_FAILURES as err:
            self._failed(me, err)
            return False
        self._prepare(me)
        lab.ran(me.name)  # its warm-up (and preload or prelude) just ran
        return True

    def _failed(self, me: ModeEngine, err: BaseException) -> None:
        self._close(me, calibrate=False)
        self.lab.start_failed(me.mode, err, me.tags)
        rounds = self.plan.opts.repeats
        self.lab.progress.update(f"{me.mode}: failed", self.plan.mode_estimate(me.mode, self.pop.tps, rounds))

    def _prepare(self, me: ModeEngine) -> None:
        """A mode's starting state: every chunk in DRAM (`dram`), or the prelude in a peer's own store."""
        assert me.eng is not None
        o, lab = self.plan.opts, self.lab
        if me.mode == "dram":
            lab.progress.update("dram: reading every chunk into DRAM")
            pre: P.Preloaded = me.eng.call(P.PreloadDram())
            lab.notes.append(f"dram: {pre.in_dram} of {pre.chunks} chunks in DRAM before the run "
                             f"({pre.seconds:.1f}s)")  # fmt: skip
        if me.mode in PEER_MODES:  # a peer's connector keeps its own store: it runs the prelude into it
            lab.progress.update(f"{me.mode}: running the prelude in its own store")
            me.eng.call(P.Run(file=str(lab.files.workload), level="prelude", concurrency=max(o.concurrency),
                              tag="prelude", timeout_s=o.cell_timeout_s))  # fmt: skip

    def _close(self, me: ModeEngine, calibrate: bool = True) -> None:
        try:
            if me.eng is not None and calibrate and me.mode in BENCH_MODES and self.plan.calibrates:
                self._calibrate(me.mode, me.eng)
        finally:
            if me.eng is not None:
                me.eng.close()
            if me.server is not None:
                me.server.kill()
            remove_pool(me.pool)
            shutil.rmtree(me.disk, ignore_errors=True)

    def _calibrate(self, mode: str, eng: EngineProcess) -> None:
        """The populate engine's calibration once more, in this mode's engine after its cells: one engine's
        samples on a shared machine are noisy, and the simulator's replay pools every engine's (see
        `kvprefetch.sim.calibration.pooled_calibration`)."""
        progress = self.lab.progress
        progress.update(f"{mode}: measuring its engine's speeds")
        try:
            seed = 10_000 * (1 + list(BENCH_MODES).index(mode))  # prompts no other engine saved
            self.calibrations[mode] = eng.call(self.pop.calibrate.model_copy(update={"seed": seed}))
        except EngineError as err:  # the cells are measured; a missing calibration only thins the pool
            self.lab.notes.append(f"{mode}: engine calibration failed: {str(err)[:500]}")
        progress.update(f"{mode}: engine measured", CALIBRATE_EST_S)

    # -- a cell ---------------------------------------------------------------------------------------------------
    def _cell(self, me: ModeEngine, c: int, round_: int) -> tuple[dict, dict]:
        """One level in one round, started cold: the engine's prefix cache reset and (but in `dram` mode) the
        DRAM tier emptied, so every round of a cell finds what the first found (the disk tier)."""
        o, lab = self.plan.opts, self.lab
        assert me.eng is not None
        lab.reset(me.eng, me.name, c)
        if me.mode in CONNECTOR_MODES and me.mode != "dram":
            me.eng.call(P.CoolDram())
        tag = f"{me.slug}-c{c}" + (f"-r{round_}" if o.repeats > 1 else "")
        lab.settle(me.name)
        declared = self.plan.workload.declared  # each round's prompts new to every tier?
        fresh = declared.get("fresh_rounds", not declared.get("reuse", True))
        try:
            res = me.eng.call(P.Run(file=str(lab.files.workload), level=c, concurrency=c, tag=tag,
                                    timeout_s=o.cell_timeout_s, record_steps=o.files.step_log,
                                    salt=round_ if fresh else 0, **self._agent_args(me.mode)),
                              timeout=o.cell_timeout_s + 300)  # fmt: skip
        finally:
            lab.ran(me.name)
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
            args["pressure_life_s"] = self.plan.opts.workload.dram_life_s
        return args

    def _agent_row(self, mode: str, c: int, agent: dict | None) -> dict[str, Any]:
        """A cell's lease and warm-up figures; DRAM held by leases is checked against its budget here."""
        if not agent:
            return {}
        figures = LeaseFigures.model_validate(agent)
        within = figures.lease_peak_reserved_keys <= figures.lease_budget_keys
        if not within:
            self.lab.notes.append(f"{mode} @ {c}: leases reserved {figures.lease_peak_reserved_keys} DRAM slots, "
                                  f"above their budget of {figures.lease_budget_keys}")  # fmt: skip
        return agent | {"lease_within_budget": within}

    def _write_steps(self, tag: str, steps: list[dict] | None) -> None:
        """One JSON line per engine step of the cell (`--step-log`), beside results.json, as <tag>.jsonl."""
        out = self.plan.opts.files.out
        if steps is None or out is None:
            return
        folder = Path(out) / "steps"
        folder.mkdir(parents=True, exist_ok=True)
        (folder / f"{tag}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in steps))


def dram_sizing(plan: BenchPlan, pop: Populated) -> StoreSizing:
    """The `dram` mode's tiers: a DRAM tier that holds the whole disk tier and every cell's new chunks."""
    w = plan.workload
    total = pop.info["chunks_on_disk"] + math.ceil(
        (w.prompt_tokens() + 64 * sum(w.requests(c) for c in w.levels)) / pop.chunk_tokens
    )
    return replace(pop.sizing, dram_bytes=int((total + 64) * (pop.chunk_bytes + 8192) * 1.1))


def start_remote_server(plan: BenchPlan, pop: Populated, mode: str, files: RunFiles,
                        say: Callable[[str, float], None]) -> tuple[Any, dict]:  # fmt: skip
    """The remote mode's server on loopback, and the store config's remote section that reaches it."""
    from kvprefetch.testbed.local_servers import MooncakeMaster, RedisServer

    backend = plan.opts.store.remote_backend
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
