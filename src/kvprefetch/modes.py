"""The serving modes, named once: what `kvprefetch bench` runs, how each sets up the connector, and which of the
simulator's policies models it.

The bench, the simulator's bench replay and the reports all speak of "modes" (`recompute`, `ondemand-sync`,
`prefetch`, ...); the connector speaks of its settings (`prefetch`, `load_mode`, `io.threads`) and the simulator
of its policies. Each mode below says all three, so the words cannot drift apart. The module sits below every
layer that names a mode and imports nothing of the package.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

LoadMode = Literal["async", "sync", "auto"]
"""The connector's `load_mode` (`kvprefetch.vllm.settings`): how a request's loads still below DRAM finish when
the scheduler reaches it."""


@dataclass(frozen=True)
class Mode:
    """One bench mode.

    connector: the engine runs kvprefetch's connector (else vLLM alone or a peer's connector).
    prefetch / load_mode / serial: the connector's settings (`serial`: one read in flight, `io.threads` = 1).
    dram_preloaded: every reusable chunk sits in the DRAM tier before the mode runs.
    keep_warm_s: the connector's lease on finish (a finished request's chunks kept in DRAM that long).
    warm_calls: the client calls the warm-up API when a tool call starts (the agent workload's known prefix).
    policy: the value of the simulator's `Policy` that models the mode; None: the simulator does not replay it.
    nodes: a mode of the two-node scenario only (two engines, each in a network namespace of its own);
    `recompute` runs there too. pool: its nodes' tier below DRAM is the shared pool, over the node's link.
    pinned: each session stays on one node (a cache-aware router); else turn k is served by node k mod 2.
    cluster: a mode of the cluster-serve scenario only (two `kvprefetch serve` nodes behind vllm-router; how each
    routes: `kvprefetch.bench.scenarios.cluster_serve.ROUTING`); `recompute` runs there too.
    """

    name: str
    description: str
    connector: bool = False
    prefetch: bool = False
    load_mode: LoadMode | None = None
    serial: bool = False
    dram_preloaded: bool = False
    keep_warm_s: float = 0.0
    warm_calls: bool = False
    policy: str | None = None
    two_instance: bool = False
    remote: bool = False
    peer: bool = False
    nodes: bool = False
    pool: bool = False
    pinned: bool = False
    cluster: bool = False


_ALL = (
    Mode("recompute", "vLLM alone: its own prefix cache (same engine KV size as the others), no external KV",
         policy="recompute"),
    Mode("ondemand", "kvprefetch, prefetch off: reads start when the scheduler reaches the request (async load)",
         connector=True, policy="ondemand"),
    Mode("ondemand-sync", "kvprefetch, prefetch off, loads block the engine step, parallel reads",
         connector=True, load_mode="sync", policy="ondemand-sync"),
    Mode("ondemand-serial", "kvprefetch, prefetch off, loads block the engine step, one read in flight (LMCache's "
         "default behaviour: the whitepaper's baseline)", connector=True, load_mode="sync", serial=True),
    Mode("prefetch", "kvprefetch, prefetch on arrival, load_mode auto (a late prefetch finishes in the step when "
         "that costs the batch less than parking the request)", connector=True, prefetch=True, load_mode="auto",
         policy="prefetch"),
    Mode("dram", "kvprefetch with every reusable chunk already in DRAM (the bound perfect prefetch approaches)",
         connector=True, prefetch=True, load_mode="auto", dram_preloaded=True, policy="dram"),
    Mode("vllm-example", "vLLM's built-in ExampleConnector on the same disk (what a user gets without us)", peer=True),
    Mode("lmcache", "LMCache's vLLM connector (CPU + local disk), CUDA machines where lmcache is installed",
         peer=True),
    # opt-in (not in the default run)
    Mode("lease", "prefetch, and every finished request's chunks leased in DRAM for 30 s (keep_warm_s; no client "
         "change)", connector=True, prefetch=True, load_mode="auto", keep_warm_s=30.0),
    Mode("warm", "prefetch, and the client names the next turn's known head (POST /v1/kvprefetch/warm, ttl 30 s) "
         "when its tool call starts", connector=True, prefetch=True, load_mode="auto", warm_calls=True),
    Mode("prefetch-remote", "kvprefetch, prefetch on; the prelude's KV in a remote tier (Redis or Mooncake on "
         "loopback), the engine's own disk tier empty", connector=True, prefetch=True, load_mode="auto",
         remote=True),
    Mode("shared-2x", "two engines at once, turns alternating between them, one node-local cache (same DRAM pool, "
         "same disk tier), prefetch on", connector=True, prefetch=True, load_mode="auto", two_instance=True),
    Mode("private-2x", "two engines at once, turns alternating between them, a cache each (own DRAM pool and disk "
         "tier, both starting from the prelude), prefetch on", connector=True, prefetch=True, load_mode="auto",
         two_instance=True),
    # the two-node scenario (`kvprefetch bench --scenario two-node`): turns alternate nodes unless pinned
    Mode("local-only", "two nodes, each with its own DRAM tier and no pool: a turn on the other node than its "
         "conversation's last finds nothing there", connector=True, prefetch=True, load_mode="auto", nodes=True),
    Mode("pool-sync", "two nodes, DRAM tier each over the shared pool (read over the node's link): loads from the "
         "pool block the engine step", connector=True, load_mode="sync", nodes=True, pool=True),
    Mode("pool-prefetch", "two nodes, DRAM tier each over the shared pool: prefetch on arrival, load_mode auto",
         connector=True, prefetch=True, load_mode="auto", nodes=True, pool=True),
    Mode("same-node", "pool-prefetch with each conversation pinned to one node (what a cache-aware router "
         "achieves)", connector=True, prefetch=True, load_mode="auto", nodes=True, pool=True, pinned=True),
    # the cluster-serve scenario (`kvprefetch bench --scenario cluster-serve`): vllm-router in front of two
    # `kvprefetch serve` nodes (prefetch on, DRAM + disk each, the shared pool below), the client behind it
    Mode("round-robin", "vllm-router --policy round_robin in front of two kvprefetch nodes", connector=True,
         prefetch=True, load_mode="auto", cluster=True),
    Mode("cache-aware", "vllm-router --policy cache_aware (its own guess of each node's prefixes, no events)",
         connector=True, prefetch=True, load_mode="auto", cluster=True),
    Mode("kv-gpu", "vllm-router --policy kv_aware fed only vLLM's own GPU block events (the nodes' tier_events "
         "off): what an event-fed router sees without kvprefetch", connector=True, prefetch=True, load_mode="auto",
         cluster=True),
    Mode("kv-tiers", "vllm-router --policy kv_aware fed every tier's events (GPU, kvprefetch's DRAM as CPU, disk "
         "and pool as STORAGE)", connector=True, prefetch=True, load_mode="auto", cluster=True),
    Mode("kv-tiers-lease", "kv-tiers on nodes that lease each finished request's chunks in their DRAM for 30 s "
         "(keep_warm_s)", connector=True, prefetch=True, load_mode="auto", keep_warm_s=30.0, cluster=True),
    Mode("pinned", "every session's turns sent to one node by the client (session i on node i mod 2): the "
         "perfect sticky router, the bound", connector=True, prefetch=True, load_mode="auto", pinned=True,
         cluster=True),
)  # fmt: skip

MODE: dict[str, Mode] = {m.name: m for m in _ALL}
"""Every mode by name, in the bench's order."""

SIMULATED: dict[str, str] = {m.name: m.policy for m in _ALL if m.policy is not None}
"""Mode -> the simulator's policy, for the modes the bench replay predicts (in this order: the bench derives each
simulated mode's calibration seed from its position)."""
