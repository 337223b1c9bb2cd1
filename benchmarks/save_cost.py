"""The CPU cost of each step of the connector's save path per chunk, on this machine (issue 64).

CPU seconds of every thread of this process (user + system: the kernel's share of a write-back included), for
the steps one save takes: copy-out of the engine's paged KV (`PagedKV.gather_into`), keying, the put into a DRAM
pool (copy + header checksum), the write-back to a disk tier (fsync), lookups. CPU time, not wall time: it stays
meaningful on a shared machine. The geometry is the bench's tiny model: 1 MiB chunks of 256 tokens.

    PYTHONPATH=src .venv/bin/python benchmarks/save_cost.py [--chunks 88] [--dir /tmp]
"""

from __future__ import annotations

import argparse
import resource
import tempfile
import time
import uuid
from pathlib import Path

import numpy as np
import torch

from kvprefetch.keys import ChunkKeyer, KVNamespace
from kvprefetch.store import TieredStore
from kvprefetch.vllm.layout import PagedKV
from kvprefetch.vllm.settings import parse_extra_config

LAYERS, BLOCKS, HEADS, BLOCK, DIM = 8, 256, 2, 128, 64  # K and V of 4 layers, float32: 4 KiB of KV per token


def cpu_s() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def measure(chunks: int, directory: str) -> dict[str, float]:
    kv = PagedKV([torch.randn(BLOCKS, HEADS, BLOCK, DIM) for _ in range(LAYERS)], BLOCKS, BLOCK)
    geo = kv.geometry(256)
    stage = torch.empty((chunks, geo.chunk_bytes), dtype=torch.uint8)
    ids = [[2 * i % BLOCKS, (2 * i + 1) % BLOCKS] for i in range(chunks)]
    out: dict[str, float] = {}
    t = cpu_s()
    kv.gather_into(ids, stage, geo)
    out["copy-out"] = cpu_s() - t
    keyer = ChunkKeyer(KVNamespace(model="m", num_layers=4, num_kv_heads=2, head_dim=64, dtype="float32"), 256)
    t = cpu_s()
    keys = keyer.keys([int(x) for x in np.random.default_rng(0).integers(0, 32000, chunks * 256)])
    out["keying"] = cpu_s() - t
    for tiers in (["dram"], ["dram", "disk"]):
        cfg = {"tiers": tiers, "dram": {"capacity_bytes": (chunks + 8) * (geo.chunk_bytes + 8192),
                                        "pool_name": "kvpt-cost-" + uuid.uuid4().hex[:8]},
               "disk": {"path": tempfile.mkdtemp(dir=directory), "fsync": True}}  # fmt: skip
        store = TieredStore(parse_extra_config(cfg).store, geo.chunk_bytes)
        try:
            t, wall = cpu_s(), time.perf_counter()
            for i, k in enumerate(keys):
                store.put([k], [stage[i].numpy()])
            store.flush(60)
            out["put into DRAM" if len(tiers) == 1 else "put + write-back"] = cpu_s() - t
            out["write-back wall s"] = time.perf_counter() - wall
            t = cpu_s()
            for k in keys:
                store.lookup([k])
            out["lookups"] = cpu_s() - t
        finally:
            store.close()
            store.dram.path.unlink(missing_ok=True)
    out["write-back"] = out.pop("put + write-back") - out["put into DRAM"]
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--chunks", type=int, default=88, help="chunks saved (88: the no-reuse bench's c=8 cell)")
    ap.add_argument("--dir", default=tempfile.gettempdir(), help="where the disk tier goes")
    a = ap.parse_args()
    res = measure(a.chunks, str(Path(a.dir)))
    print(f"{a.chunks} chunks of 1 MiB: CPU seconds (every thread, user + system), ms per chunk")
    for step in ("copy-out", "keying", "put into DRAM", "write-back", "lookups"):
        print(f"  {step:<16} {res[step]:7.3f} s  {1e3 * res[step] / a.chunks:6.2f} ms")


if __name__ == "__main__":
    main()
