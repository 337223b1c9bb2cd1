"""Step times of a continuous-batching engine from the model's shape and the hardware (roofline)."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from kvprefetch.sim.catalog import Accelerator, Model


@dataclass(frozen=True)
class Deployment:
    """One engine instance: a model on `tp` devices, with the vLLM knobs that shape its batches.

    `efficiency` scales peak FLOP/s (MFU) and `mem_efficiency` scales HBM bandwidth; both are what the
    roofline cannot know about kernels. `attention_efficiency` scales the attention against cached KV apart
    (decode, and prefill over a prefix or earlier chunks: paged-KV kernels, slower than the dense ones that
    attend among a step's new tokens, on CPUs especially). `token_budget` is vLLM's
    max_num_batched_tokens (8192 is its default for online serving), `kv_memory_fraction` its
    gpu_memory_utilization (default 0.9), `kv_capacity_tokens_override` the engine's KV size where it was
    measured rather than derived (the bench's engine reports it).
    """

    model: Model
    accelerator: Accelerator
    tp: int = 1
    efficiency: float = 0.4
    mem_efficiency: float = 0.7
    token_budget: int = 8192
    max_seqs: int = 256
    kv_memory_fraction: float = 0.9
    attention_efficiency: float = 1.0
    kv_capacity_tokens_override: int | None = None

    @property
    def kv_capacity_tokens(self) -> int:
        if self.kv_capacity_tokens_override is not None:
            return self.kv_capacity_tokens_override
        usable = self.accelerator.hbm_bytes * self.tp * self.kv_memory_fraction
        weights = self.model.total_params * self.model.weight_bytes
        if usable - weights <= 0:
            raise ValueError(
                f"{self.model.name} does not fit on {self.tp}x {self.accelerator.name}: {weights / 1e9:.0f} GB of "
                f"weights, {usable / 1e9:.0f} GB of usable HBM (more devices: tp)"
            )
        return int((usable - weights) / self.model.kv_bytes_per_token)

    def _attn_flops_per_pair(self) -> float:
        m = self.model
        return 4.0 * m.layers * m.heads * m.head_dim

    def _weight_bytes(self, tokens: np.ndarray | float) -> np.ndarray | float:
        """Dense weights are read once per step; each expert only if some token in the step routes to it."""
        m = self.model
        dense = m.dense_params * m.weight_bytes
        if m.experts == 0:
            return dense + 0.0 * np.asarray(tokens)
        touched = 1.0 - (1.0 - m.experts_active / m.experts) ** np.asarray(tokens, dtype=float)
        return dense + m.expert_params * m.weight_bytes * touched

    def step_time(self, prefill: list[tuple[int, int]], n_decode: int, decode_ctx: float) -> float:
        """Seconds for one step running prefill chunks `(offset, length)` and `n_decode` decode tokens."""
        m = self.model
        tokens = n_decode + sum(n for _, n in prefill)
        fresh = sum(n * n / 2.0 for _, n in prefill)  # among the step's own new tokens
        cached = decode_ctx + sum(n * o for o, n in prefill)  # against KV already in the cache
        kv_read = decode_ctx + sum(o for o, _ in prefill)
        pairs = fresh + cached / self.attention_efficiency
        flops = 2.0 * m.active_params * tokens + self._attn_flops_per_pair() * pairs
        mem = float(self._weight_bytes(tokens)) + kv_read * m.kv_bytes_per_token
        return self._roofline(flops, mem, n_decode + len(prefill))

    def decode_steps(self, n_decode: int, ctx_start: float, steps: int) -> np.ndarray:
        """Times of `steps` decode-only steps in a row, each adding one token to every sequence."""
        ctx = ctx_start + n_decode * np.arange(steps, dtype=float)
        m = self.model
        flops = 2.0 * m.active_params * n_decode + self._attn_flops_per_pair() * ctx / self.attention_efficiency
        mem = self._weight_bytes(n_decode) + ctx * m.kv_bytes_per_token
        return self._roofline(flops, mem, n_decode)

    def _roofline(self, flops, mem, seqs: int):
        """The step's time: the slower of compute and memory, plus its fixed and per-sequence overheads."""
        a = self.accelerator
        compute = flops / (a.flops * self.tp * self.efficiency)
        memory = mem / (a.hbm_bw * self.tp * self.mem_efficiency)
        return np.maximum(compute, memory) + a.step_overhead_s + a.seq_overhead_s * seqs

    def prefill_time(self, tokens: int, offset: int = 0) -> float:
        """Seconds to prefill `tokens` after `offset` cached ones, alone, in budget-sized chunks."""
        total, done = 0.0, 0
        while done < tokens:
            n = min(self.token_budget, tokens - done)
            total += self.step_time([(offset + done, n)], 0, 0.0)
            done += n
        return total
