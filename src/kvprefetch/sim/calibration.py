"""'This CPU' as an accelerator, from a few numbers `kvprefetch bench` can measure, and the benchmark's
TTFT p50 per mode and concurrency predicted from them.

Not wired to the benchmark yet (it does not exist at the time of writing): it will write a calibration
JSON like `EXAMPLE`, and its report will call `predict_bench_ttft` to print predicted vs measured.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, replace
from pathlib import Path

from kvprefetch.sim.catalog import MODELS, Accelerator, Model
from kvprefetch.sim.costs import Deployment
from kvprefetch.sim.engine import SimConfig, simulate
from kvprefetch.sim.policy import Policy
from kvprefetch.sim.tiers import TierSpec
from kvprefetch.workload.request import Request
from kvprefetch.workload.synthetic import ChatWorkload, generate_chat

BENCH_MODES: dict[str, Policy] = {
    "recompute": Policy.RECOMPUTE,
    "ondemand": Policy.ONDEMAND,
    "ondemand-sync": Policy.ONDEMAND_SYNC,
    "prefetch": Policy.PREFETCH,
    "dram": Policy.DRAM,
}


@dataclass(frozen=True)
class Calibration:
    """Measured on the machine itself: prefill speed, one decode step, disk read speed, chunk geometry."""

    prefill_tokens_per_s: float
    decode_step_s: float
    disk_read_gbps: float
    chunk_bytes: int
    chunk_tokens: int
    model: str = "dummy-llama"
    token_budget: int = 2048

    @classmethod
    def load(cls, path: str | Path) -> Calibration:
        return cls(**json.loads(Path(path).read_text()))


EXAMPLE = Calibration(
    prefill_tokens_per_s=2000.0,
    decode_step_s=0.02,
    disk_read_gbps=1.5,
    chunk_bytes=16384 * 256,
    chunk_tokens=256,
)
"""Shape of the JSON the benchmark will write; the numbers are placeholders, not measurements."""


def cpu_deployment(cal: Calibration) -> Deployment:
    """A deployment whose roofline reproduces the measured prefill speed and decode step time."""
    base = MODELS[cal.model]
    model: Model = replace(base, kv_bytes_per_token_override=cal.chunk_bytes / cal.chunk_tokens)
    flops = cal.prefill_tokens_per_s * 2.0 * model.active_params
    cpu = Accelerator(
        "this-cpu",
        flops=flops,
        hbm_bytes=64e9,
        hbm_bw=1e15,
        host_link_bw=20e9,
        step_overhead_s=cal.decode_step_s,
        source="measured by kvprefetch bench (calibration JSON)",
    )
    return Deployment(model, cpu, tp=1, efficiency=1.0, token_budget=cal.token_budget)


def predict_bench_ttft(
    cal: Calibration,
    modes: list[str],
    concurrencies: list[int],
    workload: ChatWorkload | None = None,
) -> dict[tuple[str, int], float]:
    """Predicted TTFT p50 for each (mode, concurrency), on the bench's synthetic chat workload.

    The disk tier holds everything written (write-through); DRAM holds nothing until fetched, except in
    `dram` mode where every turn's reusable prefix is already there.
    """
    dep = cpu_deployment(cal)
    out = {}
    for c in concurrencies:
        spec = replace(workload or ChatWorkload(sessions=4 * c), concurrency=c, arrival="concurrency")
        requests: list[Request] = generate_chat(spec)
        for mode in modes:
            policy = BENCH_MODES[mode]
            tiers = (
                TierSpec("dram", None, dep.accelerator.host_link_bw),
                TierSpec("disk", None, cal.disk_read_gbps * 1e9, 1e-4),
            )
            preload = {}
            if policy is Policy.DRAM:
                preload = {"dram": [b for r in requests for b in r.hash_ids]}
            config = SimConfig(
                dep, policy, tiers, concurrency=c, preload=preload, hbm_cache_blocks=0, block_tokens=spec.block_tokens
            )
            out[(mode, c)] = simulate(config, requests).ttft_p(50)
    return out
