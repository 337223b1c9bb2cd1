"""`kvprefetch bench`: the command line around `kvprefetch.bench.runner`.

The command's options are read into `BenchArgs` (as typed), and `bench_options` turns them into the run's
`BenchOptions` in small steps (the modes, the regimes, the workload, the sizes), each returning its part.
Choices are enums, so typer names the valid values itself.
"""

from __future__ import annotations

import datetime as dt
import json
from dataclasses import dataclass, fields, replace
from enum import StrEnum
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import typer
from pydantic import Field
from rich.console import Console

from kvprefetch.results import Row, View

if TYPE_CHECKING:
    from kvprefetch.bench.options import (
        BenchOptions,
        ClusterServeOptions,
        EngineOptions,
        KvAsk,
        ScenarioOptions,
        TwoNodeOptions,
    )
    from kvprefetch.workload.agent import AgentBench
    from kvprefetch.workload.replay import ChatBench, TraceBench

console = Console()


class Workload(StrEnum):
    context = "context"
    chat = "chat"
    agent = "agent"


class Topology(StrEnum):
    gpu_node = "gpu-node"
    shared = "shared"


class Scenario(StrEnum):
    single = "single"
    two_instance = "two-instance"
    two_node = "two-node"
    cluster_serve = "cluster-serve"


class RemoteBackend(StrEnum):
    redis = "redis"
    mooncake = "mooncake"


def parse_engine_args(items: list[str]) -> dict:
    """['max_num_batched_tokens=4096', 'enforce_eager=false'] -> {...}; values parsed as JSON where they parse."""
    out = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key.strip():
            raise typer.BadParameter(f"--engine-arg takes key=value, got {item!r}")
        try:
            out[key.strip().replace("-", "_")] = json.loads(value)
        except ValueError:
            out[key.strip().replace("-", "_")] = value
    return out


def parse_list(text: str) -> list[int]:
    try:
        vals = [int(x) for x in text.replace(" ", "").split(",") if x]
    except ValueError:
        raise typer.BadParameter(f"expected a comma-separated list of integers, got {text!r}") from None
    if not vals or any(v < 1 for v in vals):
        raise typer.BadParameter(f"concurrency levels must be positive integers, got {text!r}")
    return vals


