"""Free-form runs: any catalog model/accelerator/storage, a workload, several policies and concurrencies."""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import ClassVar

import numpy as np

from kvprefetch.config import IOConfig
from kvprefetch.sim.calibration import (
    MEASURED_DISK_LATENCY_S,
    Calibration,
    charged_io_cpu,
    cpu_deployment,
    load_bench_calibration,
    load_path_measured,
    request_overhead,
)
from kvprefetch.sim.catalog import ACCELERATORS, MODELS, STORAGE, lookup
from kvprefetch.sim.costs import Deployment
from kvprefetch.sim.engine import SimConfig, simulate
from kvprefetch.sim.policy import Policy
from kvprefetch.sim.result import SimResult
from kvprefetch.sim.scenarios import context_requests
from kvprefetch.sim.tiers import TierSpec
from kvprefetch.workload.mooncake import TraceScaling, read_mooncake_trace
from kvprefetch.workload.request import BLOCK_TOKENS, Request
from kvprefetch.workload.synthetic import ChatWorkload, generate_chat

THIS_CPU = "this-cpu"
THIS_DISK = "this-disk"
"""The accelerator and storage a `kvprefetch bench` run measured on its own machine (`Setup.calibration`)."""

DEFAULT_MODEL = "qwen3-coder-480b-fp8"


@dataclass(frozen=True)
class Setup:
    """A deployment plus the tiers under it. `dram_gb=None` means unbounded host DRAM. `storage` names one storage
    tier or several, nearest first (`storage_names`). `storage_bw` overrides the farthest one's full bandwidth
    (its parallelism kept); `io_depth` is the reads kvprefetch keeps in flight.
    `queue_aware_eviction`: the DRAM tier keeps queued requests' prefetched KV until they are admitted (as the
    connector pins it) instead of plain LRU. `calibration`: a bench run's results.json, which defines `this-cpu`
    (the engine it served, with that run's model, on one device, its speeds measured rather than derived: `tp` and
    `efficiency` do not apply) and `this-disk` (the read rate its disk tier gave)."""

    model: str = DEFAULT_MODEL
    accelerator: str = "mi308x"
    tp: int = 8
    storage: str = "nvmeof-100gbe-raid0"
    efficiency: float = 0.4
    dram_gb: float | None = None
    storage_bw: float | None = None
    io_depth: int = IOConfig.model_fields["threads"].default
    calibration: str | None = None
    queue_aware_eviction: bool = False

    def __post_init__(self) -> None:
        if self.io_depth < 1:
            raise ValueError(f"io_depth must be at least 1, got {self.io_depth}")
        if self.tp < 1:
            raise ValueError(f"tp must be at least 1 device, got {self.tp}")
        if not 0 < self.efficiency <= 1:
            raise ValueError(f"efficiency is a share of peak FLOP/s, in (0, 1]; got {self.efficiency}")
        for name in ("dram_gb", "storage_bw"):
            value = getattr(self, name)
            if value is not None and not value > 0:
                raise ValueError(f"{name} must be positive, got {value}")

    def measured(self) -> Calibration:
        """The bench run's calibration behind `this-cpu` and `this-disk`."""
        if self.calibration is None:
            raise ValueError(
                f"{THIS_CPU} and {THIS_DISK} are measured, not catalogued: pass --calibration OUT/results.json of a "
                "`kvprefetch bench` run on this machine"
            )
        return load_bench_calibration(self.calibration)

    def deployment(self) -> Deployment:
        if self.accelerator == THIS_CPU:
            cal = self.measured()
            if self.model != cal.model:
                raise ValueError(f"{THIS_CPU} was calibrated serving {cal.model}: pass --model {cal.model}")
            return cpu_deployment(cal)
        return Deployment(
            lookup(MODELS, self.model, "model"),
            lookup(ACCELERATORS, self.accelerator, "accelerator"),
            tp=self.tp,
            efficiency=self.efficiency,
        )

    @property
    def storage_names(self) -> list[str]:
        """The storage tiers under DRAM, nearest first: `storage` may name several, comma-separated (a local NVMe
        in front of a shared pool: `local-nvme,nvmeof-100gbe-raid0`)."""
        names = [n.strip() for n in self.storage.split(",") if n.strip()]
        if not names or len(set(names)) != len(names):
            raise ValueError(f"storage names one or more distinct tiers, nearest first; got {self.storage!r}")
        return names

    def tiers(self, dep: Deployment) -> tuple[TierSpec, ...]:
        """Host DRAM, then each storage tier; `storage_bw` overrides the farthest one (the shared pool)."""
        block_bytes = BLOCK_TOKENS * dep.model.kv_bytes_per_token
        dram_blocks = None if self.dram_gb is None else int(self.dram_gb * 1e9 / block_bytes)
        tiers = [TierSpec("dram", dram_blocks, dep.accelerator.host_link_bw * dep.tp)]
        names = self.storage_names
        for name in names:
            override = self.storage_bw if name == names[-1] else None
            if name == THIS_DISK:  # measured through kvprefetch's own reader: its io depth is in the rate
                measured_bw = self.measured().disk_read_gbps * 1e9
                tiers.append(TierSpec(THIS_DISK, None, override or measured_bw, MEASURED_DISK_LATENCY_S,
                                      self.measured().disk_streams))
                continue
            storage = lookup(STORAGE, name, "storage")
            capacity = int(storage.capacity_bytes / block_bytes)
            bw = override or storage.read_bw
            tiers.append(TierSpec(storage.name, capacity, bw, storage.latency_s, storage.parallelism))
        return tuple(tiers)

    def machine_overheads(self, dep: Deployment) -> dict:
        """What `this-cpu` (deployed as `dep`) adds to a run's config: the engine's own time to add a request (the
        bench's vLLM runs in-process, front end included) and, as it copies KV on the cores it computes on, the CPU
        per byte moved."""
        if self.accelerator != THIS_CPU:
            return {}
        cal = self.measured()
        return {
            "request_overhead_s": request_overhead(cal, dep.accelerator.step_overhead_s),
            "io_cpu_s_per_byte": charged_io_cpu(cal),
            "io_cpu_on_loads": not load_path_measured(cal),
            "engine_block_tokens": cal.engine_block_tokens,
        }

    def storage_read_bw(self) -> dict[str, tuple[float, float]]:
        """Each storage tier's full read bandwidth and what `io_depth` reads in flight get of it."""
        return {t.name: (t.read_bw, t.bandwidth(self.io_depth)) for t in self.tiers(self.deployment())[1:]}


