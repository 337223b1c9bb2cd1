"""The parts of the store API that connectors lean on: zero-copy views, per-chunk prefetch results, and
joining another process's in-flight read instead of reading the chunk twice."""

import multiprocessing as mp
import time

import numpy as np

from kvprefetch.config import StoreConfig
from kvprefetch.store import TieredStore
from kvprefetch.tiers.chunk_format import HEADER_BYTES, write_header

from .conftest import CHUNK_BYTES, chunk_payload


def test_view_pins_dram_chunks_without_copying(open_store, keyer):
    store = open_store()
    keys = keyer.keys(range(16 * 4))
    store.put(keys[:3], [chunk_payload(k) for k in keys[:3]]).result(10)
    with store.view(keys) as views:
        assert len(views) == 3, "stops where the DRAM prefix ends"
        assert all(bytes(v) == chunk_payload(k).tobytes() for v, k in zip(views, keys, strict=False))
        assert store.stats()["dram"]["slots_pinned"] == 3
        assert views[0].readonly
    assert store.stats()["dram"]["slots_pinned"] == 0


def test_prefetch_results_per_chunk(open_store, keyer):
    store = open_store()
    keys = keyer.keys(range(16 * 4))
    store.put(keys, [chunk_payload(k) for k in keys]).result(10)
    for k in keys[1:]:
        store.dram.discard(k)
    store.disk.path_of(keys[2]).write_bytes(b"garbage" * 10000)
    handle = store.prefetch(keys)
    handle.wait(10)
    assert handle.results() == {keys[0]: True, keys[1]: True, keys[2]: False, keys[3]: True}


def test_measure_reads_reads_disk_chunks_without_promoting_them(open_store, keyer):
    """The connector's disk probe: the chunks' bytes come off the disk (counted), nothing enters DRAM, and a
    save of the same keys meanwhile goes to DRAM as usual."""
    store = open_store()
    keys = keyer.keys(range(16 * 4))
    store.put(keys[:3], [chunk_payload(k) for k in keys[:3]]).result(10)
    for k in keys[1:3]:
        store.dram.discard(k)
    handle = store.measure_reads(keys)
    assert sorted(handle.tickets) == sorted(keys[1:3]), "none for a DRAM chunk or a missing one"
    ok: list[bool] = []
    handle.on_ready(lambda _k, moved: ok.append(moved))
    assert handle.wait(10) and ok == [True, True]
    assert not any(store.dram.contains(k) for k in keys[1:3]), "measured, not promoted"
    read = store.stats()["io"]["disk/prefetch"]
    assert read["ops"] == 2 and read["bytes"] == 2 * store.image_bytes, "counted as the disk's prefetch-class reads"
    store.put(keys[1:2], [chunk_payload(keys[1])]).result(10)
    assert store.dram.contains(keys[1])


def _slow_writer(config_json: str, key: bytes, hold_s: float, ready) -> None:
    store = TieredStore(StoreConfig.model_validate_json(config_json), chunk_bytes=CHUNK_BYTES)
    slot = store.dram.allocate(key, CHUNK_BYTES)
    ready.set()
    time.sleep(hold_s)  # a read in flight in this process
    image = store.dram.image(slot)
    image[HEADER_BYTES : HEADER_BYTES + CHUNK_BYTES] = chunk_payload(key)
    write_header(image, key, CHUNK_BYTES)
    store.dram.commit(slot)
    store.close()


def test_a_read_joins_another_processs_inflight_read(open_store, keyer, make_config):
    store = open_store()
    key = keyer.keys(range(16))[0]
    store.put([key], [chunk_payload(key)]).result(10)
    store.dram.discard(key)
    ctx = mp.get_context("spawn")
    ready = ctx.Event()
    child = ctx.Process(target=_slow_writer, args=(make_config().model_dump_json(), key, 1.0, ready))
    child.start()
    assert ready.wait(60)
    out = np.zeros(CHUNK_BYTES, np.uint8)
    assert store.get_into([key], [out]) == 1
    assert (out == chunk_payload(key)).all()
    assert store.stats()["store"]["promoted"] == 0, "the chunk was not read a second time"
    child.join(30)


def test_a_key_repeated_in_one_get_into_loads_its_first_place_and_leaves_no_pin(open_store, keyer):
    store = open_store()
    a, b = keyer.keys(list(range(32)))
    store.put([a, b], [chunk_payload(a), chunk_payload(b)]).result(timeout=30)
    out = [np.zeros(CHUNK_BYTES, np.uint8) for _ in range(3)]
    assert store.get_into([a, b, a], out) == 2
    assert np.array_equal(out[0], chunk_payload(a)) and np.array_equal(out[1], chunk_payload(b))
    assert store.dram.discard(a) and store.dram.discard(b)  # nobody pins them: the repeat took no second pin


def test_a_benchmark_puts_the_store_in_the_state_a_cell_starts_from(open_store, keyer):
    """The testbed's calls (`kvprefetch.testbed.engine_proc`): DRAM warmed from disk, DRAM cooled (every unpinned
    chunk, or the ones named; a pinned chunk stays), a per-stream disk cap set and lifted on an open store."""
    store = open_store()
    keys = keyer.keys(range(16 * 4))
    store.put(keys, [chunk_payload(k) for k in keys]).result(10)
    assert store.flush(10)
    assert store.cool_dram(keys[:2]) == 2 and store.in_dram(keys) == [False, False, True, True]
    assert store.preload_dram(keys, batch=3) == 4 and all(store.in_dram(keys))
    assert store.pin(keys[:1]) == [True]
    assert store.cool_dram() == 3 and store.in_dram(keys) == [True, False, False, False]  # the pinned one stays
    store.unpin(keys[:1])
    assert store.preload_dram([]) == 0
    store.set_disk_stream_limit(1e6)
    assert store.io._stream_bps == {"disk": 1e6}
    store.set_disk_stream_limit(None)
    assert store.io._stream_bps == {}
