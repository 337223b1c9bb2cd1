"""Chunks scattered into and gathered from several runs of the caller's memory (`Segments`: a page of SGLang's
host pool), through every path a chunk takes: DRAM, a disk read, a disk read around a full DRAM pool."""

from __future__ import annotations

import numpy as np

from kvprefetch.tiers.memory import Segments
from tests.store.conftest import CHUNK_BYTES, chunk_payload


def _runs(arena: np.ndarray, offsets: list[int], sizes: list[int]) -> Segments:
    return Segments(memoryview(arena[o : o + n]) for o, n in zip(offsets, sizes, strict=True))


# a chunk in three runs, out of order in the arena and with gaps between them
OFFSETS, SIZES = [40_000, 1_000, 150_000], [CHUNK_BYTES // 2, CHUNK_BYTES // 4, CHUNK_BYTES // 4]


def test_a_chunk_goes_out_of_and_back_into_runs_byte_for_byte(open_store, keyer):
    store = open_store()
    key = keyer.keys(list(range(16)))[0]
    src_arena = np.zeros(256 << 10, np.uint8)
    want = chunk_payload(key)
    at = 0
    for off, n in zip(OFFSETS, SIZES, strict=True):
        src_arena[off : off + n] = want[at : at + n]
        at += n
    store.put([key], [_runs(src_arena, OFFSETS, SIZES)]).result(timeout=30)
    out = np.full(256 << 10, 7, np.uint8)
    assert store.get_into([key], [_runs(out, OFFSETS, SIZES)]) == 1  # from DRAM
    assert np.array_equal(out[OFFSETS[0] : OFFSETS[0] + SIZES[0]], want[: SIZES[0]])
    got = np.concatenate([out[o : o + n] for o, n in zip(OFFSETS, SIZES, strict=True)])
    assert np.array_equal(got, want)
    outside = np.ones(out.size, bool)
    for o, n in zip(OFFSETS, SIZES, strict=True):
        outside[o : o + n] = False
    assert (out[outside] == 7).all()  # nothing written between the runs

    store.dram.discard(key)
    out[:] = 7
    assert store.get_into([key], [_runs(out, OFFSETS, SIZES)]) == 1  # from disk, through DRAM
    assert np.array_equal(np.concatenate([out[o : o + n] for o, n in zip(OFFSETS, SIZES, strict=True)]), want)


def test_a_chunk_read_around_a_full_dram_pool_lands_in_runs(open_store, keyer):
    """Every DRAM slot pinned: the disk read goes through a bounce buffer, then into the runs."""
    store = open_store(dram={"capacity_bytes": 4 * (CHUNK_BYTES + 8192)})
    keys = keyer.keys(list(range(16 * 12)))
    store.put(keys, [chunk_payload(k) for k in keys]).result(timeout=30)
    held = [k for k in keys if store.in_dram([k])[0]]
    assert all(store.pin(held))
    cold = next(k for k in keys if not store.in_dram([k])[0])
    out = np.zeros(256 << 10, np.uint8)
    disk_hits = store.counters["disk_hits"]
    assert store.get_into([cold], [_runs(out, OFFSETS, SIZES)]) == 1
    assert store.counters["disk_hits"] == disk_hits + 1
    got = np.concatenate([out[o : o + n] for o, n in zip(OFFSETS, SIZES, strict=True)])
    assert np.array_equal(got, chunk_payload(cold))
    assert not store.in_dram([cold])[0]  # read around the pool, not into it
    store.unpin(held)


def test_drop_local_empties_dram_and_disk_but_a_pinned_chunk(open_store, keyer):
    store = open_store()
    keys = keyer.keys(list(range(16 * 6)))
    store.put(keys, [chunk_payload(k) for k in keys]).result(timeout=30)
    assert store.pin(keys[:1]) == [True]
    dropped = store.drop_local()
    assert dropped >= len(keys)  # five DRAM slots and six files
    assert store.in_dram(keys) == [True] + [False] * 5
    assert store.lookup(keys).num_hit_chunks == 1
    store.unpin(keys[:1])
