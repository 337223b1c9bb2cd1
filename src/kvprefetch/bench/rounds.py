"""Repeats: one row per (mode, concurrency) from the rounds that measured it, and paired comparisons.

This machine is shared and a single cell moves by ±25% from run to run, so the bench measures every cell in
``repeats`` rounds, the modes interleaved within each round (round 1 of every mode before round 2 of any),
and reports:

* per cell the **median** of the rounds, with the **min-max** of TTFT p50 and throughput beside it;
* per comparison the **paired ratio**: prefetch / baseline in each round (both measured minutes apart, under
  the same load on the machine), then the median and range of those ratios. A range that contains 1 is a
  **tie**, whatever the median says: a difference inside the spread is not a gain.
"""

from __future__ import annotations

import statistics
from typing import Any

SPREAD_KEYS = ("ttft_p50_s", "ttft_p90_s", "itl_p50_s", "output_tok_s")
"""The figures a row reports with their min-max over the rounds, and per round (``by_round``)."""
ROUND_KEYS = (*SPREAD_KEYS, "hit_ratio", "foreign_cpu_cores")  # per round too: what a flagged cell's rounds say
UNSTEADY_KEYS = ("ttft_p50_s", "output_tok_s")
UNSTEADY_RATIO = 2.0
"""A cell whose rounds are further apart than this in one of `UNSTEADY_KEYS` is flagged (`unsteady`): noise here
moves a cell by about 25%, so a round 2x its sibling is something that happened in that round (issue 48: an
8x round hid behind a median and a min-max range)."""
SAMPLE_KEYS = ("ttft_samples_s",)  # per-request samples: every round's, pooled
IDENTITY_KEYS = ("mode", "concurrency", "regime", "workload", "status", "engine_kv_bytes", "engine_kv_share")
"""What a cell is, not what it measured."""


def aggregate(runs: list[dict]) -> list[dict]:
    """One row per (regime, mode, concurrency, engine KV size) in first-run order: medians of the ok rounds'
    numbers, their samples pooled, the rest (lists such as requests per engine, text) from the first round. A
    cell no round measured keeps its first failure."""
    groups: dict[tuple[Any, str, int, Any], list[dict]] = {}
    for r in runs:
        groups.setdefault((r.get("regime"), r["mode"], r["concurrency"], r.get("engine_kv_bytes")), []).append(r)
    return [_merge(rs) for rs in groups.values()]


def _merge(rounds: list[dict]) -> dict:
    ok = [r for r in rounds if r.get("status") == "ok"]
    if not ok:
        return dict(rounds[0]) | {"repeats": 0}
    row: dict[str, Any] = {}
    for key in dict.fromkeys(k for r in ok for k in r):
        if key == "round":
            continue
        vals = [r[key] for r in ok if key in r and r[key] is not None]
        if key in IDENTITY_KEYS:
            row[key] = ok[0].get(key)
        elif vals and all(isinstance(v, int) and not isinstance(v, bool) for v in vals):
            row[key] = statistics.median_low(vals)  # a count stays a count
        elif vals and all(isinstance(v, int | float) and not isinstance(v, bool) for v in vals):
            row[key] = statistics.median(vals)
        elif key in SAMPLE_KEYS:
            row[key] = sorted(x for v in vals for x in v)
        else:
            row[key] = ok[0].get(key)
    for key in SPREAD_KEYS:
        vals = [r[key] for r in ok if r.get(key) is not None]
        if vals:
            row[f"{key}_min"], row[f"{key}_max"] = min(vals), max(vals)
    row["by_round"] = {key: {r.get("round", 0): r.get(key) for r in ok} for key in ROUND_KEYS}
    row["repeats"] = len(ok)
    if len(ok) < len(rounds):
        row["failed_rounds"] = len(rounds) - len(ok)
    return row


def unsteady(row: dict) -> list[str]:
    """The `UNSTEADY_KEYS` whose rounds are more than `UNSTEADY_RATIO` apart in this cell (max / min)."""
    out = []
    for key in UNSTEADY_KEYS:
        vals = [v for v in row.get("by_round", {}).get(key, {}).values() if isinstance(v, int | float)]
        if len(vals) > 1 and min(vals) > 0 and max(vals) / min(vals) > UNSTEADY_RATIO:
            out.append(key)
    return out


def find_row(rows: list[dict], mode: str, c: int, regime: Any = None, kv_bytes: int | None = None) -> dict | None:
    """The ok row of `mode` at concurrency `c` (in `regime`, at engine KV size `kv_bytes`, when given)."""
    for r in rows:
        if (r.get("mode") == mode and r.get("concurrency") == c and r.get("status") == "ok"
                and (regime is None or r.get("regime") == regime)
                and (kv_bytes is None or r.get("engine_kv_bytes") == kv_bytes)):  # fmt: skip
            return r
    return None


def paired(a: dict, b: dict, key: str) -> dict | None:
    """``a[key] / b[key]`` round by round (rounds both measured): median, min, max and the verdict."""
    ra, rb = a.get("by_round", {}).get(key, {}), b.get("by_round", {}).get(key, {})
    ratios = [ra[k] / rb[k] for k in ra if k in rb and ra[k] is not None and rb[k]]
    if not ratios and a.get(key) is not None and b.get(key):  # a row without rounds: one ratio
        ratios = [a[key] / b[key]]
    if not ratios:
        return None
    lo, hi, mid = min(ratios), max(ratios), statistics.median(ratios)
    return {"ratio": mid, "min": lo, "max": hi, "n": len(ratios), "verdict": verdict(lo, hi, len(ratios))}


def verdict(lo: float, hi: float, rounds: int = 2) -> str:
    """'lower' / 'higher' when every round agrees; 'tie' when the rounds' ratios straddle 1; 'one round' when
    there is no spread to judge by (`--repeats 1`, e.g. `--quick`): never a gain."""
    if rounds < 2:
        return "one round"
    if hi < 1.0:
        return "lower"
    if lo > 1.0:
        return "higher"
    return "tie"
