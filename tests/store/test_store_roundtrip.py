"""Round-trips through every tier, promotion, eviction, restart recovery and namespace isolation."""

import numpy as np
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvprefetch.keys import ChunkKeyer
from kvprefetch.store import Tier

from .conftest import CHUNK_BYTES, chunk_payload


def _load(store, keys):
    out = [np.zeros(CHUNK_BYTES, np.uint8) for _ in keys]
    return store.get_into(keys, out), out


@settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(seqs=st.lists(st.lists(st.integers(0, 50_000), min_size=16, max_size=160), min_size=1, max_size=4))
def test_random_chunk_sets_round_trip_through_dram_and_disk(open_store, keyer, seqs):
    store = open_store()
    for toks in seqs:
        keys = keyer.keys(toks)
        store.put(keys, [chunk_payload(k) for k in keys]).result(30)
    for toks in seqs:
        keys = keyer.keys(toks)
        n, out = _load(store, keys)  # from DRAM
        assert n == len(keys)
        assert all((o == chunk_payload(k)).all() for o, k in zip(out, keys, strict=True))
        for k in keys:
            store.dram.discard(k)  # force the disk path
        assert store.lookup(keys).tiers == [Tier.DISK] * len(keys)
        n, out = _load(store, keys)
        assert n == len(keys)
        assert all((o == chunk_payload(k)).all() for o, k in zip(out, keys, strict=True))
        assert store.lookup(keys).tiers == [Tier.DRAM] * len(keys)  # promoted on read


def test_lookup_is_longest_prefix_with_tier_per_chunk(open_store, keyer):
    store = open_store()
    keys = keyer.keys(range(16 * 6))
    store.put(keys[:4], [chunk_payload(k) for k in keys[:4]]).result(30)
    store.dram.discard(keys[1])
    store.disk.delete(keys[3])
    result = store.lookup(keys)
    assert result.tiers == [Tier.DRAM, Tier.DISK, Tier.DRAM, Tier.DRAM]
    store.dram.discard(keys[3])
    assert store.lookup(keys).num_hit_chunks == 3
    assert store.get_into(keys, [np.zeros(CHUNK_BYTES, np.uint8) for _ in keys]) == 3


def test_dram_evicts_lru_and_disk_still_serves(open_store, keyer):
    store = open_store(dram={"capacity_bytes": 8 * (CHUNK_BYTES + 4096)})
    keys = keyer.keys(range(16 * 20))
    for k in keys:
        store.put([k], [chunk_payload(k)]).result(30)
    tiers = store.lookup(keys).tiers
    assert tiers[:12] == [Tier.DISK] * 12 and tiers[12:] == [Tier.DRAM] * 8
    n, out = _load(store, keys)
    assert n == 20 and all((o == chunk_payload(k)).all() for o, k in zip(out, keys, strict=True))


def test_a_dram_only_put_writes_nothing_back_and_a_later_put_writes_it(open_store, keyer):
    """`put(write_back=False)` (save_policy probation: a prefix seen once): in DRAM, unpinned, never on disk; a
    later ordinary put of the same key writes it back from the caller's bytes."""
    store = open_store()
    keys = keyer.keys(range(16 * 2))
    assert store.put(keys, [chunk_payload(k) for k in keys], write_back=False).result(1) == 0
    assert store.flush(30) and len(store.disk) == 0
    assert store.lookup(keys).tiers == [Tier.DRAM] * 2 and store.dram.stats()["slots_pinned"] == 0
    assert store.counters["put_dram_only"] == 2
    assert store.put(keys, [chunk_payload(k) for k in keys], write_back=False).result(1) == 0, "present: left"
    store.put(keys[:1], [chunk_payload(keys[0])]).result(30)
    assert [store.disk.contains(k) for k in keys] == [True, False]
    n, out = _load(store, keys)
    assert n == 2 and all((o == chunk_payload(k)).all() for o, k in zip(out, keys, strict=True))


def test_disk_capacity_evicts_oldest_files(open_store, keyer):
    image = CHUNK_BYTES + 4096
    store = open_store(disk={"capacity_bytes": 5 * image})
    keys = keyer.keys(range(16 * 8))
    for k in keys:
        store.put([k], [chunk_payload(k)]).result(30)
    assert len(store.disk) == 5
    assert store.disk.used_bytes <= 5 * image
    assert [store.disk.contains(k) for k in keys] == [False] * 3 + [True] * 5


def test_everything_committed_survives_a_restart(open_store, keyer, make_config):
    store = open_store()
    keys = keyer.keys(range(16 * 10))
    store.put(keys, [chunk_payload(k) for k in keys]).result(30)
    store.close()
    store.dram.destroy()  # the node lost its DRAM too (reboot)
    again = open_store()
    assert len(again.disk) == 10
    assert again.lookup(keys).tiers == [Tier.DISK] * 10
    n, out = _load(again, keys)
    assert n == 10 and all((o == chunk_payload(k)).all() for o, k in zip(out, keys, strict=True))


def test_other_model_or_tenant_never_reads_this_kv(open_store, namespace):
    store = open_store()
    toks = list(range(16 * 4))
    mine = ChunkKeyer(namespace, 16).keys(toks)
    store.put(mine, [chunk_payload(k) for k in mine]).result(30)
    for other in (namespace.model_copy(update={"tenant": "b"}), namespace.model_copy(update={"model": "x"})):
        theirs = ChunkKeyer(other, 16).keys(toks)
        assert store.lookup(theirs).num_hit_chunks == 0
        assert store.get_into(theirs, [np.zeros(CHUNK_BYTES, np.uint8) for _ in theirs]) == 0


def test_prefetch_moves_disk_hits_into_dram(open_store, keyer):
    store = open_store()
    keys = keyer.keys(range(16 * 6))
    store.put(keys, [chunk_payload(k) for k in keys]).result(30)
    for k in keys:
        store.dram.discard(k)
    handle = store.prefetch(keys)
    assert handle.wait(30)
    assert store.lookup(keys).tiers == [Tier.DRAM] * 6
    assert store.stats()["io"]["disk/prefetch"]["ops"] == 6


def test_torch_tensors_are_valid_buffers(open_store, keyer):
    torch = __import__("pytest").importorskip("torch")
    store = open_store()
    keys = keyer.keys(range(32))
    src = [torch.from_numpy(chunk_payload(k).copy()).view(torch.float32) for k in keys]
    store.put(keys, src).result(30)
    dst = [torch.zeros(CHUNK_BYTES // 4, dtype=torch.float32) for _ in keys]
    assert store.get_into(keys, dst) == 2
    assert all(a.numpy().tobytes() == b.numpy().tobytes() for a, b in zip(src, dst, strict=True))
