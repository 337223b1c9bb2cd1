"""`kvprefetch poolbench`: how a new DRAM pool should get its memory, start-up time against the first request's load.

    kvprefetch poolbench                      # 2 GiB pool, 3 interleaved rounds
    kvprefetch poolbench --pool 2GiB --chunk 16MiB --chunks 8 --repeats 5 --json out.json

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

import statistics
import tempfile
import time
import uuid
from collections.abc import Callable
from pathlib import Path

import numpy as np

from kvprefetch.config import StoreConfig
from kvprefetch.keys import ChunkKeyer, KVNamespace
from kvprefetch.store import TieredStore
from kvprefetch.tiers.chunk_format import image_bytes
from kvprefetch.tiers.disk import DiskTier
from kvprefetch.tiers.dram import SharedChunkPool

WAYS = ("touch", "fallocate", "first_write")

Progress = Callable[[int, str, dict], None]  # (round, way, that round's figures) as each round ends


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


def run_poolbench(
    pool_bytes: int, chunk_bytes: int, chunks: int, repeats: int, progress: Progress = lambda r, way, fig: None
) -> dict[str, list[dict]]:
    """Every way once per round, `repeats` rounds, on one disk tier seeded with the chunks: each way's rounds."""
    with tempfile.TemporaryDirectory() as tmp:
        tier, keys = seeded_disk(Path(tmp) / "disk", chunk_bytes, chunks)
        runs: dict[str, list[dict]] = {w: [] for w in WAYS}
        for r in range(repeats):
            for way in WAYS:
                runs[way].append(one_round(way, pool_bytes, chunk_bytes, tier, keys))
                progress(r, way, runs[way][-1])
    return runs


def seeded_disk(disk: Path, chunk_bytes: int, chunks: int) -> tuple[DiskTier, list[bytes]]:
    """`chunks` chunks written to a disk tier by a store (then its pool removed), and the tier opened to read them
    through the page cache: the files cost the same for every way, so the slots' first writes are what differs."""
    ns = KVNamespace(model="reserve-bench", num_layers=1, num_kv_heads=1, head_dim=1, dtype="float16")
    keys = ChunkKeyer(ns, 16).keys(range(16 * chunks))
    seed_cfg = StoreConfig.load(
        dram={"capacity_bytes": (chunks + 2) * image_bytes(chunk_bytes), "pool_name": f"seed-{uuid.uuid4().hex}"},
        disk={"path": str(disk), "capacity_bytes": 1 << 40, "direct_io": False},
    )
    with TieredStore(seed_cfg, chunk_bytes=chunk_bytes) as seed:
        payload = np.random.default_rng(0).integers(0, 256, chunk_bytes, dtype=np.uint8)
        seed.put(keys, [payload] * len(keys)).result()
        seed.dram.destroy()
    return DiskTier(disk, 1 << 40, direct_io=False), keys


def summarize(runs: dict[str, list[dict]]) -> dict[str, dict]:
    """Per way: each time's median, min and max over the rounds, and the median RAM the pool held (GiB)."""
    summary = {}
    for way, rs in runs.items():
        cols = {}
        for k in ("create_s", "first_load_s", "touched_load_s"):
            xs = [x[k] for x in rs]
            cols[k] = {"median": statistics.median(xs), "min": min(xs), "max": max(xs)}
        cols["held_gib"] = statistics.median(x["held_bytes"] for x in rs) / 2**30
        summary[way] = cols
    return summary
