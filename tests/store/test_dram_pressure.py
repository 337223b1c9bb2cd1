"""The agent bench's stand-in for other traffic on the DRAM tier (`kvprefetch.testbed.pressure`), on a real pool:
unpinned chunks idle for its life go, pinned ones and ones in use stay, and nothing leaves the disk tier."""

from __future__ import annotations

import time

from kvprefetch.testbed.pressure import DramPressure

from .conftest import CHUNK_BYTES, chunk_payload


def _keys(n: int, tag: bytes) -> list[bytes]:
    return [tag.ljust(8, b"-") + i.to_bytes(24, "little") for i in range(n)]


def test_idle_unpinned_chunks_go_pinned_and_used_ones_stay(open_store):
    store = open_store()
    idle, pinned, used = _keys(3, b"idle"), _keys(2, b"pinned"), _keys(2, b"used")
    keys = idle + pinned + used
    assert store.put(keys, [chunk_payload(k) for k in keys]).result(timeout=30) == len(keys)
    assert all(store.pin(pinned))  # a lease's or a queued request's pin
    pressure = DramPressure(store.dram, life_s=0.4).start()
    try:
        t_end = time.monotonic() + 1.2
        while time.monotonic() < t_end:  # a request loading these now and then: their LRU tick moves
            for k in used:
                slot = store.dram.acquire(k)
                assert slot is not None
                store.dram.release(slot)
            time.sleep(0.1)
        deadline = time.monotonic() + 10
        while any(store.in_dram(idle)) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert store.in_dram(idle) == [False] * 3
        assert all(store.in_dram(pinned)) and all(store.in_dram(used))
    finally:
        dropped = pressure.stop()
    assert dropped == 3
    # the chunks it dropped are still on disk: the next read brings them up
    out = [bytearray(CHUNK_BYTES) for _ in idle]
    assert store.get_into(idle, out) == 3
    assert all(bytes(b) == chunk_payload(k).tobytes() for k, b in zip(idle, out, strict=True))
    store.unpin(pinned)
    assert set(store.dram.unpinned_ticks()) >= set(pinned) | set(idle)