# ---- the options ------------------------------------------------------------------------------------------------
ModeOpt = Annotated[
    list[str] | None,
    typer.Option(
        "--mode",
        "-m",
        help="Modes to run (repeat or comma list); "
        "default: all (recompute, ondemand-serial, ondemand-sync, ondemand, prefetch, dram, "
        "vllm-example, lmcache); "
        "opt-in: prefetch-remote, shared-2x, private-2x.",
    ),
]
ConcurrencyOpt = Annotated[
    str | None, typer.Option(help="Concurrency levels, e.g. 1,8,16,32 (the default).")
]
RegimeOpt = Annotated[
    str,
    typer.Option(
        help="R = recompute time / slowest-tier load time per chunk, enforced by a read throttle; "
        "'native' for none. Default: the whitepaper's R2 (18.2, derived in report.md). A list (e.g. "
        "18.2,3,1,native) sweeps: every regime on the same engines, the goals judged in the first, and "
        "report.md plots prefetch against ondemand-sync and dram over R (regime_sweep.png)."
    ),
]
WorkloadOpt = Annotated[
    Workload | None,
    typer.Option(
        show_default=False,
        help="'context' (default: the whitepaper's R2 shape, a long stored context + 32 new tokens, "
        "the engine batching 4), 'chat' (multi-turn sessions, nothing queues; the default with --engine-kv, "
        "its conversations then inside the run) or 'agent' (sessions of "
        "turns separated by tool calls, --gap-s; modes recompute, ondemand-sync, prefetch, lease, warm, "
        "dram at concurrency 1,8 unless -m/--concurrency say otherwise)."
    ),
]
GapSOpt = Annotated[
    str,
    typer.Option(help="Agent: a tool call's duration in seconds, uniform in MIN-MAX (e.g. 0.5-3, the "
                 "default), or one value (0: no gap, nothing to hide)."),
]
DramLifeSOpt = Annotated[
    float,
    typer.Option(min=0.0, help="Agent: other traffic on the node's DRAM tier, as how long an unpinned chunk "
                 "lasts after its last use (default 0.4 s: below the shortest tool gap)."),
]
RepeatsOpt = Annotated[
    int | None,
    typer.Option(
        min=1,
        help="Rounds of every cell, modes interleaved within each round; medians, min-max and paired "
        "ratios are reported (default 3; 1 with --quick).",
    ),
]
TopologyOpt = Annotated[
    Topology,
    typer.Option(
        help="'gpu-node' (default: the model computes on cores of its own, in vLLM's worker process, "
        "while the client, the scheduler and the connector's threads run on the rest, as host and "
        "accelerator divide the work on a GPU node) or 'shared' (every thread on every core)."
    ),
]
ModelOpt = Annotated[
    str | None,
    typer.Option(help="Model path or name (default: the packaged tiny dummy Llama, kvprefetch-tiny); the packaged "
                 "kvprefetch-tiny-hybrid (sliding window) and kvprefetch-tiny-mla (MLA) by name too."),
]
EngineArgOpt = Annotated[
    list[str] | None,
    typer.Option(
        "--engine-arg",
        help="vLLM engine argument key=value (repeatable), e.g. dtype=bfloat16, tensor_parallel_size=2.",
    ),
]
OutOpt = Annotated[
    Path | None, typer.Option(help="Output directory (default: bench-results/<timestamp>/).")
]
QuickOpt = Annotated[
    bool,
    typer.Option(
        "--quick",
        help="Two concurrency levels, fewer sessions, one round, one engine calibrated, and without the "
        "other projects' connectors unless -m names them (~5 min here).",
    ),
]
TraceOpt = Annotated[
    Path | None, typer.Option(help="Replay a Mooncake-format trace instead of synthetic chat.")
]
TraceLengthScaleOpt = Annotated[
    float | None,
    typer.Option(help="Trace token lengths x this; a 512-token block must stay a whole number of chunks "
                 "(default: one chunk a block)."),
]
TraceTimeScaleOpt = Annotated[
    float, typer.Option(help="Trace arrival times x this (with --trace-timestamps and --trace-utilisation 0).")
]
TraceTimestampsOpt = Annotated[
    bool, typer.Option(help="Honour trace arrival times (else: as fast as the concurrency allows).")
]
TraceUtilisationOpt = Annotated[
    float,
    typer.Option(help="With --trace-timestamps: scale arrival times so recomputing each level would keep "
                 "the engine this busy (0: use --trace-time-scale as given)."),
]
TraceWindowStartOpt = Annotated[
    float, typer.Option(help="Measure conversations from this share of the trace's time span on.")
]
TraceMaxPromptTokensOpt = Annotated[
    int, typer.Option(help="Leave out conversations with a longer (scaled) prompt.")
]
SystemTokensOpt = Annotated[int | None, typer.Option(help="Chat: shared system prompt tokens.")]
HistoryTokensOpt = Annotated[
    int | None, typer.Option(help="Chat: first (long) message tokens (agent: the task context).")
]
UserTokensOpt = Annotated[
    int | None, typer.Option(help="Chat: follow-up message tokens (agent: a tool's result).")
]
OutputTokensOpt = Annotated[
    int | None, typer.Option(help="Chat: answer tokens (agent: the model's answer per turn).")
]
TurnsOpt = Annotated[int | None, typer.Option(help="Chat (and agent): measured turns per session.")]
ThinkSOpt = Annotated[float | None, typer.Option(help="Chat: mean think time between turns (s).")]
SessionsPerConcurrencyOpt = Annotated[
    float | None, typer.Option(help="Chat: sessions per level = max(min, this x concurrency).")
]
NoReuseOpt = Annotated[
    bool,
    typer.Option(
        "--no-reuse",
        help="Chat without any reuse (no prelude, no system prompt, one turn): "
        "the cost of the connector on misses.",
    ),
]
ChunkTokensOpt = Annotated[
    int | None, typer.Option(help="kvprefetch chunk size in tokens (default 256; 128 with --trace).")
]
KvCacheOpt = Annotated[
    str | None, typer.Option(help="Engine KV cache size (default: 4 longest requests; with --engine-kv, the "
                             "sweep's full size: every client's conversation at the largest level, at least 8).")
]
EngineKvOpt = Annotated[
    str | None,
    typer.Option(
        help="The engine-memory sweep (the whitepaper's R5): every mode at every engine KV size, e.g. "
        "0.125,0.25,0.5,1 (shares of the full size, --kv-cache) or 32MiB,128MiB; the full size is always "
        "measured (every ratio's baseline: vLLM alone there). Defaults then: the chat workload with each "
        "conversation's turns inside the run, modes recompute,prefetch,dram, concurrency 8; report.md reads "
        "off the engine memory kvprefetch gives back (engine_memory.png)."
    ),
]
DramOpt = Annotated[
    str | None,
    typer.Option(help="DRAM tier size of the non-dram modes (default: 1.5x the in-flight requests' KV)."),
]
CacheDirOpt = Annotated[Path | None, typer.Option(help="Where the disk tiers go (default: the temp dir).")]
KeepCacheOpt = Annotated[bool, typer.Option(help="Keep the disk tiers and engine logs.")]
StepLogOpt = Annotated[
    bool,
    typer.Option(
        help="Record every engine step (batch, time) to <out>/steps/; `kvprefetch sim "
        "--scenario bench` then checks its step model on them."
    ),
]
CellTimeoutOpt = Annotated[float, typer.Option(help="Seconds one mode x concurrency may take.")]
ScenarioOpt = Annotated[
    Scenario,
    typer.Option(
        help="'single' (default: one engine per mode); 'two-instance': two engines at once, turns "
        "alternating between them, with one shared node-local cache (shared-2x) and with a cache each "
        "(private-2x); runs only those two unless -m adds modes; there the prelude holds only each "
        "conversation's first message and --turns defaults to 4; 'two-node' (root): two nodes in network "
        "namespaces of their own, each with its own DRAM tier, reading a shared pool (Redis) over a link "
        "shaped to the whitepaper's node's rate scaled to this engine; turns alternate nodes; modes "
        "recompute, local-only, pool-sync, pool-prefetch, same-node (-m picks among them); --faults after the "
        "rounds; the chat workload's prelude holds only each conversation's first message there too; "
        "'cluster-serve' (root): two `kvprefetch serve` nodes in namespaces over shaped links to a shared pool, "
        "vllm-router in front, the client sending OpenAI requests to the router only; modes recompute, "
        "round-robin, cache-aware, kv-gpu, kv-tiers, kv-tiers-lease, pinned (-m picks among them); the chat "
        "(default: every turn inside the run) and agent workloads; --kv-cache sizes each node's engine KV; "
        "--node-loss after the rounds."
    ),
]
FaultsOpt = Annotated[
    str,
    typer.Option(
        help="The two-node scenario's faults, after its rounds, during pool-prefetch at the highest level: 'link' "
        "(every node's link to the pool down for 10 s), 'pool' (the pool's server SIGKILLed, restarted empty "
        "5 s later), a comma list, or 'none'."
    ),
]
NodeDiskOpt = Annotated[
    bool, typer.Option(help="The two-node scenario: a local disk tier on each node (default: diskless nodes).")
]
NodeLossOpt = Annotated[
    bool,
    typer.Option(
        help="The cluster-serve scenario: after the rounds, kv-tiers at the highest level while one node's server "
        "is SIGKILLed and started again 15 s later (requests failed, wrong, routed back)."
    ),
]
PoolOpt = Annotated[
    bool,
    typer.Option(
        help="The cluster-serve scenario: the nodes share a pool (Redis, over each node's shaped link); --no-pool: "
        "each node has its own DRAM and disk tiers only, so a turn served away from its KV recomputes it."
    ),
]
RemoteBackendOpt = Annotated[
    RemoteBackend,
    typer.Option(help="Server of the prefetch-remote mode (-m prefetch-remote) and of the two-node scenario's pool: "
                 "redis or mooncake."),
]


