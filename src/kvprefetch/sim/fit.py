"""Fit the whitepaper's free parameters, each on the one published row it governs (`scenarios.FITTED_BY`).

Every parameter moves its row monotonically, so each is solved by bisection with the others held, and the
sweep repeats until nothing moves (Gauss-Seidel). Run `python -m kvprefetch.sim.fit` to reproduce the
values frozen in `scenarios.FIT`; every row not named in `FITTED_BY` is a prediction.
"""

from __future__ import annotations

import math
from dataclasses import replace

from kvprefetch.sim.scenarios import FIT, FITTED_BY, PUBLISHED, Published, WhitepaperFit, simulate_metric
from kvprefetch.workload.request import BLOCK_TOKENS

# name -> (lower bound, upper bound, step the value is rounded to; 0 = continuous)
BOUNDS: dict[str, tuple[float, float, float]] = {
    "context_tokens": (2048, 131072, BLOCK_TOKENS),
    "new_tokens": (1, 4096, 1),
    "output_tokens": (8, 2048, 1),
    "efficiency": (0.002, 0.6, 0),
    "token_budget": (512, 16384, 16),
    "r1_context_tokens": (1024, 262144, BLOCK_TOKENS),
}


def _row(name: str) -> Published:
    scenario, metric = FITTED_BY[name]
    return next(p for p in PUBLISHED if p.scenario == scenario and p.metric == metric)


def _snap(value: float, step: float) -> float:
    return value if step == 0 else max(step, round(value / step) * step)


def solve_one(fit: WhitepaperFit, name: str, iters: int = 18) -> WhitepaperFit:
    """Bisect `name` (in log space) until its row matches, the other parameters held."""
    row = _row(name)
    lo, hi, step = BOUNDS[name]

    def err(v: float) -> float:
        return math.log(simulate_metric(row, replace(fit, **{name: _cast(name, v)})) / row.value)

    e_lo, e_hi = err(lo), err(hi)
    if e_lo * e_hi > 0:  # no root in range: take the closer end
        return replace(fit, **{name: _cast(name, lo if abs(e_lo) < abs(e_hi) else hi)})
    for _ in range(iters):
        mid = _snap(math.sqrt(lo * hi), step)
        if mid in (lo, hi):
            break
        e_mid = err(mid)
        if (e_mid < 0) == (e_lo < 0):
            lo, e_lo = mid, e_mid
        else:
            hi, e_hi = mid, e_mid
    best = lo if abs(e_lo) < abs(e_hi) else hi
    return replace(fit, **{name: _cast(name, best)})


def _cast(name: str, value: float) -> float | int:
    return value if BOUNDS[name][2] == 0 else int(_snap(value, BOUNDS[name][2]))


def fit_all(start: WhitepaperFit = FIT, rounds: int = 6) -> WhitepaperFit:
    fit = start
    for _ in range(rounds):
        before = fit
        for name in FITTED_BY:
            fit = solve_one(fit, name)
        if fit == before:
            break
    return fit


if __name__ == "__main__":
    result = fit_all()
    print(result)
    for name in FITTED_BY:
        row = _row(name)
        print(f"{name:18s} {row.scenario} {row.metric}: {row.value} -> {simulate_metric(row, result):.3g}")
