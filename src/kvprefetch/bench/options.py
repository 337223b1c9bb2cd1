"""A bench run as asked (`kvprefetch bench`'s options, or a test's): the pipeline's input.

`BenchOptions` holds what every scenario shares (modes, levels, regimes, rounds) and one part per concern (the
engine, the store, the workload, the run's files); the scenario is a tagged union (`ScenarioOptions`: its `kind`
names it in `kvprefetch.bench.scenarios.SCENARIOS`), each kind carrying only its own options, so a run cannot ask
for two scenarios at once or for a scenario's option without the scenario.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from kvprefetch.bench.regime import DEFAULT_REGIME
from kvprefetch.testbed.topology import TopologyKind
from kvprefetch.workload.agent import AgentBench
from kvprefetch.workload.replay import CONTEXT, CONTEXT_MAX_NUM_SEQS, ChatBench, TraceBench

DEFAULT_MODES = ["recompute", "ondemand-serial", "ondemand-sync", "ondemand", "prefetch", "dram", "vllm-example",
                 "lmcache"]  # fmt: skip
DEFAULT_CONCURRENCY = [1, 8, 16, 32]
DRAM_LIFE_S = 0.4
"""The agent workload's DRAM pressure (`kvprefetch.testbed.pressure`): an unpinned chunk lasts this long after its
last use, as under other engines' traffic on the node; below the shortest default tool gap (0.5 s), so an
unleased head is on disk by its next turn."""


@dataclass(frozen=True)
class KvAsk:
    """One engine KV size of the engine-memory sweep as asked: a share of the run's full size, or bytes."""

    value: float
    absolute: bool = False  # value is bytes, not a share

    def resolve(self, full_bytes: int) -> int:
        return int(self.value) if self.absolute else int(self.value * full_bytes)


# ---- the scenario: a tagged union --------------------------------------------------------------------------------
@dataclass(frozen=True)
class SingleOptions:
    """One engine per mode (`kvprefetch.bench.scenarios.single`), at the run's engine KV size or at each size of
    the engine-memory sweep (`--engine-kv`). The two-instance modes a single run asks for run after its cells."""

    kind: Literal["single"] = "single"
    engine_kv: tuple[KvAsk, ...] = ()  # the engine-memory sweep's sizes; () if none


@dataclass(frozen=True)
class TwoInstanceOptions:
    """The single scenario's modes, then the two-instance modes (`kvprefetch.bench.scenarios.two_instance`): two
    engines on one node, each session's turns alternating between them."""

    kind: Literal["two-instance"] = "two-instance"


FAULTS = ("link", "pool")
"""The faults `--faults` may ask: every node's link to the pool down, the pool's server SIGKILLed."""


@dataclass(frozen=True)
class TwoNodeOptions:
    """Two nodes over shaped links to one pool (`kvprefetch.bench.scenarios.two_node`): the faults to inject
    (after the rounds), a local disk tier on each node."""

    kind: Literal["two-node"] = "two-node"
    faults: tuple[str, ...] = FAULTS
    node_disk: bool = False
    link_down_s: float = 10.0
    pool_down_s: float = 5.0
    # after each fault's end, before the next (and the end): long enough for a pass of the level that recomputes
    # everything (after the pool's restart) and the next pass, which can find what it wrote
    settle_s: float = 15.0

    def __post_init__(self) -> None:
        bad = [f for f in self.faults if f not in FAULTS]
        if bad:
            raise ValueError(f"unknown fault(s) {', '.join(bad)}: choose from {', '.join(FAULTS)}")


