"""The simulator against our own benchmark: 'this CPU' calibrated from a `kvprefetch bench` run, and that
run's exact sessions replayed on it, mode by mode, to predict each cell's TTFT p50.

What the calibration takes from the run (measured by the bench in the populating engine before any mode runs, and
again in each simulated mode's engine after its cells; the speeds are medians over those engines): prefill time of
a fresh prompt and of new tokens on a cached prefix (together they separate the per-token cost from the attention
cost), the same prompt reloaded from the DRAM tier (the connector's load rate), decode steps of one short
sequence, of sixteen short ones (the per-sequence cost) and of four long ones (the KV read rate), the throttled
disk read rate, the engine's own sizes (KV capacity, KV block size, max_num_seqs, token budget), and the CPU
seconds the connector's threads spent per byte they moved while the prelude populated the store (on this CPU the
copies and I/O run on the cores the model computes on, so the replay charges them to the steps).
What the replay takes: the same sessions, turns, think times and the prelude that populated the disk tier,
rebuilt from the run's declared workload; chunks are identified by chained hashes of their tokens, exactly as
the store keys them; and each cell's share of the machine (the CPU other processes took during the cell against
during the calibration: `speed_factor`). Nothing is fitted to the TTFTs it predicts.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np

from kvprefetch.keys import ChunkKeyer, KVNamespace
from kvprefetch.modes import MODE, SIMULATED
from kvprefetch.results import BenchResults, PreludeCounters
from kvprefetch.sim.catalog import MODELS, Accelerator
from kvprefetch.sim.costs import Deployment
from kvprefetch.sim.engine import SimConfig, Simulator, StepLoads
from kvprefetch.sim.policy import Policy
from kvprefetch.sim.result import SimResult
from kvprefetch.sim.tiers import TierSpec
from kvprefetch.vllm.settings import ConnectorSettings
from kvprefetch.workload.replay import BenchWorkload, Session, workload_from_declared
from kvprefetch.workload.request import Request, TokenRecipe

MEASURED_DISK_LATENCY_S = 1e-4
"""The bench measures its disk tier's read rate, not its latency: a local disk's (estimate)."""

CONNECTOR_LOAD_MODE = ConnectorSettings.model_fields["load_mode"].default
"""The connector's `load_mode` where a mode leaves it unset (`kvprefetch.modes`)."""

BENCH_MODES: dict[str, Policy] = {mode: Policy(policy) for mode, policy in SIMULATED.items()}
"""The bench modes the replay predicts, each as the policy that models it (`kvprefetch.modes`)."""


@dataclass(frozen=True)
class Calibration:
    """Measured on the machine itself by `kvprefetch bench` (the run's calibration.json)."""

    prefill_tokens_per_s: float  # a fresh prompt of `prompt_tokens`, alone
    decode_step_s: float
    disk_read_gbps: float
    chunk_bytes: int
    chunk_tokens: int
    disk_streams: float = 1.0  # reads the disk needs in flight for disk_read_gbps (the bench's emulated array)
    io_depth: int | None = None  # reads in flight the run's connector kept (None: io.threads' default)
    model: str = "tiny-llama"
    token_budget: int = 2048
    prompt_tokens: int = 3541
    extend_tokens: int | None = None  # new tokens prefilled on a cached prefix of `extend_offset` tokens ...
    extend_offset: int | None = None
    extend_s: float | None = None  # ... in this many seconds
    decode_step_ctx: int = 256  # context of the decode_step_s sample
    request_floor_s: float | None = None  # time to first token of a 16-token prompt: front end + one step
    decode_batch: int | None = None  # this many sequences of decode_batch_ctx tokens decoding together ...
    decode_batch_ctx: int | None = None
    decode_batch_step_s: float | None = None  # ... take this long per step
    decode_wide: int | None = None  # this many short sequences (decode_step_ctx tokens) decoding together ...
    decode_wide_step_s: float | None = None  # ... take this long per step: the per-sequence cost
    reload_s: float | None = None  # time to first token of the prompt, `reload_tokens` of it loaded from DRAM
    reload_tokens: int | None = None
    engine_kv_tokens: int | None = None
    max_num_seqs: int = 256
    dram_bytes: int | None = None
    host_copy_gbps: float = 8.0  # DRAM pool -> engine KV when no reload was measured (a memcpy; estimate)
    io_cpu_s_per_byte: float | None = None  # the connector threads' CPU per byte they moved (the prelude's)
    # The model computed on every core, beside the connector's threads and the machine's other processes (`shared`
    # topology); False: on cores of its own (`gpu-node`), the rest of the engine and the host's work on the others
    shared_cores: bool = True
    engine_block_tokens: int | None = None  # vLLM's KV block size: its prefix cache hits are whole blocks of it
    engines: int = 1  # the speeds are medians over this many engines' calibrations (`pooled_calibration`)
    foreign_cpu_cores: float | None = None  # CPU the machine's other processes took while it calibrated, in cores
    machine_cpus: int | None = None

    @classmethod
    def load(cls, path: str | Path) -> Calibration:
        data = json.loads(Path(path).read_text())
        known = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in data.items() if k in known})


