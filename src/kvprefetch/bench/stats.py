"""Per mode x concurrency metrics from the engine process's request records and counter snapshots."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any


def percentile(values: Sequence[float], q: float) -> float | None:
    """Linear-interpolated percentile (numpy's default method); None for no values."""
    xs = sorted(float(v) for v in values)
    if not xs:
        return None
    if not 0 <= q <= 100:
        raise ValueError(f"percentile must be in [0, 100], got {q}")
    pos = (len(xs) - 1) * q / 100.0
    lo = math.floor(pos)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def _delta(after: dict, before: dict) -> dict:
    out = {}
    for k, v in after.items():
        b = before.get(k, 0)
        if isinstance(v, dict):
            out[k] = _delta(v, b if isinstance(b, dict) else {})
        elif isinstance(v, int | float):
            out[k] = v - (b if isinstance(b, int | float) else 0)
    return out


def _io_sum(io: dict, tier: str, reads: bool) -> tuple[int, int]:
    """(bytes, ops) moved on a tier by reads (demand + prefetch) or by write-back."""
    nbytes = ops = 0
    for key, st in io.items():
        t, _, cls = key.partition("/")
        if t == tier and (cls != "writeback") == reads:
            nbytes += int(st.get("bytes", 0))
            ops += int(st.get("ops", 0))
    return nbytes, ops


def cell_metrics(result: dict[str, Any], chunk_tokens: int | None = None) -> dict[str, Any]:
    """Everything one results row reports, from one `run` reply of the engine process.

    Tier shares of the prompt tokens: ``engine`` (vLLM's own prefix cache), ``dram`` and ``disk`` (loaded by
    the connector; a loaded chunk counts as disk when the store read it from disk during this cell, so the
    split is by chunk counts), ``computed`` (the rest).
    """
    recs = result.get("records", [])
    ok = [r for r in recs if r.get("error") is None and r.get("first_token") is not None]
    ttft = [r["first_token"] - r["arrival"] for r in ok]
    itl = [g for r in ok for g in r.get("itl", [])]
    wall = float(result.get("wall_s") or 0.0)
    out_tokens = sum(int(r.get("output_tokens", 0)) for r in ok)
    prompt = sum(int(r.get("prompt_tokens", 0)) for r in recs)
    cached = sum(int(r.get("cached_tokens") or 0) for r in ok)
    ext_known = [r for r in ok if r.get("cached_external") is not None]
    external = sum(int(r["cached_external"]) for r in ext_known)
    local = sum(int(r["cached_local"]) for r in ext_known) + sum(
        int(r.get("cached_tokens") or 0) for r in ok if r.get("cached_external") is None
    )

    d = _delta(result.get("after", {}), result.get("before", {}))
    counters = d.get("counters", {})
    io = d.get("io", {})
    disk_read_bytes, disk_read_ops = _io_sum(io, "disk", reads=True)
    disk_write_bytes, _ = _io_sum(io, "disk", reads=False)
    remote_read_bytes, remote_read_ops = _io_sum(io, "remote", reads=True)
    loaded_chunks = int(counters.get("loaded_chunks", 0))
    from_disk_share = min(1.0, (disk_read_ops + remote_read_ops) / loaded_chunks) if loaded_chunks else 0.0
    disk_tokens = external * from_disk_share
    dram_tokens = external - disk_tokens
    computed = max(prompt - cached, 0)

    def share(x: float) -> float:
        return x / prompt if prompt else 0.0

    errors = len(recs) - len(ok) + len(result.get("errors", []))
    return {
        "requests": len(recs),
        "completed": len(ok),
        "errors": errors,
        "error_samples": sorted({str(r.get("error")) for r in recs if r.get("error")})[:5] + result.get("errors", []),
        "ttft_p50_s": percentile(ttft, 50),
        "ttft_p90_s": percentile(ttft, 90),
        "ttft_p99_s": percentile(ttft, 99),
        "ttft_mean_s": sum(ttft) / len(ttft) if ttft else None,
        "itl_p50_s": percentile(itl, 50),
        "output_tok_s": out_tokens / wall if wall > 0 else None,
        "requests_per_s": len(ok) / wall if wall > 0 else None,
        "wall_s": wall,
        "prompt_tokens": prompt,
        "output_tokens": out_tokens,
        "hit_ratio": share(cached),
        "share_engine": share(local),
        "share_dram": share(dram_tokens),
        "share_disk": share(disk_tokens),
        "share_computed": share(computed),
        "bytes_disk_read": disk_read_bytes,
        "bytes_disk_written": disk_write_bytes,
        # the most disk reads the engine's store ever had in flight at once (a peak over its life, not this
        # cell's delta): 1 in ondemand-serial, up to io.threads elsewhere
        "peak_disk_reads_in_flight": result.get("after", {}).get("peak_disk_reads_in_flight"),
        "bytes_remote_read": remote_read_bytes,
        "bytes_storage_read_proc": int(d.get("proc", {}).get("read_bytes", 0)),
        "bytes_storage_written_proc": int(d.get("proc", {}).get("write_bytes", 0)),
        "prefetched_chunks": int(counters.get("prefetched_chunks", 0)),
        "prefetch_in_time": int(counters.get("prefetch_in_time", 0)),
        "prefetch_late": int(counters.get("prefetch_late", 0)),
        "prefetch_wasted_chunks": int(counters.get("prefetch_cancelled_chunks", 0)),
        "demand_reads": int(counters.get("demand_reads", 0)),
        "loaded_chunks": loaded_chunks,
        "recomputed_slower_chunks": int(counters.get("recomputed_slower_chunks", 0)),
        "load_error_chunks": int(counters.get("load_error_chunks", 0)),
        "saved_chunks": int(counters.get("saved_chunks", 0)),
        "ranks": _rank_metrics(d.get("ranks") or {}),
        "foreign_cpu_cores": result.get("foreign_cpu_cores"),
        "helper_cpu_s": result.get("helper_cpu_s"),
        "ttft_samples_s": sorted(round(x, 6) for x in ttft),
    }


def _rank_metrics(ranks: dict) -> dict[str, dict[str, int]]:
    """Per tensor-parallel rank: bytes loaded into and saved from the engine (the workers'), chunk reads
    started into DRAM, and how many of its hit chunks were already in DRAM when the scheduler got there."""
    names = ("loaded_bytes", "saved_bytes", "prefetched_chunks", "reached_hit_chunks", "reached_in_dram_chunks")
    return {str(r): {n: int(v.get(n, 0)) for n in names} for r, v in sorted(ranks.items(), key=lambda x: int(x[0]))}


def ratio(a: float | None, b: float | None) -> float | None:
    if a is None or b is None or b == 0:
        return None
    return a / b
