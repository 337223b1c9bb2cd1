"""PNG plots (matplotlib, Agg backend: no display needed)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt


def ttft_vs_concurrency(
    series: Mapping[str, Mapping[float, float]], path: str | Path, title: str = "", xlabel: str = "concurrency"
) -> Path:
    """One line per policy: TTFT p50 against concurrency (or, for open loops, the arrival rate)."""
    fig, ax = plt.subplots(figsize=(6, 4))
    for policy, points in series.items():
        xs = sorted(points)
        ax.plot(xs, [points[x] for x in xs], marker="o", label=policy)
    values = [v for points in series.values() for v in points.values() if v > 0]
    if values and max(values) > 20 * min(values):  # recompute beside loads from DRAM: keep both readable
        ax.set_yscale("log")
    ax.set_xlabel(xlabel)
    ax.set_ylabel("TTFT p50 (s)")
    ax.set_title(title or f"TTFT p50 vs {xlabel}")
    ax.legend()
    ax.grid(alpha=0.3)
    return _save(fig, path)


def hit_ratio_vs_capacity(
    simulated: Mapping[int | None, float], published: Mapping[int | None, float], path: str | Path, title: str = ""
) -> Path:
    """Hit ratio against pool capacity in blocks; the unbounded point is drawn at the right edge."""
    bounded = sorted(c for c in simulated if c is not None)
    edge = (max(bounded) * 2) if bounded else 1

    def x(c):
        return edge if c is None else c

    fig, ax = plt.subplots(figsize=(6, 4))
    ax.plot(
        [x(c) for c in [*bounded, None] if c in simulated],
        [simulated[c] for c in [*bounded, None] if c in simulated],
        marker="o",
        label="simulated (LRU)",
    )
    if published:
        pts = sorted(published, key=x)
        ax.plot([x(c) for c in pts], [published[c] for c in pts], "s", label="published")
    ax.set_xscale("log")
    ax.set_xlabel("cache capacity (blocks; rightmost = unbounded)")
    ax.set_ylabel("hit ratio")
    ax.set_title(title or "prefix hit ratio vs capacity")
    ax.legend()
    ax.grid(alpha=0.3)
    return _save(fig, path)


def ttft_vs_bandwidth(sweeps: Sequence[Mapping], path: str | Path, title: str = "") -> Path:
    """One line per load: prefetch's TTFT p50 against storage bandwidth, between its all-in-DRAM bound (dashed)
    and recomputing everything (dotted), both in the line's colour."""
    fig, ax = plt.subplots(figsize=(6, 4))
    for sweep in sweeps:
        points = sweep["points"]
        (line,) = ax.plot([p["read_gbps"] for p in points], [p["prefetch_ttft_p50_s"] for p in points], marker="o",
                          label=f"prefetch {sweep['load']}")  # fmt: skip
        ax.axhline(points[0]["dram_ttft_p50_s"], color=line.get_color(), linestyle="--", linewidth=1)
        ax.axhline(sweep["recompute_ttft_p50_s"], color=line.get_color(), linestyle=":", linewidth=1)
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("farthest tier's full read bandwidth (GB/s)")
    ax.set_ylabel("TTFT p50 (s)")
    ax.set_title(title or "prefetch vs storage bandwidth (dashed: all in DRAM; dotted: recompute)", fontsize=9)
    ax.legend()
    ax.grid(alpha=0.3, which="both")
    return _save(fig, path)


def _save(fig, path: str | Path) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path