def charged_io_cpu(cal: Calibration) -> float:
    """The connector's CPU seconds per byte moved that the model's steps pay: all of it where its threads share
    the model's cores (`shared` topology, the default); none where they have cores of their own (`gpu-node`, as
    host threads beside a GPU, whose copies delay no forward pass)."""
    return (cal.io_cpu_s_per_byte or 0.0) if cal.shared_cores else 0.0


def request_overhead(cal: Calibration, step_overhead: float) -> float:
    """The engine's own time to add a request (the bench runs vLLM in-process, front end included): the floor
    sample less its one (tiny) engine step. Every sample of one request alone pays it once."""
    if not cal.request_floor_s:
        return 0.0
    return max(0.0, cal.request_floor_s - step_overhead)


def _chunked_prefill(budget: int, offset: int, tokens: int) -> tuple[int, float, float]:
    """(steps, pairs among new tokens, pairs against cached KV) of prefilling `tokens` after `offset` cached
    ones in budget-sized chunks."""
    steps, fresh, cached, done = 0, 0.0, 0.0, 0
    while done < tokens:
        n = min(budget, tokens - done)
        fresh += n * n / 2.0
        cached += n * (offset + done)
        steps += 1
        done += n
    return steps, fresh, cached


def cpu_deployment(cal: Calibration) -> Deployment:
    """A deployment whose step times reproduce the measured prefills (fresh, and on a cached prefix) and decodes.

    Step time = overhead + per-sequence cost x sequences + max(compute, memory). Compute = (linear FLOPs +
    attention among new tokens) / F + attention against cached KV / (F * attention efficiency): F and that
    efficiency come from the two prefill samples (a fresh prompt is mostly the first kind, new tokens on a long
    prefix mostly the second). The per-sequence cost (the serving loop's work per request: inputs, sampling,
    outputs) is what sixteen short sequences add over one. Memory = weights + the KV the step reads, at a
    bandwidth from the long batch (less its per-sequence cost); the overhead is what is left of the short
    decode step. The DRAM tier -> engine rate comes from the reloaded prompt (`_load_bandwidth`).
    """
    model = replace(MODELS[cal.model], kv_bytes_per_token_override=cal.chunk_bytes / cal.chunk_tokens)
    per_token = 2.0 * model.active_params
    per_pair = 4.0 * model.layers * model.heads * model.head_dim
    weights = model.dense_params * model.weight_bytes
    kv_per_token = model.kv_bytes_per_token
    overhead, bandwidth, per_seq = cal.decode_step_s, float("inf"), 0.0
    x = y = 0.0  # seconds per FLOP: linear and among new tokens; against cached KV
    for _ in range(5):  # the overhead and the compute rates depend on each other; this settles in a few rounds
        floor = request_overhead(cal, overhead)
        steps_c, fresh_c, cached_c = _chunked_prefill(cal.token_budget, 0, cal.prompt_tokens)
        t_cold = cal.prompt_tokens / cal.prefill_tokens_per_s - steps_c * overhead - floor
        x = y = t_cold / (per_token * cal.prompt_tokens + per_pair * (fresh_c + cached_c))
        if cal.extend_s and cal.extend_tokens and cal.extend_offset is not None:
            steps_e, fresh_e, cached_e = _chunked_prefill(cal.token_budget, cal.extend_offset, cal.extend_tokens)
            t_ext = cal.extend_s - steps_e * overhead - floor
            a = np.array([[per_token * cal.prompt_tokens + per_pair * fresh_c, per_pair * cached_c],
                          [per_token * cal.extend_tokens + per_pair * fresh_e, per_pair * cached_e]])  # fmt: skip
            xs, ys = np.linalg.solve(a, [t_cold, t_ext])
            if xs > 0 and ys > 0:  # else noise made the two samples inconsistent: one rate for both
                x, y = xs, ys
        mem_short = weights + cal.decode_step_ctx * kv_per_token
        if cal.decode_batch_step_s and cal.decode_batch and cal.decode_batch_ctx:
            mem_batch = weights + cal.decode_batch * cal.decode_batch_ctx * kv_per_token
            extra = cal.decode_batch_step_s - cal.decode_step_s - (cal.decode_batch - 1) * per_seq
            if extra > 0:
                bandwidth = (mem_batch - mem_short) / extra
        if cal.decode_wide_step_s and cal.decode_wide and cal.decode_wide > 1:
            wide_kv = (cal.decode_wide - 1) * cal.decode_step_ctx * kv_per_token
            wide_compute = (cal.decode_wide - 1) * (per_token * x + per_pair * cal.decode_step_ctx * y)
            wide_extra = cal.decode_wide_step_s - cal.decode_step_s - max(wide_compute, wide_kv / bandwidth)
            per_seq = max(0.0, wide_extra / (cal.decode_wide - 1))
        compute_short = per_token * x + per_pair * cal.decode_step_ctx * y
        overhead = max(0.0, cal.decode_step_s - max(compute_short, mem_short / bandwidth) - per_seq)
    cpu = Accelerator(
        "this-cpu",
        flops=1.0 / x,
        hbm_bytes=64e9,
        hbm_bw=bandwidth if np.isfinite(bandwidth) else 1e15,
        host_link_bw=cal.host_copy_gbps * 1e9,
        step_overhead_s=overhead,
        seq_overhead_s=per_seq,
        source="measured by kvprefetch bench (calibration.json)",
    )
    dep = Deployment(
        model,
        cpu,
        tp=1,
        efficiency=1.0,
        mem_efficiency=1.0,
        token_budget=cal.token_budget,
        max_seqs=cal.max_num_seqs,
        attention_efficiency=x / y,
        kv_capacity_tokens_override=cal.engine_kv_tokens,
    )
    copy_bw = _load_bandwidth(cal, dep)
    if copy_bw is None:
        return dep
    return replace(dep, accelerator=replace(cpu, host_link_bw=copy_bw))


