"""`io.threads` is the number of reads in flight: with one thread, the store reads one chunk at a time (the
bench's `ondemand-serial` mode, the whitepaper's serial baseline), whoever asks and however many ask at once."""

from __future__ import annotations

import threading
import time

import numpy as np

from .conftest import CHUNK_BYTES, chunk_payload
from .test_read_path import _evicted_store


def _read_from_many_threads(store, keys, readers: int = 4) -> None:
    def read(part):
        out = [np.zeros(CHUNK_BYTES, np.uint8) for _ in part]
        assert store.get_into(part, out) == len(part)

    parts = [keys[i::readers] for i in range(readers)]
    threads = [threading.Thread(target=read, args=(p,)) for p in parts]
    for t in threads:
        t.start()
    for t in threads:
        t.join()


def _disk_read_stats(store) -> list[dict]:
    """The store's I/O stats of its disk reads (demand and prefetch; write-back left out)."""
    io = store.stats()["io"]
    return [v for k, v in io.items() if k.startswith("disk/") and not k.endswith("writeback")]


def _peak_disk_reads(store) -> int:
    return max(v["max_running"] for v in _disk_read_stats(store))


def test_one_io_thread_keeps_one_disk_read_in_flight(open_store, keyer):
    store, keys = _evicted_store(open_store, keyer, 24, io={"threads": 1})
    _read_from_many_threads(store, keys)
    assert store.counters["promoted"] >= len(keys)  # every chunk came up from disk
    assert _peak_disk_reads(store) == 1


def test_reads_in_flight_never_exceed_the_io_threads(open_store, keyer):
    store, keys = _evicted_store(open_store, keyer, 24, io={"threads": 3})
    _read_from_many_threads(store, keys)
    assert 1 <= _peak_disk_reads(store) <= 3


def test_a_stream_cap_makes_the_store_read_each_chunk_no_faster_than_one_stream(open_store, keyer):
    """`io.read_stream_bps`: every chunk read from disk takes at least chunk / cap, however fast the disk is;
    the chunks still arrive whole (the bench's emulated array: one stream gets a fifth of its bandwidth)."""
    cap = 4 * CHUNK_BYTES  # four chunks a second per stream
    store, keys = _evicted_store(open_store, keyer, 8, io={"threads": 1, "read_stream_bps": cap})
    t0 = time.monotonic()
    _read_from_many_threads(store, keys)
    assert time.monotonic() - t0 >= len(keys) * CHUNK_BYTES / cap
    assert store.counters["promoted"] >= len(keys)


def _disk_reads(store) -> tuple[int, int]:
    """(bytes moved, ops that joined another reader's read) by the store's disk reads."""
    reads = _disk_read_stats(store)
    return sum(v["bytes"] for v in reads), sum(v["joined"] for v in reads)


def test_a_read_that_joins_another_processs_read_waits_only_for_that_read_and_moves_nothing(open_store, keyer):
    """Two stores on one DRAM pool and disk tier (the scheduler's and a worker's process): the worker asks for a
    chunk the scheduler is still reading under the emulated array's stream cap. It joins that read (the pool
    marks the slot in flight): it waits for what is left of it, not for a stream of its own, and its stats count
    no bytes moved, so the chunk counts as read once."""
    cap = CHUNK_BYTES  # one chunk per second per stream
    scheduler, keys = _evicted_store(open_store, keyer, 1, io={"threads": 1, "read_stream_bps": cap})
    worker = open_store(io={"threads": 1, "read_stream_bps": cap})
    handle = scheduler.prefetch(keys)
    time.sleep(0.5)  # half-way through the scheduler's read
    t0 = time.monotonic()
    out = [np.zeros(CHUNK_BYTES, np.uint8)]
    assert worker.get_into(keys, out) == 1
    waited = time.monotonic() - t0
    assert handle.wait(5) and (out[0] == chunk_payload(keys[0])).all()
    assert waited < 0.9  # (a stream of its own would take 1 s more)
    image = scheduler.image_bytes
    assert _disk_reads(scheduler) == (image, 0)
    assert _disk_reads(worker) == (0, 1)


def test_a_chunk_put_again_while_on_disk_is_not_written_twice_nor_counted_as_a_disk_write(open_store, keyer):
    """A chunk the engine computed anyway (DRAM had evicted it; disk holds it) is put again: into DRAM, and its
    write-back finds the file committed and writes nothing. The I/O stats count the disk writes that happened,
    once per chunk: a soak judging a full disk from them must not see a write where none reached the disk."""
    store, keys = _evicted_store(open_store, keyer, 6)
    mtimes = [store.disk.path_of(k).stat().st_mtime_ns for k in keys]
    store.put(keys, [chunk_payload(k) for k in keys]).result(30)
    assert [store.disk.path_of(k).stat().st_mtime_ns for k in keys] == mtimes
    wb = store.stats()["io"]["disk/writeback"]
    assert (wb["ops"], wb["bytes"], wb["errors"]) == (len(keys), len(keys) * store.image_bytes, 0)
    assert wb["joined"] == len(keys)
