"""Counter snapshots of several engines (or several processes of one), summed."""

from __future__ import annotations


def merge_snapshots(snaps: list[dict]) -> dict:
    """Counter snapshots of several engines summed key by key (nested dicts recursively)."""
    out: dict = {}
    for snap in snaps:
        for k, v in snap.items():
            if isinstance(v, dict):
                out[k] = merge_snapshots([out.get(k, {}), v])
            elif isinstance(v, int | float) and not isinstance(v, bool):
                out[k] = out.get(k, 0) + v
    return out
