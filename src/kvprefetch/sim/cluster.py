"""`kvprefetch sim --scenario cluster --nodes N` (issue 41): the whitepaper's deployment on N nodes reading one
shared array, projected from its single-node model (`kvprefetch.sim.scenarios.run_whitepaper`).

Each node is the whitepaper's server (480B FP8, TP8 on 8 MI308X, `concurrency` closed-loop clients of its R2
request) with one 100 GbE port; every node reads the same array (5.23 GB/s with parallel reads). With all nodes
loaded alike, a node reads at most min(its port, the array / N): its **share**. The projection runs one node at
its share (the array's latency and streams as measured), the others being its copies:

* a node's **demand** is what it reads per second when only its port limits it; the array **saturates** at
  N* = array / demand nodes (the port at demand >= port, which 5.23 GB/s < 12.5 GB/s rules out here);
* beyond N*, storage slows every node; prefetch still hides what the queue can cover, and recompute, which
  reads nothing, overtakes loading where the share falls below what a chunk's recompute costs.

The share is pessimistic below saturation (an idle node leaves its share to the others) and exact above it.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from pathlib import Path

from kvprefetch.sim.catalog import STORAGE
from kvprefetch.sim.policy import Policy
from kvprefetch.sim.scenarios import FIT, WhitepaperFit, run_whitepaper

PORT_BPS = 100e9 / 8  # a node's one 100 GbE port, bytes/s
ARRAY = "nvmeof-100gbe-raid0"
DEFAULT_NODES = (1, 2, 4, 8, 16)


@dataclass(frozen=True)
class ClusterPoint:
    """One node of N, all loaded alike: its storage share and what each policy gets from it."""

    nodes: int
    concurrency: int  # clients per node
    share_bps: float
    prefetch_ttft_p50_s: float
    sync_ttft_p50_s: float
    recompute_ttft_p50_s: float
    prefetch_tok_s: float  # per node
    sync_tok_s: float
    recompute_tok_s: float
    array_util: float  # the nodes' reads together / the array's bandwidth

    @property
    def prefetch_vs_sync(self) -> float:
        return self.prefetch_ttft_p50_s / self.sync_ttft_p50_s

    @property
    def recompute_vs_prefetch(self) -> float:
        return self.recompute_ttft_p50_s / self.prefetch_ttft_p50_s

    def to_json(self) -> dict:
        return asdict(self) | {"prefetch_vs_sync": self.prefetch_vs_sync,
                               "recompute_vs_prefetch": self.recompute_vs_prefetch}  # fmt: skip


@dataclass(frozen=True)
class ClusterProjection:
    concurrency: int
    array_bps: float
    port_bps: float
    demand_bps: float  # one node's reads per second, only its port limiting it (prefetch)
    points: list[ClusterPoint]

    @property
    def saturates_at(self) -> float:
        """N*: the number of nodes whose demand the array just carries."""
        return self.array_bps / self.demand_bps if self.demand_bps else float("inf")

    def to_json(self) -> dict:
        return {"concurrency": self.concurrency, "array_bps": self.array_bps, "port_bps": self.port_bps,
                "demand_bps": self.demand_bps, "array_saturates_at_nodes": self.saturates_at,
                "port_saturates": self.demand_bps >= self.port_bps,
                "points": [p.to_json() for p in self.points]}  # fmt: skip


def _read_rate(policy: Policy, concurrency: int, bps: float, fit: WhitepaperFit):
    res = run_whitepaper(policy, concurrency, fit=fit, read_bw=bps)
    return res, sum(v for k, v in res.bytes_read.items() if k != "host") / res.makespan if res.makespan else 0.0


def project(nodes: list[int], concurrency: int = 16, fit: WhitepaperFit = FIT) -> ClusterProjection:
    """The projection at each N of `nodes`, `concurrency` clients per node."""
    array = STORAGE[ARRAY].read_bw
    _, demand = _read_rate(Policy.PREFETCH, concurrency, PORT_BPS, fit)
    recompute = run_whitepaper(Policy.RECOMPUTE, concurrency, fit=fit)
    points = []
    for n in nodes:
        if n < 1:
            raise ValueError(f"--nodes: {n} is not a number of nodes")
        share = min(PORT_BPS, array / n)
        pf, pf_bps = _read_rate(Policy.PREFETCH, concurrency, share, fit)
        sync = run_whitepaper(Policy.ONDEMAND_SYNC, concurrency, fit=fit, read_bw=share)
        points.append(ClusterPoint(
            nodes=n, concurrency=concurrency, share_bps=share,
            prefetch_ttft_p50_s=pf.ttft_p(50), sync_ttft_p50_s=sync.ttft_p(50),
            recompute_ttft_p50_s=recompute.ttft_p(50), prefetch_tok_s=pf.output_tok_s,
            sync_tok_s=sync.output_tok_s, recompute_tok_s=recompute.output_tok_s,
            array_util=n * pf_bps / array))  # fmt: skip
    return ClusterProjection(concurrency, array, PORT_BPS, demand, points)


def lines(p: ClusterProjection) -> list[str]:
    """The projection as text: where the array saturates, then a row per N."""
    out = [f"one node's demand with prefetch at c={p.concurrency}: {p.demand_bps / 1e9:.2f} GB/s (only its "
           f"{p.port_bps / 1e9:.1f} GB/s port limiting it); the array's {p.array_bps / 1e9:.2f} GB/s carries "
           f"{p.saturates_at:.2f} such nodes; the port "
           f"{'saturates' if p.demand_bps >= p.port_bps else 'never saturates (the array is slower)'}",
           f"{'nodes':>5} {'share GB/s':>10} {'prefetch p50':>12} {'sync p50':>9} {'pf/sync':>7} {'recompute p50':>13} "
           f"{'rec/pf':>7} {'pf tok/s/node':>13} {'cluster tok/s':>13} {'array util':>10}"]  # fmt: skip
    for x in p.points:
        out.append(f"{x.nodes:>5} {x.share_bps / 1e9:>10.2f} {x.prefetch_ttft_p50_s:>11.1f}s "
                   f"{x.sync_ttft_p50_s:>8.1f}s {x.prefetch_vs_sync:>7.2f} {x.recompute_ttft_p50_s:>12.1f}s "
                   f"{x.recompute_vs_prefetch:>7.2f} "
                   f"{x.prefetch_tok_s:>13.1f} {x.nodes * x.prefetch_tok_s:>13.1f} {x.array_util:>9.0%}")  # fmt: skip
    return out


def plot(p: ClusterProjection, path: Path) -> Path:
    """TTFT p50 per policy against N (log-log), the saturation point marked."""
    from kvprefetch.sim.plots import ttft_vs_concurrency

    series = {label: {x.nodes: getattr(x, attr) for x in p.points}
              for attr, label in (("prefetch_ttft_p50_s", "prefetch"), ("sync_ttft_p50_s", "on-demand (sync)"),
                                  ("recompute_ttft_p50_s", "recompute"))}  # fmt: skip
    title = (f"N nodes on one {p.array_bps / 1e9:.2f} GB/s array, c={p.concurrency} per node\n(it saturates at "
             f"{p.saturates_at:.1f} nodes)")  # fmt: skip
    return ttft_vs_concurrency(series, path, title, xlabel="nodes sharing the array")
