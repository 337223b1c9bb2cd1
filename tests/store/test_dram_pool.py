"""The shared-memory DRAM pool: LRU eviction, pins, and sharing with another process."""

import multiprocessing as mp
import os
import uuid
from pathlib import Path

import numpy as np
import pytest

from kvprefetch.tiers.chunk_format import HEADER_BYTES, write_header
from kvprefetch.tiers.dram import PoolGeometryError, SharedChunkPool

SLOT = 16384
PAYLOAD = SLOT - HEADER_BYTES


@pytest.fixture
def pool():
    p = SharedChunkPool(f"t-{uuid.uuid4().hex[:10]}", slot_bytes=SLOT, capacity_bytes=4 * SLOT)
    yield p
    p.destroy()


def key(i: int) -> bytes:
    return i.to_bytes(4, "little") * 8


def put(pool: SharedChunkPool, k: bytes, fill: int = 7) -> int | None:
    slot = pool.allocate(k, PAYLOAD)
    if slot is None:
        return None
    image = pool.image(slot)
    image[HEADER_BYTES:] = bytes([fill]) * PAYLOAD
    write_header(image, k, PAYLOAD)
    pool.commit(slot)
    return slot


def test_lru_evicts_the_least_recently_used(pool):
    for i in range(4):
        put(pool, key(i))
    pool.release(pool.acquire(key(0)))  # 0 becomes most recent; 1 is now the oldest
    put(pool, key(4))
    assert [pool.contains(key(i)) for i in range(5)] == [True, False, True, True, True]


def test_a_pinned_chunk_is_never_evicted(pool):
    for i in range(4):
        put(pool, key(i))
    slots = [pool.acquire(key(i)) for i in range(4)]
    assert put(pool, key(9)) is None  # everything pinned: the put is refused, nothing evicted
    assert all(pool.contains(key(i)) for i in range(4))
    pool.release(slots[2])
    assert put(pool, key(9)) is not None
    assert not pool.contains(key(2))
    assert pool.contains(key(9))


def test_a_second_put_of_a_present_key_is_refused(pool):
    assert put(pool, key(1)) is not None
    assert put(pool, key(1)) is None


def test_geometry_mismatch_is_a_clear_error(pool):
    with pytest.raises(PoolGeometryError, match=r"use another dram\.pool_name"):
        SharedChunkPool(pool.name, slot_bytes=2 * SLOT, capacity_bytes=8 * SLOT)


def _child_reads(name: str, k: bytes, conn) -> None:
    other = SharedChunkPool(name, slot_bytes=SLOT, capacity_bytes=4 * SLOT)
    slot = other.acquire(k)
    conn.send(None if slot is None else bytes(other.payload(slot, k)[:16]))
    other.close()


def _child_dies_holding_a_pin(name: str, k: bytes) -> None:
    other = SharedChunkPool(name, slot_bytes=SLOT, capacity_bytes=4 * SLOT)
    other.acquire(k)
    os._exit(0)  # no close(): its pin must not leak


def test_another_process_reads_the_same_memory(pool):
    put(pool, key(5), fill=42)
    parent, child = mp.Pipe()
    proc = mp.get_context("spawn").Process(target=_child_reads, args=(pool.name, key(5), child))
    proc.start()
    assert parent.recv() == bytes([42]) * 16
    proc.join(30)
    assert pool.stats()["processes"] == 1


def test_a_dead_process_does_not_leak_its_pins(pool):
    for i in range(4):
        put(pool, key(i))
    proc = mp.get_context("spawn").Process(target=_child_dies_holding_a_pin, args=(pool.name, key(0)))
    proc.start()
    proc.join(30)
    assert pool.pins.sum(axis=0)[pool._find(key(0))] == 1  # the dead child's pin is still recorded
    slots = [pool.acquire(key(i)) for i in (1, 2, 3)]
    assert put(pool, key(8)) is not None  # allocation reaps the dead process and evicts key 0
    assert not pool.contains(key(0))
    for s in slots:
        pool.release(s)


def test_payload_is_a_zero_copy_view(pool):
    slot = put(pool, key(3), fill=1)
    view = pool.payload(slot, key(3))
    np.frombuffer(view, np.uint8)[:4] = 9
    assert bytes(pool.image(slot)[HEADER_BYTES : HEADER_BYTES + 4]) == b"\x09" * 4
    view.release()


def test_a_slot_whose_image_is_not_its_keys_chunk_is_refused(pool):
    """What a slot table that disagrees with its image would serve (the old allocate order left one after a
    kill: a new key over an evicted chunk's bytes) is refused by the header check on every served payload."""
    from kvprefetch.tiers.chunk_format import CorruptChunk

    slot = put(pool, key(1))
    write_header(pool.image(slot), key(2), PAYLOAD)  # the image now claims another key
    with pytest.raises(CorruptChunk, match="another key"):
        pool.payload(slot, key(1))


def test_a_process_maps_a_slots_pages_in_one_call_the_first_time_it_takes_its_image(pool):
    """`image` populates the slot's pages before the caller touches any (see kvprefetch.tiers.memory)."""
    put(pool, key(6))
    parent, child = mp.Pipe()
    proc = mp.get_context("spawn").Process(target=_child_maps_a_slot, args=(pool.name, key(6), child))
    proc.start()
    before, after = parent.recv()
    proc.join(30)
    assert after - before >= SLOT // 1024, (before, after)  # kB: every page of the slot, none of it read


def _pool_rss_kb(name: str) -> int:
    """This process's resident kB in mappings of the pool's file (from /proc/self/smaps)."""
    rss, inside = 0, False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        first = line.split(maxsplit=1)[0]
        if "-" in first and not first.endswith(":"):  # a mapping's header line
            inside = name in line
        elif inside and first == "Rss:":
            rss += int(line.split()[1])
    return rss


def _child_maps_a_slot(name, k, conn):
    with SharedChunkPool.attach(name) as p:
        slot = p.acquire(k)
        before = _pool_rss_kb(name)
        p.image(slot)  # taken, not read
        conn.send((before, _pool_rss_kb(name)))
        p.release(slot)
