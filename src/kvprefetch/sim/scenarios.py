"""The whitepaper's tests (R1, R2, R2-recompute, R3) set up for the simulator, with the published figures.

What the setup physically is (all the simulator is told):

* a closed loop of `concurrency` clients, each sending `REQUESTS_PER_CLIENT` requests back to back; every
  request is a long context of its own that sits only in the storage array when it arrives ("cold reads";
  host DRAM starts empty, the engine's own prefix cache never holds it), plus a few new tokens, and asks
  for a short answer;
* `ondemand-sync`, the whitepaper's "no prefetch" baseline: the scheduler admits waiting requests as the
  token budget allows (only new tokens count), and the step that admits them waits until their KV has come
  from storage through DRAM into HBM, one request after another on the array: the whole batch stalls. In
  a closed loop the clients fall into step (they finish together and come back together), so TTFT is the
  queue of loads in front of a request, and grows with concurrency;
* `prefetch`: a request's storage -> DRAM read starts on arrival (one FIFO on the array), DRAM -> HBM when
  admitted; the engine never waits on storage, so decode overlaps the reads;
* `recompute`: no external KV; the whole context is prefilled, chunked by the token budget, FCFS.

The whitepaper states neither context, new tokens, output length, kernel efficiency nor token budget:
those are the free parameters in `WhitepaperFit`. Each is fitted (`kvprefetch.sim.fit`) on the one row it
governs, marked `fitted=True`; every other row is a prediction. Not free: the array's read bandwidth
(the whitepaper's own top R1 measurement) and its parallelism (R1 read it at 0.98 GB/s serially, one stream,
and at 5.23 GB/s in parallel: `R1_IO_DEPTH`), the model and accelerator shapes (catalog), the host link.

The fitted efficiency is low (2% of the catalog's estimated MI308X FP8 peak, ~1.1k prefill tokens/s for
the 480B model): it is what the paper's recompute baseline measured (18x slower than prefetch), and it
absorbs all the roofline cannot see (FP8 MoE kernels on ROCm, TP8 all-reduce, long-context attention, an
estimated peak).

R1 runs on R2's deployment too. Its deployment is not stated apart from "one GPU" (the issue's words), but
the whitepaper names one model, the 480B, whose FP8 weights (480 GB) need at least three MI308X (192 GB
each): "one GPU" cannot be literal for it, so R1 is read as one instance of the paper's own deployment
reading its array with one stream or six. Nothing is invented; only R1's context is fitted, on its
0.98 GB/s point. The other reading, a model the paper never names on one GPU, would rest on a guess.

The c=8 rows stay ~18% (sync) and ~24% (prefetch) below the paper (`C8_NOTE`) and the c=16 gain 15% below;
they are set aside, not fitted further. docs/sim-fitting.md keeps the readings of the setup that were tried.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from kvprefetch.sim.catalog import ACCELERATORS, MODELS, STORAGE
from kvprefetch.sim.costs import Deployment
from kvprefetch.sim.engine import SimConfig, simulate
from kvprefetch.sim.policy import Policy
from kvprefetch.sim.result import SimResult
from kvprefetch.sim.tiers import TierSpec
from kvprefetch.workload.request import BLOCK_TOKENS, Request, TokenRecipe

REQUESTS_PER_CLIENT = 6
"""Each closed-loop client sends this many requests (the whitepaper does not say); the first wave of
every run is a burst, later ones are the steady state the p50 reports."""

OUTPUT_JITTER = 0.1
"""Answer lengths vary by +-10% (uniform, seeded): real answers never all end on the same token."""

PARALLEL_READS = 6
"""Reads the whitepaper's reader keeps in flight in R2, R3 and R1's fast point: its parallel reads reached the
array's 5.23 GB/s, which takes at least 5.23 / 0.98 streams (the array's `parallelism`); R1's slow point
read serially, one stream (`R1_IO_DEPTH`)."""

R1_IO_DEPTH = {"0.98GB/s": 1, "5.23GB/s": PARALLEL_READS}
"""R1's two points are the same array read two ways: serially (0.98 GB/s) and in parallel (5.23 GB/s)."""