@dataclass(frozen=True)
class RunArgs:
    """What runs: the modes, the levels, the regimes, the rounds, the scenario."""

    mode: list[str] | None = None
    concurrency: str | None = None
    regime: str = "18.2"
    repeats: int | None = None
    quick: bool = False
    cell_timeout: float = 1800
    scenario: Scenario = Scenario.single


@dataclass(frozen=True)
class WorkloadArgs:
    """The workload and its sizes (the chat's and the agent's)."""

    workload: Workload = Workload.context
    gap_s: str = "0.5-3"
    dram_life_s: float = 0.4
    system_tokens: int | None = None
    history_tokens: int | None = None
    user_tokens: int | None = None
    output_tokens: int | None = None
    turns: int | None = None
    think_s: float | None = None
    sessions_per_concurrency: float | None = None
    no_reuse: bool = False


@dataclass(frozen=True)
class TraceArgs:
    """A trace to replay instead (`--trace` and its knobs)."""

    trace: Path | None = None
    trace_length_scale: float | None = None
    trace_time_scale: float = 1.0
    trace_timestamps: bool = False
    trace_utilisation: float = 0.8
    trace_window_start: float = 0.3
    trace_max_prompt_tokens: int = 2048


@dataclass(frozen=True)
class EngineStoreArgs:
    """The engines and their stores: model, vLLM arguments, where threads run, sizes."""

    model: str | None = None
    engine_arg: list[str] | None = None
    topology: Topology = Topology.gpu_node
    kv_cache: str | None = None
    engine_kv: str | None = None
    chunk_tokens: int | None = None
    dram: str | None = None
    remote_backend: RemoteBackend = RemoteBackend.redis


@dataclass(frozen=True)
class FileArgs:
    out: Path | None = None
    cache_dir: Path | None = None
    keep_cache: bool = False
    step_log: bool = False


@dataclass(frozen=True)
class TwoNodeArgs:
    faults: str = "link,pool"
    node_disk: bool = False