@dataclass(frozen=True)
class Load:
    """How requests arrive: `concurrency` sessions in a closed loop (each starts its next request when one ends),
    or sessions starting as a Poisson process at `rate_per_s`, an open loop: past what the deployment serves,
    its queue and TTFT grow for as long as arrivals last (`OPEN_LOOP_S`). Neither: a trace's own arrival times."""

    concurrency: int | None = None
    rate_per_s: float | None = None

    OPEN_LOOP_S: ClassVar[float] = 120.0
    MIN_SESSIONS: ClassVar[int] = 32

    def __post_init__(self) -> None:
        if self.concurrency is not None and self.rate_per_s is not None:
            raise ValueError("a load is a closed loop (concurrency) or an open one (rate), not both")
        if self.concurrency is not None and self.concurrency < 1:
            raise ValueError(f"concurrency must be at least 1, got {self.concurrency}")
        if self.rate_per_s is not None and not self.rate_per_s > 0:
            raise ValueError(f"arrival rate must be positive, got {self.rate_per_s}")

    @property
    def label(self) -> str:
        if self.concurrency is not None:
            return f"c={self.concurrency}"
        return "trace" if self.rate_per_s is None else f"{self.rate_per_s:g}/s"

    @property
    def x(self) -> float:
        """Where the load sits on a plot's x axis."""
        return float(self.concurrency or self.rate_per_s or 0)

    def sessions(self) -> int:
        """Sessions a synthetic workload generates: four per closed-loop client, or `OPEN_LOOP_S` of arrivals."""
        if self.concurrency is not None:
            return 4 * self.concurrency
        if self.rate_per_s is None:
            raise ValueError("a synthetic workload needs a concurrency or an arrival rate")
        return max(self.MIN_SESSIONS, math.ceil(self.rate_per_s * self.OPEN_LOOP_S))


