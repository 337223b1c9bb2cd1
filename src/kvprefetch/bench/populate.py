"""Phase 1 of a bench run: one engine with the kvprefetch connector measures prefill speed on fresh prompts,
runs the workload's prelude (the conversations so far), which writes their KV to a disk tier, then measures cold
disk -> DRAM reads, sets the regime's read throttle and measures them again (the regime obtained), and each
further regime of a sweep. Its value, `Populated`, is what the modes' phase starts from.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, NamedTuple

from kvprefetch.bench.modes import StoreSizing, kvprefetch_extra
from kvprefetch.bench.plan import BenchPlan
from kvprefetch.bench.regime import measured_regime, stream_bps, target_bps, whitepaper_r2
from kvprefetch.bench.stats import cell_metrics
from kvprefetch.sim.scenarios import PARALLEL_READS
from kvprefetch.testbed import protocol as P
from kvprefetch.testbed.client import EngineProcess
from kvprefetch.vllm.settings import transfer_config
from kvprefetch.workload.replay import apply_utilisation

Sweep = list[tuple[float | str, int | None]]  # further regimes: (label, read throttle bps)


class Chunk(NamedTuple):
    """A chunk as the populating engine's connector makes it: its tokens (the asked size as whole engine blocks)
    and its bytes."""

    tokens: int
    nbytes: int


@dataclass(frozen=True)
class RunFiles:
    """Where a run keeps its files: the temp dir (disk tiers, engine logs), the workload file the engines read,
    and the prefix of every DRAM pool it makes (removed by prefix whatever step was interrupted)."""

    run_id: str
    work: Path

    @property
    def workload(self) -> Path:
        return self.work / "workload.json"

    @property
    def populated(self) -> Path:
        return self.work / "populated"

    def pool(self, name: str) -> str:
        return f"kvb-{self.run_id}-{name}"


@dataclass(frozen=True)
class Populated:
    """What phase 1 measured and made: the disk tier in `RunFiles.populated`, and the figures the cells and the
    report need."""

    tps: float  # prefill tokens/s
    chunk_tokens: int  # the connector's, as it chunks (the asked size as whole engine blocks): every per-chunk figure's
    calibrate: P.Calibrate  # the calibration asked of the populating engine (the mode engines repeat it)
    chunk_bytes: int
    engine_block_tokens: int | None
    regime: dict[str, Any]  # results.json's "regime"
    sweep: Sweep
    sweep_info: list[dict]  # results.json's "sweep"
    info: dict[str, Any]  # results.json's "populate"
    placement: dict[str, Any]  # which cores the populating engine's threads were seen on
    sizing: StoreSizing  # the plan's, with the regime's read limits and the measured priors
    notes: list[str] = field(default_factory=list)


Say = Callable[[str, float], None]  # a progress step: (description, estimated seconds it took)


def populate(plan: BenchPlan, files: RunFiles, throttle, why: str, start: Callable[[str, P.EngineSpec],
             EngineProcess], say: Say, log: Callable[[str], None]) -> Populated:  # fmt: skip
    """Fill the disk tier with the prelude, measure the engine's speeds, the native disk and the throttled one
    (the regime), and the sweep's regimes."""
    o, w = plan.opts, plan.workload
    extra = kvprefetch_extra(plan.sizing, files.populated, files.pool("populate"), prefetch=True)
    spec = plan.engine_spec(transfer_config(extra | {"load_policy": "always"}),
                            cgroup=str(throttle.path) if throttle else None)
    eng = start("populate", spec)
    try:
        say("measuring prefill speed", 0)
        ask = P.Calibrate(prompt_tokens=max(o.store.chunk_tokens, round(w.mean_prompt_tokens())), repeats=5,
                          decode_tokens=32, vocab=plan.model.vocab_size)  # fmt: skip
        cal = eng.call(ask)
        tps = P.Calibration.model_validate(cal).prefill_tokens_per_s
        _scale_trace_times(plan, files, tps, log)
        say(f"prefill {tps:,.0f} tok/s; populating the store", 15)
        prelude, notes = _prelude(plan, files, eng)
        say("measuring disk reads", w.prelude_tokens() / 3000.0)
        counters: P.CountersReply = eng.call(P.Counters())
        placement = eng.call(P.Placements())
        geometry: P.GeometryReply = eng.call(P.Geometry())
        tokens = geometry.chunk_tokens or o.store.chunk_tokens
        chunk = Chunk(tokens, int(geometry.chunk_bytes or tokens * plan.model.bytes_per_token))
        regime, sizing = measure_regime(plan, eng, throttle, why, cal, tps, chunk)
        sweep, sweep_info, skipped = probe_sweep(plan, eng, throttle, tps, chunk, regime, sizing)
        say("populated", 20)
    finally:
        eng.close()
        remove_pool(files.pool("populate"))
    info = {"prelude": {k: v for k, v in prelude.items() if k != "ttft_samples_s"}, "calibration": cal,
            "chunks_on_disk": count_chunks(files.populated), "store_counters": counters.store}  # fmt: skip
    return Populated(tps=tps, chunk_tokens=chunk.tokens, calibrate=ask, chunk_bytes=chunk.nbytes,
                     engine_block_tokens=geometry.block_size,
                     regime=regime, sweep=sweep, sweep_info=sweep_info, info=info, placement=placement,
                     sizing=sizing, notes=notes + skipped)  # fmt: skip