def load_path_measured(cal: Calibration) -> bool:
    """The DRAM tier -> engine rate comes from the reloaded prompt (`_load_bandwidth`), which timed the whole
    load path, the CPU of the threads that copy included: a replay charges those copies no CPU per byte again."""
    return cal.reload_s is not None and cpu_deployment(cal).accelerator.host_link_bw != cal.host_copy_gbps * 1e9


def _load_bandwidth(cal: Calibration, dep: Deployment) -> float | None:
    """DRAM tier -> engine KV, bytes/s, from the reloaded prompt: its time to first token less the front end and
    the prefill of the tokens after the loaded ones. This is the connector's whole load path (pinning, copies
    layer by layer, the threads that do it on the engine's cores), not a bare memcpy."""
    if not (cal.reload_s and cal.reload_tokens):
        return None
    floor = request_overhead(cal, dep.accelerator.step_overhead_s)
    rest = cal.prompt_tokens - cal.reload_tokens
    compute = dep.prefill_time(rest, cal.reload_tokens) if rest > 0 else 0.0
    copy_s = cal.reload_s - floor - compute
    if copy_s <= 0:  # noise: the load hid under the compute entirely
        return None
    return cal.reload_tokens * dep.model.kv_bytes_per_token / copy_s


# ---- the bench's workload, as simulator requests -----------------------------------------------------------
def chunk_ids(tokens: list[int], chunk_tokens: int) -> tuple[int, ...]:
    """The store's chained keys of the full chunks (`ChunkKeyer`), as the simulator's integer block ids:
    equal ids mean an equal whole prefix."""
    return tuple(int.from_bytes(k[:8], "little") for k in ChunkKeyer(_REPLAY_NAMESPACE, chunk_tokens).keys(tokens))


_REPLAY_NAMESPACE = KVNamespace(model="bench-replay", num_layers=1, num_kv_heads=1, head_dim=1, dtype="float32")