@dataclass(frozen=True)
class ClusterArgs:
    node_loss: bool = True
    pool: bool = True


@dataclass(frozen=True)
class BenchArgs:
    """The command's options as typed (`bench`'s parameters, one for one, grouped by what they shape)."""

    run: RunArgs = RunArgs()
    workload: WorkloadArgs = WorkloadArgs()
    trace: TraceArgs = TraceArgs()
    engine: EngineStoreArgs = EngineStoreArgs()
    files: FileArgs = FileArgs()
    two_node_args: TwoNodeArgs = TwoNodeArgs()
    cluster: ClusterArgs = ClusterArgs()

    @classmethod
    def of(cls, **params) -> BenchArgs:
        """The groups from `bench`'s parameters by name (a name no group has is refused)."""
        groups = {f.name: f.type for f in fields(cls)}
        parts: dict[str, dict] = {name: {} for name in groups}
        owner = {p.name: g for g, t in groups.items() for p in fields(_GROUP_TYPES[t])}
        for name, value in params.items():
            if name not in owner:
                raise TypeError(f"bench has no option {name!r}")
            parts[owner[name]][name] = value
        return cls(**{g: _GROUP_TYPES[groups[g]](**kw) for g, kw in parts.items()})

    @property
    def two_instance(self) -> bool:
        return self.run.scenario == Scenario.two_instance

    @property
    def two_node(self) -> bool:
        return self.run.scenario == Scenario.two_node

    @property
    def cluster_serve(self) -> bool:
        return self.run.scenario == Scenario.cluster_serve

    @property
    def turns_asked(self) -> int | None:
        """--turns, or 4 for the two-instance and two-node scenarios' chat (each engine serves every other turn)."""
        two = self.two_instance or ((self.two_node or self.cluster_serve) and self.workload.workload == Workload.chat)
        turns = self.workload.turns
        return turns if turns is not None or not two else 4


_GROUP_TYPES = {t.__name__: t for t in (RunArgs, WorkloadArgs, TraceArgs, EngineStoreArgs, FileArgs, TwoNodeArgs,
                                        ClusterArgs)}


def bench(
    mode: ModeOpt = None,
    concurrency: ConcurrencyOpt = None,
    regime: RegimeOpt = "18.2",
    workload: WorkloadOpt = None,
    gap_s: GapSOpt = "0.5-3",
    dram_life_s: DramLifeSOpt = 0.4,
    repeats: RepeatsOpt = None,
    topology: TopologyOpt = Topology.gpu_node,
    model: ModelOpt = None,
    engine_arg: EngineArgOpt = None,
    out: OutOpt = None,
    quick: QuickOpt = False,
    trace: TraceOpt = None,
    trace_length_scale: TraceLengthScaleOpt = None,
    trace_time_scale: TraceTimeScaleOpt = 1.0,
    trace_timestamps: TraceTimestampsOpt = False,
    trace_utilisation: TraceUtilisationOpt = 0.8,
    trace_window_start: TraceWindowStartOpt = 0.3,
    trace_max_prompt_tokens: TraceMaxPromptTokensOpt = 2048,
    system_tokens: SystemTokensOpt = None,
    history_tokens: HistoryTokensOpt = None,
    user_tokens: UserTokensOpt = None,
    output_tokens: OutputTokensOpt = None,
    turns: TurnsOpt = None,
    think_s: ThinkSOpt = None,
    sessions_per_concurrency: SessionsPerConcurrencyOpt = None,
    no_reuse: NoReuseOpt = False,
    chunk_tokens: ChunkTokensOpt = None,
    kv_cache: KvCacheOpt = None,
    engine_kv: EngineKvOpt = None,
    dram: DramOpt = None,
    cache_dir: CacheDirOpt = None,
    keep_cache: KeepCacheOpt = False,
    step_log: StepLogOpt = False,
    cell_timeout: CellTimeoutOpt = 1800,
    scenario: ScenarioOpt = Scenario.single,
    remote_backend: RemoteBackendOpt = RemoteBackend.redis,
    faults: FaultsOpt = "link,pool",
    node_disk: NodeDiskOpt = False,
    node_loss: NodeLossOpt = True,
    pool: PoolOpt = True,
) -> None:
    """The main benchmark: TTFT and throughput of tiered prefetch vs recompute, on-demand loads, all-in-DRAM and
    vLLM's own connector, on real vLLM engines, over a concurrency sweep, in a declared storage regime."""
    workload = workload or (Workload.chat if engine_kv or scenario == Scenario.cluster_serve else Workload.context)
    args = BenchArgs.of(**locals())
    run_and_report(bench_options(args))


def register(app: typer.Typer) -> None:
    app.command("bench")(bench)