@dataclass(frozen=True)
class WhitepaperFit:
    """Free parameters of the whitepaper runs; each is fitted on one row (see `FITTED_BY`)."""

    context_tokens: int = 17408  # 4.4 GB of KV per request: 0.85 s from the array at 5.23 GB/s
    new_tokens: int = 243
    output_tokens: int = 64
    efficiency: float = 0.0199  # of the catalog's (estimated) MI308X FP8 peak; see the catalog entry
    token_budget: int = 1824  # vLLM's max_num_batched_tokens (only new tokens count)
    r1_context_tokens: int = 8704  # 2.2 GB of KV per request: 2.26 s from one 0.98 GB/s stream


FIT = WhitepaperFit()

FITTED_BY: dict[str, tuple[str, str]] = {
    "context_tokens": ("seed-r2", "ttft_p50_s prefetch c32"),
    "new_tokens": ("seed-r2", "ttft_p50_s ondemand-sync c32"),
    "output_tokens": ("seed-r2-recompute", "output_tok_s prefetch c16"),
    "efficiency": ("seed-r2-recompute", "output_tok_s recompute c16"),
    "token_budget": ("seed-r2-recompute", "ttft_p50_s recompute c16"),
    "r1_context_tokens": ("seed-r1", "ttft_p50_s 0.98GB/s"),
}
"""Which published row pins each free parameter (the parameter the row is most sensitive to)."""


C8_NOTE = (
    "beyond 15% by construction: with the per-request storage time the c32 row implies, no saturated "
    "closed loop of 8 clients can wait longer than 8/32 of the c32 TTFT (6.6 s prefetch, 8.9 s sync); "
    "the published c8 points lie 14% above that bound, so the c8 runs must have had slower storage or "
    "a fixed overhead the c16/c32 runs did not"
)
GAIN_NOTE = (
    "the model's gain is flat in concurrency (the storage idle time per request is one admission "
    "step at any load); published 29% at c8 and 40% at c16 cannot both be met within 15% by a flat "
    "gain, and c16 is the run with the outlying TTFT cut (-32% vs -26% at c8 and c32)"
)
R1_NOTE = (
    "R1's deployment is not stated: read as one instance of the whitepaper's own (480B, TP8), since the 480B "
    "cannot run on one GPU; an unnamed smaller model on one GPU would be a guess (module docstring)"
)


@dataclass(frozen=True)
class Published:
    """One published figure: `value` is compared against; ranges are compared at their midpoint."""

    scenario: str
    metric: str
    value: float
    note: str = ""

    @property
    def fitted(self) -> bool:
        return (self.scenario, self.metric) in FITTED_BY.values()


PUBLISHED: tuple[Published, ...] = (
    Published("seed-r2", "ttft_p50_s ondemand-sync c8", 10.17, note=C8_NOTE),
    Published("seed-r2", "ttft_p50_s prefetch c8", 7.53, note=C8_NOTE),
    Published("seed-r2", "ttft_p50_s ondemand-sync c16", 11.85 / (1 - 0.32), note="derived: 11.85 s at -32%"),
    Published("seed-r2", "ttft_p50_s prefetch c16", 11.85),
    Published("seed-r2", "ttft_p50_s ondemand-sync c32", 35.73),
    Published("seed-r2", "ttft_p50_s prefetch c32", 26.35),
    Published("seed-r2", "throughput_gain_pct c8", 29.0),
    Published("seed-r2", "throughput_gain_pct c16", 40.0, note=GAIN_NOTE),
    Published("seed-r2-recompute", "ttft_p50_s recompute c16", 149.5),
    Published("seed-r2-recompute", "output_tok_s prefetch c16", 74.9),
    Published("seed-r2-recompute", "output_tok_s recompute c16", 4.1),
    Published("seed-r3", "throughput_gain_pct c16", 35.5, note="range 35-36%, midpoint"),
    Published("seed-r3", "throughput_gain_pct c32", 35.5, note="range 35-36%, midpoint"),
    Published("seed-r1", "ttft_p50_s 0.98GB/s", 37.97),
    Published("seed-r1", "ttft_p50_s 5.23GB/s", 9.30, note=R1_NOTE),
)


