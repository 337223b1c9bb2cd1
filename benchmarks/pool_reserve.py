"""How a new DRAM pool should get its memory: start-up time against the first request's load time.

    python benchmarks/pool_reserve.py                      # 2 GiB pool, 3 interleaved rounds
    python benchmarks/pool_reserve.py --pool 2GiB --chunk 16MiB --chunks 8 --repeats 5 --json out.json

Three ways, each round in turn on a fresh pool of the same size (interleaved, so a busy machine moves them alike):

* ``touch``: fault every page in at creation (what kvprefetch did before issue 28);
* ``fallocate``: posix_fallocate the file at creation (the pages exist, not yet mapped; ENOSPC is a clean error);
* ``first_write``: posix_fallocate at the first slot handed out (the weight loader's default: a load served by
  the disk cache never pays for a pool it writes nothing into). Nothing at all (pages appearing as slots are
  first written) was measured here before issue 28 too; it is not offered: a full /dev/shm then means SIGBUS
  mid-write.

Per way: the pool's creation time (what an engine's start-up pays once), the first request's load (``--chunks``
chunks read from a disk tier whose files are in the page cache into DRAM slots and copied out, as the store
promotes them, so the slots' first writes are what differs), the same load once more into the now-touched slots,
and the RAM the pool's file holds afterwards.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
import uuid
from pathlib import Path

import numpy as np
from pydantic import ByteSize, TypeAdapter

from kvprefetch.config import StoreConfig
from kvprefetch.keys import ChunkKeyer, KVNamespace
from kvprefetch.store import TieredStore
from kvprefetch.tiers.chunk_format import image_bytes
from kvprefetch.tiers.disk import DiskTier
from kvprefetch.tiers.dram import SHM_DIR, SharedChunkPool

WAYS = ("touch", "fallocate", "first_write")


def size(text: str) -> int:
    return int(TypeAdapter(ByteSize).validate_python(text))


def load(pool: SharedChunkPool, disk: DiskTier, keys: list[bytes], out: list[np.ndarray]) -> float:
    """A request's load as the store does it: each chunk read from disk into a DRAM slot, then copied out."""
    t0 = time.perf_counter()
    for key, dst in zip(keys, out, strict=True):
        slot = pool.allocate(key, len(dst))
        assert slot is not None
        disk.read_into(key, pool.image(slot))
        pool.commit(slot)
        slot = pool.acquire(key)
        dst[:] = pool.payload(slot, key)
        pool.release(slot)
    return time.perf_counter() - t0


def one_round(way: str, pool_bytes: int, chunk_bytes: int, disk: DiskTier, keys: list[bytes]) -> dict:
    name = f"reserve-{way}-{uuid.uuid4().hex[:6]}"
    out = [np.empty(chunk_bytes, np.uint8) for _ in keys]
    t0 = time.perf_counter()
    pool = SharedChunkPool(name, image_bytes(chunk_bytes), pool_bytes, reserve=way, keep_idle_s=None)
    create_s = time.perf_counter() - t0
    try:
        first_s = load(pool, disk, keys, out)
        for k in keys:
            pool.discard(k)
        again_s = load(pool, disk, keys, out)
        held = pool.stats()["held_bytes"]
    finally:
        pool.destroy()
    return {"create_s": create_s, "first_load_s": first_s, "touched_load_s": again_s, "held_bytes": held}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--pool", default="2GiB")
    ap.add_argument("--chunk", default="16MiB")
    ap.add_argument("--chunks", type=int, default=8, help="chunks the first request loads")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--json", type=Path)
    a = ap.parse_args()
    pool_bytes, chunk_bytes = size(a.pool), size(a.chunk)
    with tempfile.TemporaryDirectory() as tmp:
        disk = Path(tmp) / "disk"
        ns = KVNamespace(model="reserve-bench", num_layers=1, num_kv_heads=1, head_dim=1, dtype="float16")
        keys = ChunkKeyer(ns, 16).keys(range(16 * a.chunks))
        seed_cfg = StoreConfig.load(
            dram={"capacity_bytes": (a.chunks + 2) * image_bytes(chunk_bytes), "pool_name": f"seed-{uuid.uuid4().hex}"},
            disk={"path": str(disk), "capacity_bytes": 1 << 40, "direct_io": False},
        )
        with TieredStore(seed_cfg, chunk_bytes=chunk_bytes) as seed:
            payload = np.random.default_rng(0).integers(0, 256, chunk_bytes, dtype=np.uint8)
            seed.put(keys, [payload] * len(keys)).result()
            seed.dram.destroy()
        tier = DiskTier(disk, 1 << 40, direct_io=False)  # files in the page cache: the slots' writes differ
        runs: dict[str, list[dict]] = {w: [] for w in WAYS}
        for r in range(a.repeats):
            for way in WAYS:
                runs[way].append(one_round(way, pool_bytes, chunk_bytes, tier, keys))
                print(f"round {r + 1} {way:<11} " + " ".join(f"{k}={v:.3f}" for k, v in runs[way][-1].items()
                                                           if k.endswith("_s")), flush=True)  # fmt: skip
    print(f"\n{a.pool} pool in {SHM_DIR}, first request loads {a.chunks} x {a.chunk}; medians of {a.repeats} "
          f"(min-max)")  # fmt: skip
    print(f"{'way':<12} {'create s':>20} {'first load s':>20} {'touched load s':>20} {'RAM held GiB':>13}")
    summary = {}
    for way, rs in runs.items():
        cols = {}
        for k in ("create_s", "first_load_s", "touched_load_s"):
            xs = [x[k] for x in rs]
            cols[k] = {"median": statistics.median(xs), "min": min(xs), "max": max(xs)}
        cols["held_gib"] = statistics.median(x["held_bytes"] for x in rs) / 2**30
        summary[way] = cols
        cell = [f"{c['median']:.3f} ({c['min']:.2f}-{c['max']:.2f})" for c in list(cols.values())[:3]]
        print(f"{way:<12} {cell[0]:>20} {cell[1]:>20} {cell[2]:>20} {cols['held_gib']:>13.2f}")
    if a.json:
        a.json.write_text(json.dumps({"args": vars(a) | {"json": str(a.json)}, "runs": runs, "summary": summary}))


if __name__ == "__main__":
    main()