# ---- options -> BenchOptions ------------------------------------------------------------------------------------
def bench_options(a: BenchArgs) -> BenchOptions:
    from kvprefetch.bench.options import BenchOptions, FileOptions, StoreOptions, WorkloadOptions

    r, f = a.run, a.files
    regimes = _regimes(r.regime) if not (a.two_node or a.cluster_serve) else (None,)  # there the link is the regime
    agent = _agent(a)
    chat, chat_preset = _chat(a)
    modes, concurrency = _modes_and_levels(a, agent)
    e = a.engine
    chunk_tokens = e.chunk_tokens or (128 if a.trace.trace is not None else 256)
    return BenchOptions(
        modes=modes, concurrency=concurrency, regimes=regimes, repeats=r.repeats or (1 if r.quick else 3),
        quick=r.quick, calibrate_modes=not r.quick, cell_timeout_s=r.cell_timeout,
        engine=_engine(a, chat_preset or agent is not None),
        store=StoreOptions(chunk_tokens=chunk_tokens, dram_bytes=_size(e.dram), remote_backend=e.remote_backend.value),
        workload=WorkloadOptions(chat=chat, trace=_trace(a, chunk_tokens), agent=agent,
                                 dram_life_s=a.workload.dram_life_s),
        files=FileOptions(out=f.out or Path("bench-results") / dt.datetime.now().strftime("%Y%m%d-%H%M%S"),
                          cache_dir=f.cache_dir, keep_cache=f.keep_cache, step_log=f.step_log),
        scenario=_scenario(a),
    )  # fmt: skip


def _size(text: str | None) -> int | None:
    from kvprefetch.cli_args import parse_size

    return parse_size(text) if text else None


def _engine(a: BenchArgs, nothing_queues: bool) -> EngineOptions:
    """The engines' options; the chat presets and the agent run every session at once (nothing queues)."""
    from kvprefetch.bench.options import EngineOptions
    from kvprefetch.workload.replay import CONTEXT_MAX_NUM_SEQS

    e = a.engine
    return EngineOptions(model=e.model, engine_args=parse_engine_args(e.engine_arg or []),
                         kv_cache_bytes=_size(e.kv_cache), topology=e.topology.value,
                         max_num_seqs=None if nothing_queues else CONTEXT_MAX_NUM_SEQS)  # fmt: skip


def _scenario(a: BenchArgs) -> ScenarioOptions:
    """The scenario asked, with its own options."""
    from kvprefetch.bench.options import SingleOptions, TwoInstanceOptions

    engine_kv = tuple(_engine_kv(a))  # refused outside the single scenario
    if a.two_node:
        return _two_node(a)
    if a.cluster_serve:
        return _cluster_serve(a)
    if a.two_instance:
        return TwoInstanceOptions()
    return SingleOptions(engine_kv=engine_kv)


def parse_engine_kv(text: str) -> list[KvAsk]:
    """--engine-kv: '0.125,0.25,1' (shares of the full size) or '32MiB,1GiB' (sizes), mixed if need be."""
    from kvprefetch.bench.options import KvAsk
    from kvprefetch.cli_args import parse_size

    asks = []
    for item in (x.strip() for x in text.split(",")):
        if not item:
            continue
        try:
            share = float(item)
        except ValueError:
            asks.append(KvAsk(float(parse_size(item)), absolute=True))
            continue
        if not 0 < share <= 64:
            raise typer.BadParameter(f"--engine-kv: a share of the full size must be in (0, 64], got {item!r}")
        asks.append(KvAsk(share))
    if not asks:
        raise typer.BadParameter(f"--engine-kv: expected sizes or shares, e.g. 0.125,0.25,0.5,1; got {text!r}")
    return asks


def _engine_kv(a: BenchArgs) -> list[KvAsk]:
    """The engine-memory sweep's sizes ([]: none); a sweep runs one engine per mode and size, so it runs
    neither the two-instance nor the two-node scenario, nor a regime sweep."""
    if not a.engine.engine_kv:
        return []
    if a.run.scenario != Scenario.single:
        raise typer.BadParameter("--engine-kv runs the single scenario (one engine per mode and size)")
    if "," in a.run.regime:
        raise typer.BadParameter("--engine-kv runs in one regime: give --regime a single value")
    return parse_engine_kv(a.engine.engine_kv)