@dataclass(frozen=True)
class ClusterServeOptions:
    """Two `kvprefetch serve` nodes behind vllm-router (`kvprefetch.bench.scenarios.cluster_serve`): whether the
    node-loss run follows the rounds (kv-tiers at the highest level, one node SIGKILLed and restarted
    `restart_after_s` later), whether the nodes share a pool (False: each its own DRAM and disk only, so a turn
    served away from its KV recomputes it), and the nodes' engine KV (None: room for two of the longest requests,
    so that a node's live sessions outgrow it and their KV is in the node's tiers when their next turns come)."""

    kind: Literal["cluster-serve"] = "cluster-serve"
    node_loss: bool = True
    pool: bool = True
    restart_after_s: float = 15.0
    node_kv_bytes: int | None = None


ScenarioOptions = SingleOptions | TwoInstanceOptions | TwoNodeOptions | ClusterServeOptions


# ---- the parts ---------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class EngineOptions:
    """The engines' model and vLLM arguments, and where their threads run."""

    model: str | None = None  # default: the packaged tiny dummy Llama
    engine_args: dict[str, Any] = field(default_factory=dict)
    kv_cache_bytes: int | None = None  # engine KV cache; default: room for 4 of the longest requests
    max_num_batched_tokens: int = 2048
    max_num_seqs: int | None = CONTEXT_MAX_NUM_SEQS  # None: the largest concurrency (nothing queues)
    topology: TopologyKind = "gpu-node"  # where the engines' threads run (kvprefetch.testbed.topology)


@dataclass(frozen=True)
class StoreOptions:
    """The connector's store in every mode that has one."""

    chunk_tokens: int = 256
    dram_bytes: int | None = None  # DRAM tier of the non-`dram` modes; default: see `plan.store_sizing`
    io_threads: int = 4
    remote_backend: str = "redis"  # the prefetch-remote mode's server: redis or mooncake


@dataclass(frozen=True)
class WorkloadOptions:
    """The workload: chat (a `ChatBench` preset, the whitepaper's context by default), a trace, or the agent's."""

    chat: ChatBench = CONTEXT
    trace: TraceBench | None = None
    agent: AgentBench | None = None  # the agent workload (`kvprefetch.workload.agent`)
    dram_life_s: float = DRAM_LIFE_S  # the agent workload's DRAM pressure


@dataclass(frozen=True)
class FileOptions:
    """Where the run writes: its results, its temporary disk tiers, and what it keeps."""

    out: Path | None = None
    cache_dir: Path | None = None
    keep_cache: bool = False
    step_log: bool = False  # write every engine step of every cell to <out>/steps/<mode>-c<c>.jsonl


@dataclass(frozen=True)
class BenchOptions:
    """The run as asked."""

    modes: list[str] = field(default_factory=lambda: list(DEFAULT_MODES))
    concurrency: list[int] = field(default_factory=lambda: list(DEFAULT_CONCURRENCY))
    # the run's regime (None: native), in which the goals are judged, then a sweep's further ones
    regimes: tuple[float | None, ...] = (DEFAULT_REGIME,)
    repeats: int = 3  # rounds of every cell, modes interleaved within a round (kvprefetch.bench.rounds)
    quick: bool = False
    calibrate_modes: bool = True  # measure each simulated mode's engine too, after its cells (~15 s each)
    cell_timeout_s: float = 1800
    engine: EngineOptions = EngineOptions()
    store: StoreOptions = StoreOptions()
    workload: WorkloadOptions = WorkloadOptions()
    files: FileOptions = FileOptions()
    scenario: ScenarioOptions = SingleOptions()

    def __post_init__(self) -> None:
        if not self.regimes:
            raise ValueError("regimes: at least the run's own (None for native)")

    @property
    def regime(self) -> float | None:
        """The run's regime (None: native); the goals are judged in it."""
        return self.regimes[0]

    @property
    def sweep(self) -> tuple[float | None, ...]:
        """A sweep's further regimes, each measured as the first."""
        return self.regimes[1:]

    @property
    def engine_kv(self) -> tuple[KvAsk, ...]:
        """The engine-memory sweep's sizes (only the single scenario has them)."""
        return self.scenario.engine_kv if isinstance(self.scenario, SingleOptions) else ()
