"""The disk read path's two levers: huge-page staging buffers and the cap on bytes of reads in flight."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import numpy as np
import pytest

from kvprefetch.bench.micro.hugepages import reserved_huge_pages
from kvprefetch.tiers.inflight import InflightBytes
from kvprefetch.tiers.staging import StagingBuffers

from .conftest import CHUNK_BYTES, chunk_payload


@pytest.fixture
def huge_pages():
    with reserved_huge_pages(64 << 20) as ok:
        if not ok:
            pytest.skip("no huge pages here (needs root to reserve them)")
        yield


def _evicted_store(open_store, keyer, n_chunks: int, **overrides):
    store = open_store(**overrides)
    keys = keyer.keys(range(16 * n_chunks))
    store.put(keys, [chunk_payload(k) for k in keys]).result(30)
    for key in keys:
        store.dram.discard(key)
    return store, keys


def _read_back(store, keys) -> None:
    """Every chunk reads back byte-identical to what was put."""
    out = [np.zeros(CHUNK_BYTES, np.uint8) for _ in keys]
    assert store.get_into(keys, out) == len(keys)
    assert all((o == chunk_payload(k)).all() for o, k in zip(out, keys, strict=True))


def _prefetch_and_read_back(store, keys) -> None:
    handle = store.prefetch(keys)
    handle.wait()
    assert all(handle.results().values())
    _read_back(store, keys)


def test_staged_reads_are_byte_identical_and_use_the_staging_buffers(open_store, keyer, huge_pages):
    store, keys = _evicted_store(open_store, keyer, 24, disk={"staging": "auto"}, io={"threads": 4})
    _prefetch_and_read_back(store, keys)
    staging = store.disk.staging
    assert staging.reads_staged >= len(keys)
    assert 1 <= len(staging._maps) <= store.config.io.threads


def test_staging_off_reads_straight_into_the_slots(open_store, keyer):
    store, keys = _evicted_store(open_store, keyer, 4, disk={"staging": "off"})
    assert store.disk.staging is None
    _read_back(store, keys)


def test_staging_without_enough_huge_pages_lends_nothing_and_switches_off():
    free = int(Path("/sys/kernel/mm/hugepages/hugepages-2048kB/free_hugepages").read_text())
    staging = StagingBuffers((free + 1) * (2 << 20), max_buffers=2)  # more than the node has free
    with staging.lend(4096) as buf:
        assert buf is None
    assert not staging.available
    staging.close()


def _max_concurrency(gate: InflightBytes, sizes: list[int]) -> tuple[int, list[tuple[int, int]]]:
    """Run one thread per size through the gate; return the peak of reads inside it at once and every
    (bytes inside, count inside) seen on entry."""
    lock = threading.Lock()
    inside = {"n": 0, "bytes": 0, "peak": 0}
    seen: list[tuple[int, int]] = []

    def read(nbytes: int) -> None:
        with gate.admit(nbytes):
            with lock:
                inside["n"] += 1
                inside["bytes"] += nbytes
                inside["peak"] = max(inside["peak"], inside["n"])
                seen.append((inside["bytes"], inside["n"]))
            time.sleep(0.02)
            with lock:
                inside["n"] -= 1
                inside["bytes"] -= nbytes

    threads = [threading.Thread(target=read, args=(size,)) for size in sizes]
    for t in threads:
        t.start()
    for t in threads:
        t.join(10)
    return inside["peak"], seen


def test_inflight_cap_bounds_the_bytes_of_reads_at_once():
    peak, seen = _max_concurrency(InflightBytes(3 << 20), [1 << 20] * 12)
    assert peak == 3
    assert all(nbytes <= 3 << 20 for nbytes, _ in seen)


def test_a_read_larger_than_the_cap_runs_alone_and_is_not_starved():
    peak, seen = _max_concurrency(InflightBytes(1 << 20), [4 << 20] * 6)
    assert peak == 1
    assert len(seen) == 6


def test_a_wide_cap_lets_reads_overlap():
    peak, _ = _max_concurrency(InflightBytes(64 << 20), [1 << 20] * 8)
    assert peak > 1


def test_one_read_in_flight_still_round_trips_every_chunk(open_store, keyer):
    store, keys = _evicted_store(open_store, keyer, 16, disk={"read_inflight_bytes": 1}, io={"threads": 4})
    _prefetch_and_read_back(store, keys)