def _two_node(a: BenchArgs) -> TwoNodeOptions:
    """The two-node scenario's options."""
    from kvprefetch.bench.options import TwoNodeOptions

    if a.workload.workload == Workload.agent or a.trace.trace is not None:
        raise typer.BadParameter("the two-node scenario runs the context and chat workloads")
    from kvprefetch.testbed.netns import available

    if (why := available()) is not None:
        raise typer.BadParameter(f"the two-node scenario makes network namespaces: {why}")
    from kvprefetch.bench.modes import remote_available

    backend = a.engine.remote_backend.value
    if not remote_available(backend):
        raise typer.BadParameter(f"the two-node scenario's pool is {backend} (--remote-backend): it is not installed")
    t = a.two_node_args
    faults = tuple(f.strip() for f in t.faults.split(",") if f.strip() and f.strip() != "none")
    try:
        return TwoNodeOptions(faults=faults, node_disk=t.node_disk)
    except ValueError as err:
        raise typer.BadParameter(str(err)) from None


def _cluster_serve(a: BenchArgs) -> ClusterServeOptions:
    """The cluster-serve scenario's options (the machine checked for what it needs first)."""
    from kvprefetch.bench.modes import remote_available, router_available
    from kvprefetch.bench.options import ClusterServeOptions
    from kvprefetch.testbed.netns import available

    if a.workload.workload == Workload.context or a.trace.trace is not None:
        raise typer.BadParameter("the cluster-serve scenario runs the chat and agent workloads (sessions of turns)")
    if (why := available()) is not None:
        raise typer.BadParameter(f"the cluster-serve scenario makes network namespaces: {why}")
    if not router_available():
        raise typer.BadParameter("the cluster-serve scenario runs vllm-router: pip install 'kvprefetch[router]' "
                                 "(make setup installs it)")  # fmt: skip
    if not remote_available("redis"):
        raise typer.BadParameter("the cluster-serve scenario's pool is redis-server: install it (apt redis-server)")
    c = a.cluster
    return ClusterServeOptions(node_loss=c.node_loss, pool=c.pool, node_kv_bytes=_size(a.engine.kv_cache))


def _asked_modes(a: BenchArgs) -> list[str]:
    """-m's modes (repeated or comma lists), each checked; the two-instance scenario adds its two."""
    from kvprefetch.bench.modes import CLUSTER_MODES, MODES, NODE_MODES, TWO_INSTANCE_MODES, TWO_NODE_MODES

    modes = [m.strip() for item in (a.run.mode or []) for m in item.split(",") if m.strip()]
    for m in modes:
        if m not in MODES:
            raise typer.BadParameter(f"unknown mode {m!r}; choose from {', '.join(MODES)}")
    if a.two_node:
        if bad := [m for m in modes if m not in TWO_NODE_MODES]:
            raise typer.BadParameter(f"the two-node scenario runs {', '.join(TWO_NODE_MODES)}, not {', '.join(bad)}")
        return modes or list(TWO_NODE_MODES)
    if a.cluster_serve:
        if bad := [m for m in modes if m not in CLUSTER_MODES]:
            raise typer.BadParameter(f"the cluster-serve scenario runs {', '.join(CLUSTER_MODES)}, "
                                     f"not {', '.join(bad)}")
        return modes or list(CLUSTER_MODES)
    if nodes := [m for m in modes if m in NODE_MODES]:
        raise typer.BadParameter(f"{', '.join(nodes)}: modes of --scenario two-node")
    if cluster := [m for m in modes if m in CLUSTER_MODES and m != "recompute"]:
        raise typer.BadParameter(f"{', '.join(cluster)}: modes of --scenario cluster-serve")
    if a.two_instance:
        modes = [m for m in modes if m not in TWO_INSTANCE_MODES] + list(TWO_INSTANCE_MODES)
    return modes


def _modes_and_levels(a: BenchArgs, agent: AgentBench | None) -> tuple[list[str], list[int]]:
    """The modes and concurrency levels: those asked, else the workload's (the agent's, quick's, the default)."""
    from kvprefetch.bench import plan
    from kvprefetch.bench.modes import PEER_MODES
    from kvprefetch.bench.options import DEFAULT_CONCURRENCY, DEFAULT_MODES

    asked, r = _asked_modes(a), a.run
    modes = asked or list(plan.AGENT_MODES if agent is not None else DEFAULT_MODES)
    if a.engine.engine_kv and not asked:
        modes = list(plan.ENGINE_MEMORY_MODES)
    if r.quick and not asked:  # an engine start and two cells each: the full run compares with them
        modes = [m for m in modes if m not in PEER_MODES]
    levels = plan.QUICK_CONCURRENCY if r.quick else DEFAULT_CONCURRENCY
    if a.cluster_serve:
        levels = plan.CLUSTER_CONCURRENCY
    elif agent is not None:
        levels = plan.AGENT_CONCURRENCY
    elif a.engine.engine_kv:
        levels = plan.ENGINE_MEMORY_CONCURRENCY
    return modes, parse_list(r.concurrency) if r.concurrency else list(levels)


