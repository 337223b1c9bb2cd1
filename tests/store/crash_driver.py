"""Child process of the crash harness and the soak: a writer/reader on a shared pool and disk directory.

    python crash_driver.py script DISK POOL DISK_CAPACITY   the fixed workload the kill-point harness crashes
    python crash_driver.py random DISK POOL SEED ROLE       writes (ROLE=writer) or reads (reader) forever
    python crash_driver.py remote REDIS_URL PREFIX POOL N   saves N chunks one by one to DRAM + a redis tier

It prints `ACK <key>` once a save is acknowledged (its put future resolved with no error), `OK <key>` for a
chunk it was served with the right bytes and `WRONG <key>` for one served with wrong bytes; one write per batch,
so a line cut short by a kill is never a whole line. Arm a crash point with KVPREFETCH_CRASH_AT.
"""

from __future__ import annotations

import hashlib
import os
import sys

import numpy as np

from kvprefetch.config import StoreConfig
from kvprefetch.store import TieredStore
from kvprefetch.tiers.chunk_format import image_bytes
from kvprefetch.tiers.disk import DiskFullError

CHUNK = 64 * 1024
POOL_SLOTS = 8  # the script's 12 keys overflow it: puts 9-12 evict, reads 13-16 promote from disk
SCRIPT_KEYS = 12
RANDOM_KEYS = 48


def key_of(i: int) -> bytes:
    return hashlib.sha256(f"crash-harness-{i}".encode()).digest()


def payload(key: bytes) -> np.ndarray:
    """Deterministic bytes for a key, so any process can tell whether it was served the right chunk."""
    return np.random.default_rng(int.from_bytes(key[:8], "little")).integers(0, 256, CHUNK, dtype=np.uint8)


def config(disk: str, pool: str, disk_capacity: int = 1 << 30) -> StoreConfig:
    return StoreConfig.load(
        # kept across the kills (keep_idle_s None): the restart must find what the dead left in the pool, which
        # the default policy (0) would discard as idle once every process attached to it has died
        dram={"capacity_bytes": POOL_SLOTS * image_bytes(CHUNK), "pool_name": pool, "keep_idle_s": None},
        disk={"path": disk, "capacity_bytes": disk_capacity},
        io={"threads": 2},
    )


def emit(lines: list[str]) -> None:
    """One write(2) on fd 1 per batch: a kill leaves whole lines only (a batch is far below PIPE_BUF), and a
    child forked from a process whose sys.stdout is not fd 1 (pytest's capture) still reaches its pipe."""
    if lines:
        os.write(1, "".join(f"{line}\n" for line in lines).encode())


def put(store: TieredStore, keys: list[bytes]) -> None:
    """Save keys; acknowledge them only once the store has (a full disk acknowledges nothing, says FULL)."""
    try:
        store.put(keys, [payload(k) for k in keys]).result()
    except DiskFullError:
        emit(["FULL"])
        return
    emit([f"ACK {k.hex()}" for k in keys])


def read(store: TieredStore, keys: list[bytes]) -> None:
    """Read each key alone (a miss of one does not hide the others) and say whether its bytes were right."""
    lines = []
    for key in keys:
        out = np.zeros(CHUNK, np.uint8)
        if store.get_into([key], [out]):
            lines.append(f"{'OK' if (out == payload(key)).all() else 'WRONG'} {key.hex()}")
    emit(lines)


def script(disk: str, pool: str, disk_capacity: int) -> None:
    """Every step the harness crashes: allocate into free slots, commit, write back; allocate over evicted
    slots; promote evicted chunks back from disk (reads); then a clean close."""
    keys = [key_of(i) for i in range(SCRIPT_KEYS)]
    with TieredStore(config(disk, pool, disk_capacity), chunk_bytes=CHUNK) as store:
        emit(["READY"])
        put(store, keys[:POOL_SLOTS])
        put(store, keys[POOL_SLOTS:])
        read(store, keys[:4])
    emit(["DONE"])


def random_role(disk: str, pool: str, seed: int, role: str) -> None:
    """Random batches on a small shared keyspace, until killed: writers put, readers read (prefetch too)."""
    rng = np.random.default_rng(seed)
    keys = [key_of(1000 + i) for i in range(RANDOM_KEYS)]
    with TieredStore(config(disk, pool), chunk_bytes=CHUNK) as store:
        emit(["READY"])
        while True:
            batch = [keys[int(i)] for i in rng.choice(len(keys), size=int(rng.integers(1, 5)), replace=False)]
            if role == "writer":
                put(store, batch)
            else:
                if rng.random() < 0.3:
                    store.prefetch(batch).wait(5)
                read(store, batch)


def remote_writer(url: str, prefix: str, pool: str, n: int) -> None:
    """Write-through to the remote tier, one chunk per put: ACK only where the put reports it stored."""
    cfg = StoreConfig.load(
        tiers=["dram", "remote"],
        dram={"capacity_bytes": POOL_SLOTS * image_bytes(CHUNK), "pool_name": pool},
        remote={"backend": "redis", "key_prefix": prefix, "redis": {"url": url}, "timeout_s": 2.0},
        io={"threads": 2},
    )
    with TieredStore(cfg, chunk_bytes=CHUNK) as store:
        emit(["READY"])
        for key in [key_of(2000 + i) for i in range(n)]:
            if store.put([key], [payload(key)]).result() == 1:
                emit([f"ACK {key.hex()}"])


if __name__ == "__main__":
    mode = sys.argv[1]
    if mode == "script":
        script(sys.argv[2], sys.argv[3], int(sys.argv[4]))
    elif mode == "remote":
        remote_writer(sys.argv[2], sys.argv[3], sys.argv[4], int(sys.argv[5]))
    else:
        random_role(sys.argv[2], sys.argv[3], int(sys.argv[4]), sys.argv[5])
