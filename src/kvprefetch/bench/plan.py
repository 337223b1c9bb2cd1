"""What a bench run will do, decided from its options before anything runs: the first phase of the pipeline
`BenchOptions` -> `plan_bench` -> `BenchPlan` -> `populate` -> `Populated` -> the cells' rows -> results.json.

`BenchPlan` is frozen: every later phase reads it and none changes it; what the run measures (the regime, the
chunk geometry, the store's priors) is the next phase's value (`kvprefetch.bench.populate.Populated`).
"""

from __future__ import annotations

import contextlib
import json
import math
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from kvprefetch.bench.modes import MODES, StoreSizing, availability
from kvprefetch.bench.options import BenchOptions, KvAsk
from kvprefetch.modes import SIMULATED as BENCH_MODES
from kvprefetch.testbed.protocol import EngineSpec, Placement, ProcessSpec
from kvprefetch.testbed.server import TINY_MODEL, TINY_MODELS
from kvprefetch.testbed.topology import Topology, plan_topology
from kvprefetch.workload.agent import AgentBench, agent_workload
from kvprefetch.workload.replay import BenchWorkload, chat_workload, default_engine_kv_tokens, trace_workload

PACKAGED_MODEL = TINY_MODEL  # (the testbed ships it: `kvprefetch serve kvprefetch-tiny` serves it too)
QUICK_CONCURRENCY = [2, 8]
AGENT_MODES = ["recompute", "ondemand-sync", "prefetch", "lease", "warm", "dram"]
AGENT_CONCURRENCY = [1, 8]
CLUSTER_CONCURRENCY = [8, 16]  # the cluster-serve scenario's: both nodes loaded, more sessions than a node's KV holds
ENGINE_MEMORY_MODES = ["recompute", "prefetch", "dram"]  # --engine-kv: vLLM alone, kvprefetch, all-in-DRAM
ENGINE_MEMORY_CONCURRENCY = [8]  # --engine-kv: one level (an engine per mode and size, each run 3 times)
AGENT_DRAM_HEADS = 5
"""The agent workload's DRAM tier: this many heads of the largest level's sessions at once (so the lease budget,
a quarter of it by default, holds every active session's head)."""
SPEC_KEYS = ("load_format", "dtype", "max_num_seqs")  # engine args the spec sets itself
CALIBRATE_EST_S = 15.0  # one engine's calibration (probes.calibrate), for the progress bar's ETA
EST_PREFILL_TPS = 3000.0  # the progress bar's prior for the prefill speed, before it is measured


ENGINE_RESERVED_TOKENS = 128
"""vLLM keeps one block of its KV cache out of use (its null block: 128 tokens on the CPU backend, 16 on GPUs), so
an engine starts only if its KV holds one request of max_model_len and this much more."""


@dataclass(frozen=True)
class EngineSize:
    """One engine KV size the sweep measures every mode at: its bytes, its share of the full size, and
    whether vLLM can start with it (its KV must hold one request of the run's max_model_len and the block vLLM
    reserves, `ENGINE_RESERVED_TOKENS`)."""

    bytes: int
    share: float
    tokens: int
    fits: bool

    @property
    def label(self) -> str:
        """How rows, engines and files name it: the share ('0.25'), for sizes asked in bytes too."""
        return f"{self.share:.4g}"

    def tags(self) -> dict[str, Any]:
        """What every row of an engine of this size carries."""
        return {"engine_kv_bytes": self.bytes, "engine_kv_share": round(self.share, 6)}


# ---- model --------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
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


def _model_config(path: str, engine_args: dict[str, Any]) -> dict:
    """A local model's config.json, or a hub name's config (the engine fetches the same); {} if neither."""
    p = Path(path)
    if (p / "config.json").exists():
        return json.loads((p / "config.json").read_text())
    if not p.exists():
        with contextlib.suppress(Exception):
            from transformers import AutoConfig

            hf = AutoConfig.from_pretrained(path, trust_remote_code=bool(engine_args.get("trust_remote_code")))
            return (getattr(hf, "text_config", None) or hf).to_dict()
    return {}


