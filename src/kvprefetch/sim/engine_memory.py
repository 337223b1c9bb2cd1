"""`kvprefetch sim --scenario engine-memory` (issue 44, the whitepaper's R5): how much of an accelerator's KV
memory kvprefetch lets a deployment give back at equal throughput, projected for the whitepaper's 14B run.

The bench (`kvprefetch bench --engine-kv`) measures the curve on this machine's CPU engine; this projects the same
curve for a 14B model on one accelerator. Every input is declared (`Inputs`), none is fitted to a figure:

* the deployment: the catalog's `qwen-14b` (bf16 weights and KV) on one of the whitepaper's accelerators
  (`mi308x`; R5 does not say which accelerator ran the 14B), at the simulator's default efficiency; its **full**
  engine KV is what the accelerator leaves after the weights at vLLM's default gpu_memory_utilization (0.9);
* the tiers: a host DRAM tier per accelerator, then the whitepaper's array (5.23 GB/s, its catalog entry);
* the load, the bench's own (`kvprefetch.workload.replay.IN_RUN`) at the accelerator's scale: the simulator's
  multi-turn chat (`ChatWorkload`'s defaults: 2k system prompt, 8k first message, 512-token follow-ups,
  128-token answers, 4 turns, 5 s think time) in a closed loop of as many clients as the full KV holds
  conversations at their longest, so that vLLM alone keeps all its reuse at full size and none of it far
  below (the bench's full size is defined the same way);
* the engine's KV as vLLM's block pool (`SimConfig.engine_block_pool`) cut to each share.

Per share, `recompute` (vLLM alone: its prefix cache only), `prefetch` and `dram` (every tier hit already in DRAM)
run the same requests; the memory given back is the smallest share at which prefetch keeps `GIVE_BACK_SHARE` of
vLLM alone's full-size throughput (and, the second figure, a TTFT p50 within `GOAL_TTFT` of its).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from pathlib import Path

from kvprefetch.sim.catalog import ACCELERATORS, MODELS, STORAGE
from kvprefetch.sim.costs import Deployment
from kvprefetch.sim.engine import SimConfig, simulate
from kvprefetch.sim.policy import Policy
from kvprefetch.sim.result import SimResult
from kvprefetch.sim.tiers import TierSpec
from kvprefetch.workload.request import BLOCK_TOKENS
from kvprefetch.workload.synthetic import ChatWorkload, generate_chat

GIVE_BACK_SHARE = 0.90  # prefetch keeps this share of vLLM alone's full-size throughput (the bench's report too)
GOAL_TTFT = 1.2  # the bound on prefetch's TTFT p50, as a multiple of vLLM alone's at full size
POLICIES = (Policy.RECOMPUTE, Policy.PREFETCH, Policy.DRAM)


@dataclass(frozen=True)
class Inputs:
    """Everything the projection is told (nothing is fitted)."""

    model: str = "qwen-14b"
    accelerator: str = "mi308x"
    efficiency: float = 0.4  # of peak FLOP/s: the simulator's default for a catalog deployment
    storage: str = "nvmeof-100gbe-raid0"
    dram_gb: float = 256.0  # host DRAM tier per accelerator (a 2 TB, 8-accelerator server's share)
    chat: ChatWorkload = field(default_factory=ChatWorkload)
    sessions_per_client: int = 4
    concurrency: int | None = None  # None: as many clients as the full KV holds conversations at their longest
    shares: tuple[float, ...] = (1.0, 0.5, 0.25, 0.125)

    def deployment(self) -> Deployment:
        return Deployment(MODELS[self.model], ACCELERATORS[self.accelerator], tp=1, efficiency=self.efficiency)

    def longest_conversation(self) -> int:
        """A conversation's tokens at its last turn's end (means; each part varies by the chat's jitter)."""
        c = self.chat
        return c.system_tokens + c.first_user_tokens + (c.turns - 1) * c.user_tokens + c.turns * c.output_tokens

    def clients(self) -> int:
        if self.concurrency is not None:
            return self.concurrency
        return max(1, self.deployment().kv_capacity_tokens // self.longest_conversation())

    def tiers(self, dep: Deployment) -> tuple[TierSpec, ...]:
        block_bytes = BLOCK_TOKENS * dep.model.kv_bytes_per_token
        array = STORAGE[self.storage]
        return (TierSpec("dram", int(self.dram_gb * 1e9 / block_bytes), dep.accelerator.host_link_bw),
                TierSpec(array.name, int(array.capacity_bytes / block_bytes), array.read_bw, array.latency_s,
                         array.parallelism))  # fmt: skip


@dataclass(frozen=True)
class SharePoint:
    """One policy at one share of the full engine KV."""

    policy: str
    share: float
    kv_gb: float  # the engine's KV at this share
    output_tok_s: float
    ttft_p50_s: float
    hit_ratio: float

    def vs(self, full: SharePoint) -> tuple[float, float]:
        """(throughput, TTFT p50) as ratios to `full`."""
        return self.output_tok_s / full.output_tok_s, self.ttft_p50_s / full.ttft_p50_s


@dataclass(frozen=True)
class Projection:
    inputs: Inputs
    clients: int
    full_kv_tokens: int
    full_kv_gb: float
    points: list[SharePoint]

    def at(self, policy: Policy, share: float) -> SharePoint | None:
        return next((p for p in self.points if p.policy == policy.value and p.share == share), None)

    def full(self) -> SharePoint | None:
        return self.at(Policy.RECOMPUTE, 1.0)

    def give_back(self, ttft_within: float | None = None) -> SharePoint | None:
        """The smallest share at which prefetch keeps `GIVE_BACK_SHARE` of vLLM alone's full-size throughput
        (and, given `ttft_within`, a TTFT p50 at most that many times its), as the bench reads it; None if none."""
        full = self.full()
        if full is None:
            return None

        def keeps(p: SharePoint) -> bool:
            tput, ttft = p.vs(full)
            return tput >= GIVE_BACK_SHARE and (ttft_within is None or ttft <= ttft_within)

        ours = [p for p in self.points if p.policy == Policy.PREFETCH.value]
        return min(filter(keeps, ours), key=lambda p: p.share, default=None)

    def to_json(self) -> dict:
        found, tight = self.give_back(), self.give_back(GOAL_TTFT)
        return {"inputs": asdict(self.inputs), "clients": self.clients, "full_kv_tokens": self.full_kv_tokens,
                "full_kv_gb": self.full_kv_gb, "points": [asdict(p) for p in self.points],
                "give_back_share": None if found is None else 1 - found.share,
                "give_back_gb": None if found is None else self.full_kv_gb - found.kv_gb,
                "give_back_share_within_ttft": None if tight is None else 1 - tight.share}  # fmt: skip


def run(policy: Policy, share: float, inputs: Inputs, clients: int) -> SimResult:
    dep = inputs.deployment()
    blocks = max(1, int(share * dep.kv_capacity_tokens) // BLOCK_TOKENS)
    chat = ChatWorkload(**(asdict(inputs.chat) | {"sessions": inputs.sessions_per_client * clients,
                                                  "concurrency": clients, "arrival": "concurrency"}))  # fmt: skip
    config = SimConfig(dep, policy, inputs.tiers(dep), concurrency=clients, hbm_cache_blocks=blocks,
                       engine_block_pool=True)  # fmt: skip
    return simulate(config, generate_chat(chat))


def project(inputs: Inputs = Inputs(), progress=None) -> Projection:
    """Every policy at every share of the full engine KV, on the same requests."""
    dep = inputs.deployment()
    clients = inputs.clients()
    gb = dep.kv_capacity_tokens * dep.model.kv_bytes_per_token / 1e9
    pts = []
    for share in inputs.shares:
        if not 0 < share <= 1:
            raise ValueError(f"a share of the full engine KV is in (0, 1], got {share}")
        for policy in POLICIES:
            r = run(policy, share, inputs, clients)
            pts.append(SharePoint(policy.value, share, share * gb, r.output_tok_s, r.ttft_p(50), r.hit_ratio))
            if progress is not None:
                progress()
    return Projection(inputs, clients, dep.kv_capacity_tokens, gb, pts)


def lines(p: Projection) -> list[str]:
    """The projection as text: its inputs, a row per share, and the memory given back."""
    i, full = p.inputs, p.full()
    c = i.chat
    out = [f"{i.model} on 1x {i.accelerator} (efficiency {i.efficiency:g}); full engine KV {p.full_kv_gb:.1f} GB "
           f"({p.full_kv_tokens:,} tokens: HBM x 0.9 - weights); tiers: {i.dram_gb:g} GB DRAM, then {i.storage}",
           f"load: {p.clients} closed-loop clients (the full KV holds {p.clients} conversations of "
           f"{i.longest_conversation():,} tokens), {i.sessions_per_client} sessions each; chat of {c.turns} turns: "
           f"{c.system_tokens} system + {c.first_user_tokens} first + {c.user_tokens} per follow-up, "
           f"{c.output_tokens}-token answers, {c.think_s:g} s think time",
           f"{'share':>6} {'KV GB':>7} {'freed GB':>8} {'policy':>10} {'tok/s':>9} {'vs full':>8} {'TTFT p50':>9} "
           f"{'vs full':>8} {'hit':>5}"]  # fmt: skip
    for x in sorted(p.points, key=lambda x: (-x.share, POLICIES.index(Policy(x.policy)))):
        tput, ttft = x.vs(full) if full else (float("nan"), float("nan"))
        freed = p.full_kv_gb - x.kv_gb
        out.append(f"{x.share:>6g} {x.kv_gb:>7.1f} {freed:>8.1f} {x.policy:>10} {x.output_tok_s:>9.1f} "
                   f"{tput:>8.2f} {x.ttft_p50_s:>8.2f}s {ttft:>8.2f} {x.hit_ratio:>5.0%}")  # fmt: skip
    for found, what in ((p.give_back(), "throughput"), (p.give_back(GOAL_TTFT), f"throughput and TTFT p50 within "
                                                        f"{GOAL_TTFT:g}x")):  # fmt: skip
        if found is None:
            out.append(f"memory given back at equal {what}: none (prefetch keeps {GIVE_BACK_SHARE:.0%} of vLLM alone's "
                       "full-size throughput at no smaller share)")  # fmt: skip
            continue
        tput, ttft = found.vs(full) if full else (float("nan"), float("nan"))
        out.append(f"memory given back at equal {what}: {1 - found.share:.0%} of the engine KV, "
                   f"{p.full_kv_gb - found.kv_gb:.1f} GB of HBM per accelerator (prefetch at {found.share:g}: "
                   f"throughput {tput:.2f}x, TTFT p50 {ttft:.2f}x vLLM alone's at full size)")  # fmt: skip
    return out


def plot(p: Projection, path: Path) -> Path:
    """Throughput and TTFT p50 per policy against the engine's KV (GB)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (top, bottom) = plt.subplots(2, 1, figsize=(7, 7), sharex=True)
    for policy in POLICIES:
        pts = sorted((x for x in p.points if x.policy == policy.value), key=lambda x: x.kv_gb)
        top.plot([x.kv_gb for x in pts], [x.output_tok_s for x in pts], marker="o", label=policy.value)
        bottom.plot([x.kv_gb for x in pts], [x.ttft_p50_s for x in pts], marker="o", label=policy.value)
    if (full := p.full()) is not None:
        top.axhline(GIVE_BACK_SHARE * full.output_tok_s, color="gray", linestyle=":", linewidth=1,
                    label=f"{GIVE_BACK_SHARE:.0%} of vLLM alone at full KV")  # fmt: skip
    top.set_ylabel("output tokens/s")
    top.set_title(f"{p.inputs.model} on 1x {p.inputs.accelerator}, {p.clients} clients (simulated)")
    bottom.set_ylabel("TTFT p50 (s)")
    bottom.set_xlabel("engine KV cache (GB)")
    for ax in (top, bottom):
        ax.set_xscale("log", base=2)
        ax.grid(True, alpha=0.3)
    top.legend(fontsize=8)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path