def count_chunks(d: Path) -> int:
    from kvprefetch.tiers.disk import chunk_keys

    return len(chunk_keys(d))


def remove_pool(name: str) -> None:
    """Every DRAM pool file whose name holds `name` (a run's prefix removes all of its pools)."""
    import contextlib

    from kvprefetch.tiers.dram import SHM_DIR, hugetlbfs_mount

    for base in (SHM_DIR, hugetlbfs_mount()):
        if base is None:
            continue
        for f in Path(base).glob(f"*{name}*"):
            with contextlib.suppress(OSError):
                f.unlink()


def _scale_trace_times(plan: BenchPlan, files: RunFiles, tps: float, log: Callable[[str], None]) -> None:
    """A trace replayed at its timestamps: its times scaled to the utilisation asked, at the speed measured."""
    trace, w = plan.opts.workload.trace, plan.workload
    if trace is None or not trace.use_timestamps or not trace.utilisation:
        return
    factor = apply_utilisation(w, tps, trace.utilisation)
    files.workload.write_text(json.dumps(w.to_json()))
    log(f"trace times x {factor or 1:.3g}: recomputing each level would keep the engine "
        f"{100 * trace.utilisation:.0f}% busy at {tps:,.0f} prefill tokens/s")  # fmt: skip


def _prelude(plan: BenchPlan, files: RunFiles, eng: EngineProcess) -> tuple[dict, list[str]]:
    """The conversations so far run, their KV saved and flushed to disk; its metrics and a note if any failed."""
    o = plan.opts
    res = eng.call(P.Run(file=str(files.workload), level="prelude", concurrency=max(o.concurrency), flush=True,
                         tag="prelude", timeout_s=o.cell_timeout_s))  # fmt: skip
    prelude = cell_metrics(res)
    errors, samples = prelude.get("errors"), prelude.get("error_samples")
    return prelude, [f"prelude: {errors} requests failed ({samples})"] if errors else []


def _probe(eng: EngineProcess, bps: int | None, threads: int, sizing: StoreSizing) -> P.Bandwidth:
    """Cold disk reads at the regime `bps` (the throttle already set to it), `threads` in flight, each stream
    capped as the emulated array caps it (and by the I/O engine's own limit where the kernel's is missing:
    `sizing.read_rate_limit_bps`, the asked regime's; a sweep needs the kernel's)."""
    return eng.call(P.DiskBandwidth(max_chunks=256, seconds=8.0, threads=threads, stream_bps=stream_bps(bps),
                                    rate_limit_bps=sizing.read_rate_limit_bps))  # fmt: skip


def emulated_array(sizing: StoreSizing, bps: int) -> tuple[StoreSizing, dict[str, Any]]:
    """Storage as the whitepaper's array: full bandwidth `bps` only with reads in parallel, one read stream
    capped at its share (`regime.stream_bps`), so one read in flight (`ondemand-serial`) gets what R1's serial
    reads got; the parallel modes keep `PARALLEL_READS` reads in flight, as its parallel reader did. The sizing
    with those limits, and what the regime records of them."""
    stream = stream_bps(bps)
    sizing = replace(sizing, read_stream_bps=int(stream) if stream else None,
                     io_threads=max(sizing.io_threads, PARALLEL_READS))  # fmt: skip
    return sizing, {"stream_read_bps": stream, "array_streams": whitepaper_r2().streams,
                    "io_threads": sizing.io_threads}  # fmt: skip


