"""`kvprefetch status`: the node's pools and disk tier as an operator sees them; dead processes reaped."""

import json
import multiprocessing as mp
import os
import subprocess
import sys

from .conftest import chunk_payload


def _pin_and_die(name: str, directory: str, key: bytes) -> None:
    from kvprefetch.tiers.dram import SharedChunkPool

    pool = SharedChunkPool.attach(name, directory)
    assert pool.acquire(key) is not None
    os._exit(0)  # no detach: its row and pin stay behind


def test_status_lists_pools_and_reaps_dead_processes(open_store, keyer):
    store = open_store()
    keys = keyer.keys(range(16 * 3))
    store.put(keys, [chunk_payload(k) for k in keys]).result(10)
    proc = mp.get_context("spawn").Process(
        target=_pin_and_die, args=(store.dram.name, str(store.dram.path.parent), keys[0])
    )
    proc.start()
    proc.join(60)
    assert store.stats()["dram"]["slots_pinned"] == 1
    env = dict(os.environ, KVPREFETCH_DISK__PATH=str(store.disk.root))
    out = subprocess.run([sys.executable, "-m", "kvprefetch.cli", "status", "--json"], capture_output=True,
                         text=True, env=env, timeout=60, check=True).stdout  # fmt: skip
    report = json.loads(out)
    mine = {p["name"]: p for p in report["pools"]}[store.dram.name]
    assert mine["slots_ready"] == 3
    assert mine["reaped_dead_processes"] == 1 and mine["processes"] == 1
    assert report["disk"]["chunks"] == 3
    assert store.stats()["dram"]["slots_pinned"] == 0, "the dead process's pin is gone"