def context_requests(
    n: int, context: int, new: int, output: int, start_id: int = 0, jitter: float = 0.0, seed: int = 0
) -> list[Request]:
    """`n` independent requests, each with its own `context`-token prefix (stored) plus `new` tokens.

    `jitter` varies each answer's length uniformly by +-jitter (seeded), keeping the mean."""
    recipe = TokenRecipe("trace", 0)
    blocks = -(-(context + new) // BLOCK_TOKENS)
    outs = np.full(n, output)
    if jitter > 0:
        rng = np.random.default_rng(seed)
        outs = np.maximum(1, np.rint(output * (1.0 + jitter * rng.uniform(-1.0, 1.0, n)))).astype(int)
    out = []
    for i in range(n):
        base = (start_id + i) * (blocks + 1)
        ids = tuple(range(base, base + blocks))
        out.append(Request(0.0, start_id + i, 0, context + new, int(outs[i]), ids, recipe))
    return out


def run_whitepaper(
    policy: Policy,
    concurrency: int,
    *,
    fit: WhitepaperFit = FIT,
    model: str = "qwen3-coder-480b-fp8",
    tp: int = 8,
    read_bw: float | None = None,
    context: int | None = None,
    io_depth: int = PARALLEL_READS,
) -> SimResult:
    """One closed-loop run of the whitepaper's setup: every request's context sits only in the storage
    tier when it arrives ("cold reads"); DRAM starts empty. `read_bw` overrides the array's bandwidth (the
    share one of several instances gets); `io_depth` is the reads in flight."""
    storage = STORAGE["nvmeof-100gbe-raid0"]
    dep = Deployment(
        MODELS[model], ACCELERATORS["mi308x"], tp=tp, efficiency=fit.efficiency, token_budget=fit.token_budget
    )
    ctx = fit.context_tokens if context is None else context
    requests = context_requests(
        REQUESTS_PER_CLIENT * concurrency, ctx, fit.new_tokens, fit.output_tokens, jitter=OUTPUT_JITTER
    )
    stored = [b for r in requests for b in r.hash_ids[: ctx // BLOCK_TOKENS]]
    tiers = (
        TierSpec("dram", None, dep.accelerator.host_link_bw * tp),
        TierSpec("nvmeof", None, read_bw or storage.read_bw, storage.latency_s, storage.parallelism),
    )
    preload = {"dram": stored} if policy is Policy.DRAM else {"nvmeof": stored}
    config = SimConfig(
        dep,
        policy,
        tiers,
        concurrency=concurrency,
        preload=preload,
        load_vs_recompute=False,
        hbm_cache_blocks=0,
        io_depth=io_depth,
    )
    return simulate(config, requests)


def _gain(fast: SimResult, slow: SimResult) -> float:
    return 100.0 * (fast.output_tok_s / slow.output_tok_s - 1.0)


def simulate_metric(p: Published, fit: WhitepaperFit = FIT) -> float:
    """The simulator's value for one published figure."""
    words = p.metric.split()
    if p.scenario == "seed-r1":
        # R1 measures the storage path itself: loads on demand, read serially or in parallel. Its TTFT is linear
        # in 1/bandwidth with a positive intercept (37.97 = 34.6/0.98 + 2.7; 9.30 = 34.6/5.23 + 2.7): serialised
        # loads plus compute. With prefetch the intercept would be negative (decode overlaps the queue).
        res = run_whitepaper(
            Policy.ONDEMAND_SYNC, 16, fit=fit, context=fit.r1_context_tokens, io_depth=R1_IO_DEPTH[words[1]]
        )
        return res.ttft_p(50)
    conc = int(words[-1].removeprefix("c"))
    if p.scenario == "seed-r3":
        # two TP4 instances on one machine share the array: each gets half the clients and bandwidth
        half_bw = STORAGE["nvmeof-100gbe-raid0"].read_bw / 2
        pf = run_whitepaper(Policy.PREFETCH, conc // 2, fit=fit, tp=4, read_bw=half_bw)
        sync = run_whitepaper(Policy.ONDEMAND_SYNC, conc // 2, fit=fit, tp=4, read_bw=half_bw)
        return _gain(pf, sync)
    if words[0] == "throughput_gain_pct":
        return _gain(
            run_whitepaper(Policy.PREFETCH, conc, fit=fit), run_whitepaper(Policy.ONDEMAND_SYNC, conc, fit=fit)
        )
    policy = Policy(words[1])
    res = run_whitepaper(policy, conc, fit=fit)
    return res.ttft_p(50) if words[0] == "ttft_p50_s" else res.output_tok_s


def scenario_names() -> list[str]:
    return [*sorted({p.scenario for p in PUBLISHED}), "mooncake"]
