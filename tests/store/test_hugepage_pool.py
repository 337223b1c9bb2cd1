"""The DRAM pool on huge pages (hugetlbfs): same behaviour, shared with another process, clear errors."""

import multiprocessing as mp
import os

import numpy as np
import pytest

from kvprefetch.bench.micro.iobench import huge_page_pool
from kvprefetch.store import TieredStore
from kvprefetch.tiers.dram import PoolGeometryError

from .conftest import CHUNK_BYTES, chunk_payload

POOL = 4 << 20


@pytest.fixture
def huge_dir():
    with huge_page_pool(POOL + (8 << 20)) as directory:
        if directory is None:
            pytest.skip("no huge pages here (needs root to reserve them and mount hugetlbfs)")
        yield directory


def _child(config_json, keys, queue):
    from kvprefetch.config import StoreConfig

    store = TieredStore(StoreConfig.model_validate_json(config_json), chunk_bytes=CHUNK_BYTES)
    out = [np.zeros(CHUNK_BYTES, np.uint8) for _ in keys]
    n = store.get_into(keys, out)
    queue.put(
        (n, str(store.dram.path.parent), all((o == chunk_payload(k)).all() for o, k in zip(out, keys, strict=True)))
    )
    store.close()


def test_pool_on_hugetlbfs_round_trips_and_is_shared(open_store, keyer, huge_dir, make_config):
    store = open_store(dram={"capacity_bytes": POOL, "backing": "hugetlbfs"}, tiers=["dram"])
    assert store.dram.path.parent == huge_dir
    keys = keyer.keys(range(16 * 5))
    store.put(keys, [chunk_payload(k) for k in keys]).result(10)
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    config = make_config(dram={"capacity_bytes": POOL}, tiers=["dram"])  # backing auto finds the existing pool
    proc = ctx.Process(target=_child, args=(config.model_dump_json(), keys, queue))
    proc.start()
    assert queue.get(timeout=60) == (5, str(huge_dir), True)
    proc.join(30)


def test_asking_for_huge_pages_without_any_is_a_clear_error(open_store, monkeypatch):
    monkeypatch.setattr("kvprefetch.tiers.dram.hugetlbfs_mount", lambda: None)
    with pytest.raises(PoolGeometryError, match="nr_hugepages"):
        open_store(dram={"backing": "hugetlbfs"})


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root")
def test_pool_survives_without_huge_pages(open_store, keyer):
    store = open_store(dram={"backing": "shm"})
    assert str(store.dram.path).startswith("/dev/shm")