def parse_workload(spec: str, load: Load, seed: int = 0) -> tuple[list[Request], bool]:
    """`chat`, `context:CTX,NEW,OUT` or `trace:PATH`; returns the requests and whether storage starts
    warm with every request's reusable prefix (true for `context`, the whitepaper's cold-read setup)."""
    kind, _, arg = spec.partition(":")
    if kind == "trace":
        if load.concurrency is not None or load.rate_per_s is not None:
            raise ValueError("a trace brings its own arrival times: drop --concurrency and --rate")
        return read_mooncake_trace(arg, TraceScaling(), seed=seed), False
    if kind == "chat":
        if load.rate_per_s is not None:
            chat = ChatWorkload(sessions=load.sessions(), arrival="poisson", rate_per_s=load.rate_per_s, seed=seed)
        else:
            chat = ChatWorkload(sessions=load.sessions(), concurrency=load.concurrency or 1, seed=seed)
        return generate_chat(chat), False
    if kind == "context":
        try:
            ctx, new, out = (int(x) for x in (arg or "16384,2048,128").split(","))
        except ValueError:
            example = "context:16384,2048,128"
            raise ValueError(f"context:CTX,NEW,OUT takes three token counts, e.g. {example}; got {spec!r}") from None
        if min(ctx, new, out) < 1:
            raise ValueError(f"context:CTX,NEW,OUT token counts must be positive; got {spec!r}")
        requests = context_requests(load.sessions(), ctx, new, out)
        if load.rate_per_s is not None:
            gaps = np.random.default_rng(seed).exponential(1.0 / load.rate_per_s, len(requests))
            requests = [replace(r, arrival_s=float(t)) for r, t in zip(requests, np.cumsum(gaps), strict=True)]
        return requests, True
    raise ValueError(f"unknown workload {spec!r}: use chat, context:CTX,NEW,OUT or trace:PATH")


def run_setup(setup: Setup, policy: Policy, workload: str, load: Load, seed: int = 0) -> SimResult:
    dep = setup.deployment()
    requests, warm = parse_workload(workload, load, seed)
    tiers = setup.tiers(dep)
    preload = {}
    if warm:
        stored = [b for r in requests for b in r.hash_ids[: (r.input_len - 1) // BLOCK_TOKENS]]
        preload = {("dram" if policy is Policy.DRAM else tiers[-1].name): stored}  # cold: in the farthest tier
    config = SimConfig(
        dep,
        policy,
        tiers,
        concurrency=load.concurrency,
        preload=preload,
        io_depth=setup.io_depth,
        queue_aware_eviction=setup.queue_aware_eviction,
        **setup.machine_overheads(dep),
    )
    return simulate(config, requests)


def sweep_storage_bw(
    setup: Setup,
    workload: str,
    load: Load,
    bws_gbps: Sequence[float],
    tolerance: float = 0.10,
    progress: Callable[[], None] | None = None,
) -> tuple[list[tuple[float, float, float]], float | None]:
    """TTFT p50 of prefetch vs the all-in-DRAM bound at each bandwidth of the farthest storage tier (its full
    bandwidth; `setup.io_depth` reads in flight may get less of it); the smallest bandwidth where prefetch lands
    within `tolerance` of the bound is the one that hides storage latency."""
    bound = run_setup(setup, Policy.DRAM, workload, load).ttft_p(50)
    rows, enough = [], None
    for bw in sorted(bws_gbps):
        s = replace(setup, storage_bw=bw * 1e9)
        ttft = run_setup(s, Policy.PREFETCH, workload, load).ttft_p(50)
        rows.append((bw, ttft, bound))
        if enough is None and ttft <= bound * (1 + tolerance):
            enough = bw
        if progress:
            progress()
    return rows, enough


def default_bandwidths() -> list[float]:
    return [float(x) for x in np.round(np.geomspace(0.25, 50, 12), 2)]