def _regimes(text: str) -> tuple[float | None, ...]:
    """--regime: the run's regime, then the sweep's further ones."""
    from kvprefetch.bench.regime import parse_regime

    try:
        return tuple(parse_regime(x) for x in text.split(",") if x.strip()) or (parse_regime(""),)
    except ValueError as err:
        raise typer.BadParameter(str(err)) from None


def _agent(a: BenchArgs) -> AgentBench | None:
    """The agent workload with the chat options' counterparts as its sizes (quick: fewer sessions)."""
    w = a.workload
    if w.workload != Workload.agent:
        return None
    from kvprefetch.workload.agent import AgentBench, parse_gap

    try:
        gap_min, gap_max = parse_gap(w.gap_s)
    except ValueError as err:
        raise typer.BadParameter(str(err)) from None
    sizes = {"measured_turns": a.turns_asked, "task_tokens": w.history_tokens, "tool_tokens": w.user_tokens,
             "answer_tokens": w.output_tokens}  # fmt: skip
    agent = AgentBench(gap_min_s=gap_min, gap_max_s=gap_max, **{k: v for k, v in sizes.items() if v is not None})
    return replace(agent, min_sessions=2, sessions_per_concurrency=1.0) if a.run.quick else agent


def _chat(a: BenchArgs) -> tuple[ChatBench, bool]:
    """The chat workload: the default's preset (the whitepaper's R2 context), or plain multi-turn chat for
    --workload chat, --no-reuse, a trace or the two-instance scenario (True then); with the sizes asked."""
    from kvprefetch.workload.replay import CONTEXT, IN_RUN, ChatBench

    w = a.workload
    is_chat = w.workload == Workload.chat
    preset = is_chat or w.no_reuse or a.trace.trace is not None or a.two_instance
    chat = (IN_RUN if a.engine.engine_kv and is_chat else ChatBench()) if preset else CONTEXT
    two_node_chat = a.two_node and is_chat
    if a.run.quick:
        chat = replace(chat, min_sessions=2, sessions_per_concurrency=1.0)
    sizes = dict(system_tokens=w.system_tokens, history_tokens=w.history_tokens, user_tokens=w.user_tokens,
                 output_tokens=w.output_tokens, measured_turns=a.turns_asked, think_s=w.think_s,
                 sessions_per_concurrency=w.sessions_per_concurrency)  # fmt: skip
    kw = {k: v for k, v in sizes.items() if v is not None}
    if w.no_reuse:
        kw["reuse"] = False
    if a.cluster_serve and is_chat:
        # every turn of a conversation inside the run, the first included: the cluster starts each cell empty,
        # and a session's prefix is what its own turns computed on whichever node served them
        kw["prelude_turns"] = 0
    elif a.two_instance or two_node_chat:
        # the prelude holds each conversation's first message only: every later turn's prefix was computed
        # by the turn before it, on the other engine (a hit only where the cache is shared)
        kw["prelude_turns"] = 1
    return replace(chat, **kw), preset


def _trace(a: BenchArgs, chunk_tokens: int) -> TraceBench | None:
    """The trace to replay (its reuse summary printed first), or None."""
    t = a.trace
    if t.trace is None:
        return None
    from kvprefetch.trace_cli import bench_preamble
    from kvprefetch.workload.replay import TraceBench

    try:
        for line in bench_preamble(t.trace, t.trace_length_scale, chunk_tokens, t.trace_window_start,
                                   t.trace_max_prompt_tokens):  # fmt: skip
            console.print(line, markup=False)
    except (ValueError, OSError) as err:
        raise typer.BadParameter(str(err)) from None
    trace = TraceBench(path=str(t.trace), length_scale=t.trace_length_scale, chunk_tokens=chunk_tokens,
                       time_scale=t.trace_time_scale, use_timestamps=t.trace_timestamps,
                       utilisation=t.trace_utilisation or None, window_start=t.trace_window_start,
                       max_prompt_tokens=t.trace_max_prompt_tokens)  # fmt: skip
    return replace(trace, min_requests=4, requests_per_concurrency=1.0) if a.run.quick else trace