def level_requests(sessions: list[Session], chunk_tokens: int) -> list[Request]:
    """One bench level's sessions (closed loop: session order, turns after their think time)."""
    recipe = TokenRecipe("session", 0, chunk_tokens)
    out = []
    for sid, session in enumerate(sessions):
        for k, turn in enumerate(session.turns):
            out.append(
                Request(
                    arrival_s=float(session.arrival_s) if k == 0 else 0.0,
                    session_id=sid,
                    turn=k,
                    input_len=len(turn.tokens),
                    output_len=max(1, int(turn.max_tokens)),
                    hash_ids=chunk_ids(turn.tokens, chunk_tokens),
                    recipe=recipe,
                    think_s=float(turn.think_s) if k else 0.0,
                )
            )
    return out


def rebuild_workload(results: BenchResults | dict) -> BenchWorkload:
    """The run's workload, regenerated from what it declared (the generators are deterministic)."""
    results = _typed(results)
    return workload_from_declared(results.workload, results.config.concurrency, results.model.vocab_size)


def io_cpu_per_byte(prelude: PreludeCounters, chunk_bytes: int) -> float | None:
    """The connector threads' CPU seconds per byte they moved in the prelude run (the store's population,
    before any mode runs): chunks loaded into the engine and saved out of it, disk reads and writes."""
    cpu = prelude.helper_cpu_s
    moved = (int(prelude.loaded_chunks or 0) + int(prelude.saved_chunks or 0)) * chunk_bytes
    moved += int(prelude.bytes_disk_read or 0) + int(prelude.bytes_disk_written or 0)
    return cpu / moved if cpu is not None and moved > 0 else None


MEASURED_SPEEDS = (
    "prefill_tokens_per_s",
    "extend_s",
    "request_floor_s",
    "decode_step_s",
    "decode_batch_step_s",
    "decode_wide_step_s",
)
"""The calibration's samples of the machine's speed (each one engine's fastest of its repeats)."""


def pooled_calibration(calibrations: list[dict]) -> dict:
    """One calibration from several engines': the first's, with each measured speed the median over the engines
    that measured it.

    Why: on a shared machine one engine's samples are noisy (the fastest prefill of five ranged 9k-15k tokens/s
    within one run), and the replay applies one calibration to every cell of a run, so one unlucky or lucky
    engine shifted every prediction of the run together. A median over the engines is robust to one such engine.
    The DRAM reload is pooled over engines that loaded the same number of tokens (an engine with no tier, as
    `recompute`'s, has no reload sample)."""
    pooled = dict(calibrations[0])
    for name in MEASURED_SPEEDS:
        values = [c[name] for c in calibrations if c.get(name)]
        if values:
            pooled[name] = float(np.median(values))
    reload_tokens = pooled.get("reload_tokens") or next(
        (c["reload_tokens"] for c in calibrations if c.get("reload_tokens")), None
    )
    reloads = [c["reload_s"] for c in calibrations if c.get("reload_s") and c.get("reload_tokens") == reload_tokens]
    if reloads:
        pooled |= {"reload_s": float(np.median(reloads)), "reload_tokens": reload_tokens}
    foreign = [c["foreign_cpu_cores"] for c in calibrations if c.get("foreign_cpu_cores") is not None]
    if foreign:
        pooled["foreign_cpu_cores"] = float(np.median(foreign))
    pooled["engines"] = len(calibrations)
    return pooled