def kv_bytes_per_token(cfg: dict, dtype_bytes: int) -> int:
    """A token's KV over every layer: K and V of each KV head, or MLA's one latent vector (``kv_lora_rank`` plus the
    rotary part, shared by every head). A hybrid's sliding-window layers count in full: a chunk holds every layer."""
    layers = int(cfg.get("num_hidden_layers", 1))
    if cfg.get("kv_lora_rank"):
        return layers * (int(cfg["kv_lora_rank"]) + int(cfg.get("qk_rope_head_dim", 0))) * dtype_bytes
    heads = int(cfg.get("num_attention_heads", 1))
    kv_heads = int(cfg.get("num_key_value_heads", heads))
    head_dim = int(cfg.get("head_dim") or int(cfg.get("hidden_size", 64)) // heads)
    return 2 * layers * kv_heads * head_dim * dtype_bytes


def resolve_model(model: str | None, engine_args: dict[str, Any]) -> ModelInfo:
    """The engines' model: a path, a hub name, or a packaged tiny model by name (`TINY_MODELS`: kvprefetch-tiny, the
    sliding-window hybrid kvprefetch-tiny-hybrid, the MLA kvprefetch-tiny-mla)."""
    cuda = cuda_available()
    path = str(TINY_MODELS.get(model or "", model or PACKAGED_MODEL))
    cfg = _model_config(path, engine_args)
    p = Path(path)
    has_weights = p.is_dir() and (any(p.glob("*.safetensors")) or any(p.glob("*.bin")))
    load_format = engine_args.get("load_format") or ("dummy" if p.is_dir() and not has_weights else None)
    dtype = str(engine_args.get("dtype") or ("auto" if cuda else "float32"))
    eff = dtype if dtype != "auto" else str(cfg.get("torch_dtype") or "bfloat16")
    return ModelInfo(
        path=path,
        load_format=load_format,
        config=cfg,
        vocab_size=int(cfg.get("vocab_size", 32000)),
        bytes_per_token=kv_bytes_per_token(cfg, _dtype_bytes(eff)),
        dtype=dtype,
        device="cuda" if cuda else "cpu",
    )


def cuda_available() -> bool:
    try:
        import torch

        return bool(torch.cuda.is_available())
    except Exception:
        return False


# ---- the plan -----------------------------------------------------------------------------------------------
def build_workload(opts: BenchOptions, vocab: int, bytes_per_token: int = 0) -> BenchWorkload:
    w, kv_bytes = opts.workload, opts.engine.kv_cache_bytes
    if w.agent is not None:
        return agent_workload(w.agent, opts.concurrency, vocab)
    if w.trace is not None:
        trace = w.trace
        if kv_bytes and bytes_per_token:  # an engine KV cache asked for: the levels outgrow it
            trace = replace(trace, engine_kv_tokens=kv_bytes // bytes_per_token)
        return trace_workload(trace, opts.concurrency, vocab)
    return chat_workload(w.chat, opts.concurrency, vocab)


def _round_up(x: int, m: int) -> int:
    return -(-x // m) * m


def store_sizing(opts: BenchOptions, w: BenchWorkload, model: ModelInfo, topology: Topology) -> StoreSizing:
    """The tiers of every connector mode but `dram`: room for the in-flight requests' KV 3 times over (what
    prefetching the queue needs; 5 heads a session for the agent workload) and at least a quarter of the prelude:
    enough for prefetch to work, not enough to hold every history."""
    chunk = opts.store.chunk_tokens
    prelude_chunks_est = math.ceil(w.prelude_tokens() / chunk)
    chunk_bytes_est = chunk * model.bytes_per_token
    heads = AGENT_DRAM_HEADS if opts.workload.agent is not None else 3
    in_flight = math.ceil(heads * max(opts.concurrency) * math.ceil(w.max_prompt_tokens() / chunk))
    dram_default = max(in_flight, 4, math.ceil(prelude_chunks_est / 4)) * (chunk_bytes_est + 8192)
    return StoreSizing(
        chunk_tokens=chunk,
        dram_bytes=int(opts.store.dram_bytes or dram_default),
        disk_bytes=int(max(4 * (prelude_chunks_est + 64) * chunk_bytes_est, 1 << 30)),
        io_threads=opts.store.io_threads,
        io_cpus=topology.io_cpus(),
    )


@dataclass(frozen=True)
class BenchPlan:
    """Everything the options decide: the model, where its threads run, the workload and its sizes, the modes
    that can run here."""

    opts: BenchOptions
    model: ModelInfo
    topology: Topology
    workload: BenchWorkload
    max_num_seqs: int
    max_model_len: int
    kv_cache_bytes: int
    sizing: StoreSizing  # before the regime is measured (`Populated.sizing` after)
    modes: list[str]  # those asked that exist
    avail: dict[str, tuple[bool, str]]  # each mode: can it run here, and why not
    calibrates: bool  # each simulated mode's engine measured after its cells
    engine_sizes: tuple[EngineSize, ...] = ()  # the engine-memory sweep's sizes, the full size first; () if none

    @property
    def running(self) -> list[str]:
        return [m for m in self.modes if self.avail[m][0]]

    @property
    def agent(self) -> AgentBench | None:
        return self.opts.workload.agent

    def engine_args(self) -> dict[str, Any]:
        """Engine arguments the workload sets, then the user's. The agent workload runs vLLM without its prefix
        cache: on a busy server the accelerator's memory holds other sessions' KV by the time a tool call
        returns, so a turn's head comes from the tiers (or is recomputed), in every mode; a 2-core machine cannot
        compute that other traffic without starving the turns it measures, so the bench declares its effect."""
        ours = {"enable_prefix_caching": False} if self.agent is not None else {}
        return ours | {k: v for k, v in self.opts.engine.engine_args.items() if k not in SPEC_KEYS}

    @property
    def sizes(self) -> tuple[EngineSize, ...]:
        """The engine KV sizes every mode runs at: the sweep's, or the one size of the run."""
        return self.engine_sizes or (self.full_size(),)

    def full_size(self) -> EngineSize:
        return engine_size(self.kv_cache_bytes, self.kv_cache_bytes, self.model.bytes_per_token, self.max_model_len)

    def engine_spec(self, kv_transfer: dict | None, *, cgroup: str | None, env: dict | None = None,
                    kv_cache_bytes: int | None = None) -> EngineSpec:  # fmt: skip
        topo = self.topology.spec()
        return EngineSpec(
            model=self.model.path,
            load_format=self.model.load_format,
            dtype=self.model.dtype,
            max_model_len=self.max_model_len,
            kv_cache_bytes=kv_cache_bytes or self.kv_cache_bytes,
            max_num_seqs=self.max_num_seqs,
            max_num_batched_tokens=self.opts.engine.max_num_batched_tokens,
            engine_args=self.engine_args(),
            kv_transfer_config=kv_transfer,
            process=ProcessSpec(cgroup=cgroup, env=env or {}, topology=Placement(**topo) if topo else None),
        )

    def cell_estimate(self, mode: str, c: int, tps: float) -> float:
        """Seconds one cell should take (the progress bar's ETA)."""
        tokens = self.workload.prompt_tokens(c)
        heavy = mode in ("recompute", "vllm-example")
        gaps = 0.0
        if (a := self.agent) is not None:  # the tool gaps, c sessions at a time
            waves = math.ceil(a.sessions_for(c) / c)
            gaps = waves * a.measured_turns * ((a.gap_min_s + a.gap_max_s) / 2 + a.answer_tokens * 0.01)
        return tokens / tps * (1.0 if heavy else 0.3) + 2 + gaps

    def mode_estimate(self, mode: str, tps: float, rounds: int) -> float:
        return rounds * sum(self.cell_estimate(mode, c, tps) for c in self.opts.concurrency)

    def stage_seconds(self, modes: tuple[str, ...], engines: int, rounds: int) -> float:
        """A scenario's seconds for the progress bar: per mode, its `engines` engines' starts, its cells over
        `rounds` rounds, and its engine's calibration where the run calibrates it."""
        return sum(25 * engines + (CALIBRATE_EST_S if m in BENCH_MODES and self.calibrates else 0.0)
                   + self.mode_estimate(m, EST_PREFILL_TPS, rounds) for m in modes)  # fmt: skip

    def populate_seconds(self) -> float:
        """Phase 1's seconds for the progress bar (each scenario adds its own: `Stage.seconds`)."""
        return 25 + 15 + self.workload.prelude_tokens() / EST_PREFILL_TPS + 20


def engine_size(nbytes: int, full_bytes: int, bytes_per_token: int, max_model_len: int) -> EngineSize:
    tokens = nbytes // bytes_per_token
    fits = tokens >= max_model_len + ENGINE_RESERVED_TOKENS
    return EngineSize(bytes=nbytes, share=nbytes / full_bytes, tokens=tokens, fits=fits)


def engine_sizes(asks: list[KvAsk], full_bytes: int, bytes_per_token: int,
                 max_model_len: int) -> tuple[EngineSize, ...]:  # fmt: skip
    """The sweep's sizes, the full size first and always (every ratio's baseline is vLLM alone at it), then
    the others largest first; a size asked twice is measured once."""
    if not asks:
        return ()
    others = {a.resolve(full_bytes) for a in asks} - {full_bytes}
    return tuple(engine_size(b, full_bytes, bytes_per_token, max_model_len)
                 for b in [full_bytes, *sorted(others, reverse=True)])  # fmt: skip


def default_kv_tokens(opts: BenchOptions, w: BenchWorkload, max_model_len: int) -> int:
    """The engine's KV cache by default, in tokens: room for 4 of the workload's longest requests; the agent
    workload's, for every active session's turn. Chat whose reuse is inside the run: every client's conversation
    at the largest level, and at least 8, each with the block vLLM reserves (so 1/8 of it still starts vLLM): the
    size at which vLLM alone keeps all its reuse, the engine-memory sweep's full size."""
    asked = opts.workload
    if asked.agent is None and asked.trace is None and asked.chat.in_run:  # the chat workload, as `build_workload`
        return max(8, max(opts.concurrency)) * (max_model_len + ENGINE_RESERVED_TOKENS)
    heads = max(4, max(opts.concurrency)) if asked.agent is not None else 4
    return default_engine_kv_tokens(w.max_len(), heads)


def plan_bench(opts: BenchOptions) -> BenchPlan:
    e = opts.engine
    model = resolve_model(e.model, e.engine_args)
    cuda = model.device == "cuda"
    tp = int(e.engine_args.get("tensor_parallel_size") or 1)
    topology = plan_topology(e.topology if not cuda else "shared", tp)
    w = build_workload(opts, model.vocab_size, model.bytes_per_token)
    max_model_len = min(_round_up(w.max_len() + 64, 256), int(model.config.get("max_position_embeddings", 1 << 30)))
    kv_cache_bytes = int(e.kv_cache_bytes or default_kv_tokens(opts, w, max_model_len) * model.bytes_per_token)
    modes = [m for m in opts.modes if m in MODES]
    return BenchPlan(
        opts=opts,
        model=model,
        topology=topology,
        workload=w,
        max_num_seqs=int(e.engine_args.get("max_num_seqs") or e.max_num_seqs or max(opts.concurrency)),
        max_model_len=max_model_len,
        kv_cache_bytes=kv_cache_bytes,
        sizing=store_sizing(opts, w, model, topology),
        modes=modes,
        avail={m: availability(m, cuda, opts.store.remote_backend) for m in modes},
        # the simulator does not model the agent workload (leases, warm-ups, no engine prefix cache), nor a
        # sweep of engine sizes (`kvprefetch sim --scenario engine-memory` projects that on its own)
        calibrates=opts.calibrate_modes and opts.workload.agent is None and not opts.engine_kv
        and opts.scenario.kind in ("single", "two-instance"),
        engine_sizes=engine_sizes(opts.engine_kv, kv_cache_bytes, model.bytes_per_token, max_model_len),
    )