# ---- the run ------------------------------------------------------------------------------------------------------
def run_and_report(opts: BenchOptions) -> dict:
    """The run with a live progress bar and a line per cell, then results.json, report.md and the plots written
    and the terminal's tables printed."""
    from kvprefetch.bench.report import write_outputs
    from kvprefetch.bench.runner import Bench, simulator_prediction
    from kvprefetch.testbed.client import EngineError

    levels = ",".join(map(str, opts.concurrency))
    console.print(
        f"[bold]kvprefetch bench[/bold]: modes {', '.join(opts.modes)}; concurrency {levels}; "
        f"regime {opts.regime or 'native'}; out {opts.files.out}"
    )
    with _progress_bar() as bar:
        task = bar.add_task("starting", total=1.0)

        def progress(desc: str, done: float, total: float) -> None:
            kw = {"completed": done, "total": max(total, 1e-9)}
            if desc:
                kw["description"] = desc
            bar.update(task, **kw)

        bench = Bench(opts, progress=progress, on_row=lambda row: bar.console.print(_row_line(row)),
                      log=bar.console.print)  # fmt: skip
        try:
            results = bench.run()
        except EngineError as err:
            bar.stop()
            console.print(f"[red]kvprefetch bench: {err}[/red]")
            console.print(f"engine logs kept in {bench.files.work}")
            raise typer.Exit(1) from None
    results["simulator_prediction"] = simulator_prediction(results)
    out = opts.files.out or Path(".")
    files = write_outputs(results, out)
    _print_results(results)
    console.print(f"wrote {', '.join(str(out / f) for f in files)}")
    return results


def _progress_bar():
    from rich.progress import (
        BarColumn,
        Progress,
        TaskProgressColumn,
        TextColumn,
        TimeElapsedColumn,
        TimeRemainingColumn,
    )

    return Progress(TextColumn("[bold]bench[/bold] {task.description}"), BarColumn(), TaskProgressColumn(),
                    TimeElapsedColumn(), TextColumn("ETA"), TimeRemainingColumn(), console=console)  # fmt: skip


def _row_line(row: dict) -> str:
    """One cell's round as the live display prints it."""
    from kvprefetch.bench.report import TABLE_COLUMNS, row_cells

    r = CellShown.model_validate(row)
    if r.status != "ok":
        return f"  {r.mode:<13} c={r.concurrency:<3} {r.status}: {r.reason}"
    cell = dict(zip((h for _, h, _ in TABLE_COLUMNS), row_cells(row), strict=True))
    ttft, p90, tok_s, hit, disk, other = (cell[h] for h in ("TTFT p50 s", "p90 s", "out tok/s", "hit", "disk",
                                                            "other CPU"))  # fmt: skip
    return (f"  {r.mode:<15} c={r.concurrency:<3} round {r.round + 1}: TTFT p50 {ttft} s, p90 {p90} s, {tok_s} out "
            f"tok/s, hit {hit}, disk {disk}, errors {r.errors}, other CPU {other}")  # fmt: skip


class CellShown(Row):
    """What the live display and the summary read of a cell (a round's row, or the rounds' aggregate)."""

    round: int = 0
    errors: int | None = None


class RegimeShown(View):
    asked: Any = None
    measured: float | None = None


class WorkloadShown(View):
    name: str | None = None


class _Shown(View):
    """What the terminal's summary reads of results.json."""

    regime: RegimeShown = RegimeShown()
    workload: WorkloadShown = WorkloadShown()
    rows: list[CellShown] = Field(default_factory=list)
    notes: list[str] = Field(default_factory=list)


def _print_results(results: dict) -> None:
    """The results table (one per regime of a sweep), the cells that failed, the trace's reuse, the notes."""
    from kvprefetch.bench import engine_memory_report
    from kvprefetch.bench.modes import known_failure
    from kvprefetch.bench.report import regimes_of, rich_table, trace_reuse_lines

    shown = _Shown.model_validate(results)
    reg, name, raw = shown.regime, shown.workload.name, results.get("rows", [])
    title = f"kvprefetch bench: {name}, regime asked {reg.asked}"
    if reg.measured:
        title += f", measured R = {reg.measured:.1f}"
    wide = console if console.is_terminal and console.width >= 200 else Console(width=max(console.width, 210))
    regimes = regimes_of(raw)
    sizes = list(dict.fromkeys(r.engine_kv_bytes for r in shown.rows))
    for g in regimes:
        head = title if g == regimes[0] else f"kvprefetch bench: {name}, sweep: regime {g}"
        for size in sizes:
            picked = [i for i, r in enumerate(shown.rows) if r.regime == g and r.engine_kv_bytes == size]
            share = next((shown.rows[i].engine_kv_share for i in picked), None)
            wide.print(rich_table([raw[i] for i in picked], title=head + (
                f", engine KV {share:g} ({size / 2**20:,.0f} MiB)" if len(sizes) > 1 and size and share else "")))
    for line in engine_memory_report.terminal_lines(results):
        console.print(line, markup=False, highlight=False)
    for r in shown.rows:
        if r.status != "ok":
            console.print(f"[yellow]{r.mode} @ {r.concurrency}: {r.status}: {r.reason}[/yellow]")
            if why := known_failure(r.mode, r.reason):
                console.print(f"  known: {why}")
    for line in trace_reuse_lines(results):
        if line:
            console.print(line, markup=False)
    for n in shown.notes:
        console.print(f"[yellow]note:[/yellow] {n.splitlines()[0]}")