def calibration_from_results(results: BenchResults | dict) -> Calibration:
    """The simulator's calibration of a bench run: its engines' measurements pooled (`pooled_calibration`), the
    disk rate the regime obtained, the engine's sizes, the connector's CPU per byte in the prelude."""
    results = _typed(results)
    reg, cfg = results.regime, results.config
    cal = pooled_calibration(list(results.engine_calibrations().values()))
    if reg.read_bps is None:
        raise ValueError("the run measured no disk read rate (regime.read_bps)")
    return Calibration(
        prefill_tokens_per_s=float(cal.get("prefill_tokens_per_s") or reg.prefill_tokens_per_s),
        decode_step_s=float(cal.get("decode_step_s") or reg.decode_step_s),
        disk_read_gbps=float(reg.read_bps) / 1e9,
        disk_streams=reg.array_streams,
        io_depth=reg.io_threads,
        chunk_bytes=reg.chunk_bytes,
        chunk_tokens=reg.chunk_tokens,
        token_budget=cfg.max_num_batched_tokens,
        prompt_tokens=int(cal.get("prompt_tokens", 3541)),
        extend_tokens=cal.get("extend_tokens"),
        extend_offset=cal.get("extend_offset"),
        extend_s=cal.get("extend_s"),
        decode_step_ctx=int(cal.get("decode_step_ctx", 256)),
        request_floor_s=cal.get("request_floor_s"),
        decode_batch=cal.get("decode_batch"),
        decode_batch_ctx=cal.get("decode_batch_ctx"),
        decode_batch_step_s=cal.get("decode_batch_step_s"),
        decode_wide=cal.get("decode_wide"),
        decode_wide_step_s=cal.get("decode_wide_step_s"),
        reload_s=cal.get("reload_s"),
        reload_tokens=cal.get("reload_tokens"),
        engine_kv_tokens=cfg.engine_kv_cache_tokens,
        max_num_seqs=cfg.max_num_seqs,
        dram_bytes=cfg.dram_tier_bytes,
        io_cpu_s_per_byte=io_cpu_per_byte(results.populate.prelude, reg.chunk_bytes),
        shared_cores=not cfg.topology.separates_io,
        engine_block_tokens=cfg.engine_block_tokens,
        engines=int(cal["engines"]),
        foreign_cpu_cores=cal.get("foreign_cpu_cores"),
        machine_cpus=results.machine.cpus,
    )


def _typed(results: BenchResults | dict) -> BenchResults:
    """A run's results as the schema reads them (`kvprefetch.results`), from the parsed file or already typed."""
    return results if isinstance(results, BenchResults) else BenchResults.from_json(results)


def load_bench_calibration(path: str) -> Calibration:
    """'This CPU' and its disk as a `kvprefetch bench` run measured them (its results.json), for planning runs."""
    try:
        return calibration_from_results(BenchResults.load(path))
    except OSError as err:
        raise ValueError(f"cannot read the bench results {path}: {err.strerror or err}") from None
    except (ValueError, KeyError, TypeError) as err:
        raise ValueError(f"{path} is not a usable kvprefetch bench results.json: {err!r}") from None


MIN_ENGINE_CORES = 0.25
"""The least share of the machine `speed_factor` leaves the engine: a saturated reading stays finite."""


def speed_factor(cal: Calibration, foreign_cpu_cores: float | None) -> float:
    """How much faster the engine computed in a cell than when it calibrated: its share of the machine's cores in
    each, (N - f_cell) / (N - f_cal), from the CPU the machine's other processes took (`foreign_cpu_cores`).

    Why: the bench's machine may be shared. Calibrating, the engine keeps the fastest of its samples, and still
    measures at whatever load the other processes put on the cores at that time; a cell minutes later runs at
    another. On two cores one busy neighbour halves the engine's speed, and the replay, applying one calibration
    to every cell, was off by as much in every cell of such a run. Only where the model computes on every core
    (`shared`): with `gpu-node` its threads are bound to cores of their own and the kernel puts other work on
    the host cores first, so their load says little about the model's. 1.0 where a reading is missing."""
    n, f_cal = cal.machine_cpus, cal.foreign_cpu_cores
    if not cal.shared_cores or not n or f_cal is None or foreign_cpu_cores is None:
        return 1.0
    most = n - MIN_ENGINE_CORES
    return (n - min(foreign_cpu_cores, most)) / (n - min(f_cal, most))


def at_speed(dep: Deployment, k: float) -> Deployment:
    """The calibrated CPU computing `k` times as fast: every cost the engine's cores pay (compute, memory reads,
    copies into the engine, the per-step and per-sequence work) divided by k."""
    if k == 1.0:
        return dep
    a = dep.accelerator
    faster = replace(a, flops=a.flops * k, hbm_bw=a.hbm_bw * k, host_link_bw=a.host_link_bw * k,
                     step_overhead_s=a.step_overhead_s / k, seq_overhead_s=a.seq_overhead_s / k)  # fmt: skip
    return replace(dep, accelerator=faster)


