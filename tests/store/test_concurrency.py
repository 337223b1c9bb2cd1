"""Concurrent readers and writers: several threads, and two processes sharing one pool and one directory."""

import multiprocessing as mp
import threading

import numpy as np

from kvprefetch.config import StoreConfig
from kvprefetch.keys import ChunkKeyer, KVNamespace
from kvprefetch.store import TieredStore

from .conftest import CHUNK_BYTES, chunk_payload

NS = KVNamespace(model="test-llama", num_layers=2, num_kv_heads=2, head_dim=16, dtype="float32")


def _hammer(store: TieredStore, worker: int, rounds: int, errors: list) -> None:
    keyer = ChunkKeyer(NS, chunk_tokens=16)
    rng = np.random.default_rng(worker)
    for _ in range(rounds):
        prefix = int(rng.integers(0, 12))  # shared prefixes: writers and readers collide on the same keys
        toks = list(range(prefix * 16)) + list(rng.integers(0, 1000, 16 * int(rng.integers(1, 4))))
        keys = keyer.keys(toks)
        if rng.random() < 0.5:
            store.put(keys, [chunk_payload(k) for k in keys])
        out = [np.zeros(CHUNK_BYTES, np.uint8) for _ in keys]
        n = store.get_into(keys, out)
        for k, o in zip(keys[:n], out[:n], strict=True):
            if not (o == chunk_payload(k)).all():
                errors.append(f"worker {worker}: wrong bytes for {k.hex()[:12]}")


def test_threads_read_and_write_the_same_keys(open_store):
    store = open_store(dram={"capacity_bytes": 24 * (CHUNK_BYTES + 4096)})
    errors: list = []
    threads = [threading.Thread(target=_hammer, args=(store, w, 60, errors)) for w in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    store.flush(30)
    assert not errors
    assert store.stats()["dram"]["slots_pinned"] == 0, "every pin was released"


def _process_main(config_json: str, worker: int, queue) -> None:
    store = TieredStore(StoreConfig.model_validate_json(config_json), chunk_bytes=CHUNK_BYTES)
    errors: list = []
    threads = [threading.Thread(target=_hammer, args=(store, worker * 10 + t, 40, errors)) for t in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    store.flush(30)
    store.close()
    queue.put(errors)


def test_two_processes_share_one_pool_and_one_directory(make_config):
    config = make_config(dram={"capacity_bytes": 24 * (CHUNK_BYTES + 4096)})
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    procs = [ctx.Process(target=_process_main, args=(config.model_dump_json(), w, queue)) for w in (1, 2)]
    for p in procs:
        p.start()
    results = [queue.get(timeout=180) for _ in procs]
    for p in procs:
        p.join(30)
    assert all(p.exitcode == 0 for p in procs)
    assert results == [[], []]
    # what the two wrote is one cache: a third opener finds it all, valid
    store = TieredStore(config, chunk_bytes=CHUNK_BYTES)
    try:
        assert store.dram.stats()["processes"] == 1
        keys = list(store.disk._index)
        assert keys
        for k in keys[:50]:
            out = np.zeros(CHUNK_BYTES, np.uint8)
            if store.get_into([k], [out]) == 1:
                assert (out == chunk_payload(k)).all()
    finally:
        store.close()
        store.dram.destroy()
