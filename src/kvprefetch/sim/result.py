"""What one simulation run measured, and the statistics derived from it."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np


@dataclass
class SimResult:
    """Per-request timings plus totals. Times are seconds from the start of the run.

    `tokens_from`: prompt tokens by where they were when their request was admitted ("computed", "hbm", or a
    tier: a prefetched block counts for DRAM); `bytes_read`: bytes each storage tier (and the host link) moved,
    re-reads of evicted blocks included; `recomputed_slower_tokens`: of the computed ones, those a tier held but
    the load-or-recompute rule recomputed because loading them would have been slower."""

    submit: np.ndarray
    first_token: np.ndarray
    done: np.ndarray
    input_len: np.ndarray
    output_len: np.ndarray
    tokens_from: dict[str, int] = field(default_factory=dict)
    bytes_read: dict[str, float] = field(default_factory=dict)
    stall_s: float = 0.0
    steps: int = 0
    recomputed_slower_tokens: int = 0

    @property
    def requests(self) -> int:
        return len(self.submit)

    @property
    def ttft(self) -> np.ndarray:
        return self.first_token - self.submit

    def ttft_p(self, q: float) -> float:
        return float(np.percentile(self.ttft, q)) if self.requests else float("nan")

    @property
    def makespan(self) -> float:
        return float(self.done.max() - self.submit.min()) if self.requests else 0.0

    @property
    def output_tok_s(self) -> float:
        span = self.makespan
        return float(self.output_len.sum() / span) if span > 0 else 0.0

    @property
    def prompt_tokens(self) -> int:
        """Prompt tokens of the requests admitted, wherever they came from."""
        return sum(self.tokens_from.values())

    @property
    def hit_ratio(self) -> float:
        """Share of prompt tokens not computed (served by HBM's prefix cache or any tier)."""
        total = self.prompt_tokens
        return 1.0 - self.tokens_from.get("computed", 0) / total if total else 0.0

    def served_from(self) -> dict[str, float]:
        """Share of prompt tokens by where they came from ("computed", "hbm", a tier), the empty sources left out:
        a run whose hits all come from HBM's prefix cache is one the tiers below it cannot change."""
        total = self.prompt_tokens
        return {k: v / total for k, v in self.tokens_from.items() if v} if total else {}