def replay_cells(
    cal: Calibration,
    workload: BenchWorkload,
    modes: list[str],
    concurrencies: list[int],
    foreign_cpu_cores: dict[tuple[str, int], float | None] | None = None,
) -> dict[tuple[str, int], SimResult]:
    """The replay of each (mode, concurrency) cell of the bench: its sessions on the calibrated engine.

    Per mode, as the bench runs it: one store whose disk tier starts with the prelude's chunks and whose DRAM
    tier starts empty (`dram` mode: with every prelude chunk), new chunks written through; the levels in the
    run's order on that same store (so a level finds in DRAM what the levels before it left there, the shared
    system prompt among it), each with a fresh engine prefix cache (the engine's KV as vLLM's block pool: that
    cache is what its free blocks still hold). Each cell runs at the speed the machine's other processes left the
    engine in it (`speed_factor`, from `foreign_cpu_cores` by cell; none given: the calibration's). Loads are
    served as the mode's connector serves them (its `load_mode`: `SimConfig.late_loads`), and their copies into
    the engine take the model's time, in the step or beside it (`StepLoads.SERIAL`).
    """
    calibrated = cpu_deployment(cal)
    size = cal.chunk_tokens
    prelude = [b for s in workload.prelude for t in s.turns for b in chunk_ids(t.tokens, size)]
    dram_blocks = int(cal.dram_bytes // cal.chunk_bytes) if cal.dram_bytes else None
    levels = {c: level_requests(sessions, size) for c, sessions in workload.levels.items()}
    out = {}
    for mode in modes:
        policy = BENCH_MODES[mode]
        stored = {"disk": prelude} | ({"dram": prelude} if policy is Policy.DRAM else {})
        for c, requests in levels.items():
            k = speed_factor(cal, (foreign_cpu_cores or {}).get((mode, c)))
            dep = at_speed(calibrated, k)
            tiers = (
                TierSpec("dram", None if policy is Policy.DRAM else dram_blocks, dep.accelerator.host_link_bw),
                TierSpec("disk", None, cal.disk_read_gbps * 1e9, MEASURED_DISK_LATENCY_S, cal.disk_streams),
            )
            config = SimConfig(
                dep,
                policy,
                tiers,
                concurrency=c,
                preload=stored,
                hbm_cache_blocks=(cal.engine_kv_tokens or dep.kv_capacity_tokens) // size,
                block_tokens=size,
                engine_block_pool=True,
                sync_loads_in_step=True,
                step_loads=StepLoads.SERIAL,  # as `_load_bandwidth` derived the load rate
                late_loads=MODE[mode].load_mode or CONNECTOR_LOAD_MODE,
                request_overhead_s=request_overhead(cal, calibrated.accelerator.step_overhead_s) / k,
                io_cpu_s_per_byte=charged_io_cpu(cal) / k,
                io_cpu_on_loads=not load_path_measured(cal),
                engine_block_tokens=cal.engine_block_tokens,
                **({"io_depth": cal.io_depth} if cal.io_depth else {}),
            )
            sim = Simulator(config, requests)
            result = sim.run()
            if c in concurrencies:
                out[(mode, c)] = result
            stored = sim.tier_contents() or stored
    return out


def predict_bench(results: BenchResults | dict) -> list[dict]:
    """Predicted vs measured TTFT p50 for every simulated mode and concurrency of one bench run, the prompt
    tokens the engine computed in each and those it found in its own prefix cache: equal ones mean the replay
    found in the engine's cache and the tiers what vLLM and the connector found."""
    results = _typed(results)
    cal = calibration_from_results(results)
    rows = results.ok_rows()
    modes = sorted({r.mode for r in rows} & set(BENCH_MODES))
    levels = sorted({r.concurrency for r in rows})
    if not modes:
        return []
    foreign = {(r.mode, r.concurrency): r.foreign_cpu_cores for r in rows}
    replays = replay_cells(cal, rebuild_workload(results), modes, levels, foreign)
    out = []
    for (mode, c), replay in sorted(replays.items(), key=lambda kv: (kv[0][1], kv[0][0])):
        row = next((r for r in rows if r.mode == mode and r.concurrency == c), None)
        p, meas = replay.ttft_p(50), row.ttft_p50_s if row else None
        out.append(
            {
                "mode": mode,
                "concurrency": c,
                "predicted": p,
                "measured": meas,
                "error_pct": 100.0 * (p - meas) / meas if meas else None,
                "computed_tokens_predicted": int(replay.tokens_from["computed"]),
                "computed_tokens_measured": row.tokens(row.share_computed) if row else None,
                "engine_cached_tokens_predicted": int(replay.tokens_from["hbm"]),
                "engine_cached_tokens_measured": row.tokens(row.share_engine) if row else None,
            }
        )
    return out