def measure_regime(plan: BenchPlan, eng: EngineProcess, throttle, why: str, cal: dict, tps: float,
                   chunk: Chunk) -> tuple[dict[str, Any], StoreSizing]:  # fmt: skip
    """The native disk rate, then the asked regime's throttle set and measured (the regime obtained); the
    regime as results.json records it, and the sizing the mode engines start with."""
    o, chunk_bytes, chunk_tokens = plan.opts, chunk.nbytes, chunk.tokens
    native = eng.call(P.DiskBandwidth(max_chunks=128, seconds=8.0))
    figures = P.Calibration.model_validate(cal)

    def measured(bps: float | None) -> float | None:
        return measured_regime(tps, chunk_tokens, chunk_bytes, bps) if bps else None

    regime = _asked(plan) | {
        "prefill_tokens_per_s": tps, "decode_step_s": figures.decode_step_s,
        "calibration_foreign_cpu_cores": figures.foreign_cpu_cores, "chunk_tokens": chunk_tokens,
        "chunk_bytes": chunk_bytes, "native_read_bps": native.bps, "native_regime": measured(native.bps),
    }  # fmt: skip
    sizing = plan.sizing
    if o.regime is None:
        regime |= {"enforced_by": "none", "read_bps": native.bps, "measured": measured(native.bps)}
        return regime, replace(sizing, prefill_tps_prior=tps, disk_bps_prior=native.bps)
    bps = target_bps(o.regime, chunk_bytes / chunk_tokens, tps)
    sizing, array = emulated_array(sizing, bps)
    if throttle is not None:
        throttle.set(bps)
        enforced = f"{throttle.kind} {throttle.device} ({throttle.path})"
    else:
        sizing = replace(sizing, read_rate_limit_bps=bps)
        enforced = f"kvprefetch I/O engine read_rate_limit_bps (kernel: {why})"
    probe = _probe(eng, bps, sizing.io_threads, sizing)
    serial = _probe(eng, bps, 1, sizing)
    regime |= {"target_read_bps": bps} | array | {
        "enforced_by": enforced, "read_bps": probe.bps, "serial_read_bps": serial.bps,
        "measured": measured(probe.bps), "measured_serial": measured(serial.bps)}  # fmt: skip
    return regime, replace(sizing, prefill_tps_prior=tps, disk_bps_prior=probe.bps)


def _asked(plan: BenchPlan) -> dict[str, Any]:
    """The regime's part that the options decide (results.json's regime starts with it)."""
    o = plan.opts
    return {"asked": o.regime if o.regime is not None else "native", "whitepaper_r2": whitepaper_r2().sentence()}


def probe_sweep(plan: BenchPlan, eng: EngineProcess, throttle, tps: float, chunk: Chunk, regime: dict,
                sizing: StoreSizing) -> tuple[Sweep, list[dict], list[str]]:  # fmt: skip
    """The further regimes of a sweep, each set on the kernel throttle and measured with the populating
    engine's cold reads; the throttle is then set back to the run's regime. A sweep needs the kernel
    throttle: the I/O engine's own cap is fixed when an engine starts. The regimes, what each measured, and
    notes on those left out."""
    out: Sweep = []
    info, notes = [], []
    for r in plan.opts.sweep:
        label = r if r is not None else "native"
        if r is not None and throttle is None:
            notes.append(f"regime {label} left out of the sweep: no kernel read throttle here")
            continue
        bps = None if r is None else target_bps(r, chunk.nbytes / chunk.tokens, tps)
        if throttle is not None:
            throttle.set(bps)
        read_bps = regime.get("native_read_bps") if r is None else _probe(eng, bps, sizing.io_threads, sizing).bps
        measured = measured_regime(tps, chunk.tokens, chunk.nbytes, read_bps) if read_bps else None
        info.append({"asked": label, "target_read_bps": bps, "read_bps": read_bps, "measured": measured})
        out.append((label, bps))
    if throttle is not None:
        throttle.set(regime.get("target_read_bps"))
    return out, info, notes


def seed_remote(plan: BenchPlan, files: RunFiles, mode: str, eng: EngineProcess,
                say: Callable[[str, float], None]) -> str:  # fmt: skip
    """The prelude's chunks copied into the remote tier (its disk tier starts empty); the note saying so."""
    from kvprefetch.tiers.disk import link_tree

    backend = plan.opts.store.remote_backend
    src = files.work / f"seed-{mode}"
    link_tree(files.populated, src)
    try:
        say(f"{mode}: copying the prelude's chunks into {backend}", 0)
        res: P.Seeded = eng.call(P.SeedRemote(src=str(src)), timeout=1800)
    finally:
        shutil.rmtree(src, ignore_errors=True)
    return (f"{mode}: {res.written} of {res.chunks} prelude chunks put in {backend} ({res.seconds:.1f}s; the rest "
            "were in its DRAM already, from the warm-up); its disk tier started empty; remote reads are not under "
            "the regime's disk throttle")  # fmt: skip
