"""How every plot of the bench's report starts and ends: a 7 x 4.5 in figure drawn without a display (Agg), then
its grid, legend, layout, a 120 dpi PNG and the figure closed. matplotlib is imported only when a plot is drawn."""

from __future__ import annotations

from pathlib import Path
from typing import Any


def figure() -> tuple[Any, Any]:
    """A new figure and its axes."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt.subplots(figsize=(7, 4.5))


def save(fig: Any, ax: Any, path: Path, legend: bool = True, **legend_kw: Any) -> str:
    """Finish the plot (grid, a legend unless `legend` is false, layout), write it to `path` and close it; the
    file's name."""
    import matplotlib.pyplot as plt

    ax.grid(True, alpha=0.3)
    if legend:
        ax.legend(**legend_kw)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path.name
