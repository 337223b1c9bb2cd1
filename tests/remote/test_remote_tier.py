"""The shared remote tier against real servers: cross-node hits, faults, abuse. Redis and Mooncake alike."""

from __future__ import annotations

import os
import pickle
import threading
import time

import numpy as np
import pytest
import redis

from kvprefetch.config import ConfigError, StoreConfig
from kvprefetch.store import Tier
from kvprefetch.testbed.local_servers import RedisServer
from tests.remote.conftest import remote_section
from tests.store.conftest import chunk_payload

CHUNK = 64 * 1024
BACKENDS = ["redis", "mooncake"]


@pytest.fixture(params=BACKENDS)
def remote(request):
    if request.param == "redis":
        return remote_section("redis", redis_server=request.getfixturevalue("redis_server"))
    return remote_section("mooncake", mooncake_master=request.getfixturevalue("mooncake_master"))


def _load(store, keys):
    out = [np.zeros(CHUNK, np.uint8) for _ in keys]
    n = store.get_into(keys, out)
    assert all((o == chunk_payload(k)).all() for o, k in zip(out[:n], keys[:n], strict=True)), "wrong bytes"
    return n


def test_history_computed_on_node_a_is_a_hit_on_node_b(open_node, keyer, remote):
    node_a, node_b = open_node(remote), open_node(remote)
    keys = keyer.keys(range(16 * 6))
    node_a.put(keys, [chunk_payload(k) for k in keys]).result(30)
    assert node_a.stats()["store"]["remote_writes"] == 6
    assert node_b.lookup(keys).tiers == [Tier.REMOTE] * 6
    assert _load(node_b, keys) == 6
    assert node_b.stats()["store"]["remote_hits"] == 6
    assert node_b.lookup(keys).tiers == [Tier.DRAM] * 6, "a remote read lands in DRAM"


def test_residency_names_every_tier_holding_a_key_as_the_tiers_answer_now(open_node, keyer, redis_server):
    """What the KV events announce: each tier asked itself, whoever changed it (not this process's index)."""
    remote = remote_section("redis", redis_server=redis_server)
    node_a, node_b = open_node(remote), open_node(remote)
    keys = keyer.keys(range(16 * 3))
    node_a.put(keys, [chunk_payload(k) for k in keys]).result(30)
    assert node_a.residency(keys) == [frozenset({Tier.DRAM, Tier.DISK, Tier.REMOTE})] * 3
    assert node_b.residency(keys) == [frozenset({Tier.REMOTE})] * 3
    node_a.disk.path_of(keys[0]).unlink()  # removed behind the store's back (another process, `status --gc`)
    node_a.dram.discard(keys[1])
    assert node_a.disk.contains(keys[0]), "(its index still lists the file)"
    assert node_a.residency(keys[:2]) == [frozenset({Tier.DRAM, Tier.REMOTE}), frozenset({Tier.DISK, Tier.REMOTE})]


def test_prefetch_pulls_remote_hits_into_dram(open_node, keyer, remote):
    node_a, node_b = open_node(remote), open_node(remote)
    keys = keyer.keys(range(16 * 4))
    node_a.put(keys, [chunk_payload(k) for k in keys]).result(30)
    handle = node_b.prefetch(keys)
    assert handle.wait(30) and all(handle.results().values())
    assert node_b.lookup(keys).tiers == [Tier.DRAM] * 4
    batch = node_b.remote.backend.batch_size
    assert node_b.stats()["io"]["remote/prefetch"]["ops"] == -(-4 // batch), "one round trip per batch"


def test_local_hits_then_remote_hits_form_one_prefix(open_node, keyer, remote):
    node_a, node_b = open_node(remote), open_node(remote)
    keys = keyer.keys(range(16 * 5))
    node_a.put(keys, [chunk_payload(k) for k in keys]).result(30)
    node_b.put(keys[:2], [chunk_payload(k) for k in keys[:2]]).result(30)
    assert node_b.lookup(keys).tiers == [Tier.DRAM, Tier.DRAM, Tier.REMOTE, Tier.REMOTE, Tier.REMOTE]
    assert _load(node_b, keys) == 5


def test_a_value_for_another_key_or_namespace_is_never_served(open_node, keyer, namespace, remote):
    from kvprefetch.keys import ChunkKeyer

    node_a, node_b = open_node(remote), open_node(remote)
    toks = list(range(16 * 3))
    other = ChunkKeyer(namespace.model_copy(update={"tenant": "mallory"}), 16).keys(toks)
    keys = keyer.keys(toks)
    node_a.put(other, [chunk_payload(k) for k in other]).result(30)
    assert node_b.lookup(keys).num_hit_chunks == 0, "another tenant's keys are other names"
    # now plant the other tenant's value under our first key's name, byte for byte
    image = node_a.dram.image(node_a.dram.acquire(other[0]))[: node_a.image_bytes]
    node_a.remote.backend.write_from([node_b.remote.name_of(keys[0])], [image])
    assert node_b.lookup(keys).tiers == [Tier.REMOTE]
    assert _load(node_b, keys) == 0
    assert node_b.remote.counters["corrupt"] == 1
    assert node_b.lookup(keys).num_hit_chunks == 0, "the bad value was removed"


def test_nothing_read_from_the_shared_tier_is_deserialised(open_node, keyer, redis_server, tmp_path):
    remote = remote_section("redis", redis_server=redis_server)
    node = open_node(remote)
    keys = keyer.keys(range(16))
    marker = tmp_path / "pwned"

    class Bomb:
        def __reduce__(self):
            return (os.system, (f"touch {marker}",))

    redis.Redis.from_url(redis_server.url).set(node.remote.name_of(keys[0]), pickle.dumps(Bomb()))
    assert node.lookup(keys).tiers == [Tier.REMOTE]
    assert _load(node, keys) == 0
    assert not marker.exists()


@pytest.mark.parametrize("prefix", ["a b", "../x", "k\r\nFLUSHALL", "x" * 65])
def test_key_prefixes_cannot_escape(prefix):
    with pytest.raises(ConfigError, match=r"remote\.key_prefix"):
        StoreConfig.load(tiers=["dram", "remote"], remote={"key_prefix": prefix})


def test_names_are_prefix_plus_hex(open_node, keyer, redis_server):
    node = open_node(remote_section("redis", redis_server=redis_server))
    name = node.remote.name_of(keyer.keys(range(16))[0])
    assert name.startswith(node.config.remote.key_prefix)
    assert all(c in "0123456789abcdef" for c in name[len(node.config.remote.key_prefix) :])


def test_hit_count_policy_shares_only_reused_chunks(open_node, keyer, redis_server):
    remote = remote_section("redis", redis_server=redis_server, write_policy="hit_count", min_hits=2)
    node_a, node_b = open_node(remote), open_node(remote)
    keys = keyer.keys(range(16 * 2))
    node_a.put(keys, [chunk_payload(k) for k in keys]).result(30)
    assert node_b.lookup(keys).num_hit_chunks == 0, "not shared before it is reused"
    _load(node_a, keys[:1])
    _load(node_a, keys[:1])
    node_a.flush(10)
    assert node_b.lookup(keys).tiers == [Tier.REMOTE]


def test_redis_killed_and_restarted_degrades_to_misses_then_reconnects(open_node, keyer, tmp_path):
    server = RedisServer(tmp_path)
    try:
        remote = remote_section("redis", redis_server=server)
        node_a, node_b = open_node(remote), open_node(remote)
        keys = keyer.keys(range(16 * 3))
        node_a.put(keys, [chunk_payload(k) for k in keys]).result(30)
        server.kill()
        t0 = time.monotonic()
        assert node_b.lookup(keys).num_hit_chunks == 0
        assert _load(node_b, keys) == 0
        assert node_b.lookup(keys).num_hit_chunks == 0
        assert time.monotonic() - t0 < 5, "a dead remote must not stall requests"
        # Counted once per failed attempt to reach it (the first lookup), not per chunk it turned into a miss.
        assert node_b.errors.totals() == {"remote/unavailable": 1}
        more = keyer.keys(range(1000, 1000 + 16 * 2))
        node_a.put(more, [chunk_payload(k) for k in more]).result(30)  # the write-through fails quietly
        assert _load(node_a, more) == 2, "local tiers keep serving"
        assert set(node_a.errors.totals()) == {"remote/unavailable"}  # (its I/O threads may each have tried once)
        server.start()  # empty: no persistence
        time.sleep(0.6)  # past retry_after_s
        node_a.put(keys, [chunk_payload(k) for k in keys])
        node_a.dram.discard(keys[0])
        node_a.remote.write(keys[0], _image_of(node_a, keys[0]))
        assert node_b.lookup(keys[:1]).tiers == [Tier.REMOTE]
        assert _load(node_b, keys[:1]) == 1
        assert node_b.remote.counters["reconnects"] >= 1
    finally:
        server.kill()


def _image_of(store, key):
    from kvprefetch.tiers.chunk_format import write_header
    from kvprefetch.tiers.disk import aligned_buffer

    image = aligned_buffer(store.image_bytes)
    image[4096 : 4096 + CHUNK] = chunk_payload(key)
    write_header(image, key, CHUNK)
    return image


def test_a_slow_redis_reads_as_a_miss_within_the_timeout(open_node, keyer, tmp_path):
    server = RedisServer(tmp_path, "--enable-debug-command", "local")
    try:
        remote = remote_section("redis", redis_server=server, timeout_s=0.3)
        node_a, node_b = open_node(remote), open_node(remote)
        keys = keyer.keys(range(16 * 2))
        node_a.put(keys, [chunk_payload(k) for k in keys]).result(30)
        stall = threading.Thread(target=lambda: redis.Redis(port=server.port).execute_command("DEBUG", "SLEEP", "2"))
        stall.start()
        time.sleep(0.1)
        t0 = time.monotonic()
        assert node_b.lookup(keys).num_hit_chunks == 0
        assert time.monotonic() - t0 < 1.5
        stall.join()
    finally:
        server.kill()


def test_a_full_redis_evicts_whole_values_never_half(open_node, keyer, tmp_path):
    server = RedisServer(tmp_path, "--maxmemory", "2mb", "--maxmemory-policy", "allkeys-lru")
    try:
        remote = remote_section("redis", redis_server=server)
        node_a, node_b = open_node(remote), open_node(remote)
        keys = keyer.keys(range(16 * 60))
        for i in range(0, len(keys), 10):
            node_a.put(keys[i : i + 10], [chunk_payload(k) for k in keys[i : i + 10]]).result(30)
        present = node_b.remote.contains_many(keys)
        assert 0 < sum(present) < len(keys), "the server evicted some"
        for key, there in zip(keys, present, strict=True):
            if there:
                out = np.zeros(CHUNK, np.uint8)
                if node_b.get_into([key], [out]) == 1:
                    assert (out == chunk_payload(key)).all()
        assert node_b.remote.counters["corrupt"] == 0
    finally:
        server.kill()


def test_mooncake_full_evicts_without_corruption(open_node, keyer, mooncake_master):
    remote = remote_section("mooncake", mooncake_master=mooncake_master)
    remote["mooncake"]["segment_bytes"] = 16 << 20  # two nodes: a 32 MiB pool
    chunk = 512 * 1024
    node_a, node_b = open_node(remote, chunk_bytes=chunk), open_node(remote, chunk_bytes=chunk)
    keys = keyer.keys(range(16 * 100))  # 50 MiB of chunks
    payload = {k: np.random.default_rng(i).integers(0, 256, chunk, dtype=np.uint8) for i, k in enumerate(keys)}
    for i in range(0, len(keys), 10):
        node_a.put(keys[i : i + 10], [payload[k] for k in keys[i : i + 10]]).result(60)
    stats = node_a.remote.counters
    assert stats["writes"] > 0 and stats["write_rejected"] > 0, stats
    assert node_a.remote.available, "a full pool is not a dead pool"
    present = node_b.remote.contains_many(keys)
    assert 0 < sum(present) < len(keys)
    for key, there in zip(keys, present, strict=True):
        out = np.zeros(chunk, np.uint8)
        if there and node_b.get_into([key], [out]) == 1:
            assert (out == payload[key]).all()
    assert node_b.remote.counters["corrupt"] == 0
    assert node_b.stats()["store"]["remote_hits"] > 0


@pytest.fixture
def own_master(tmp_path):
    """A Mooncake master of the test's own, killed after the stores that use it are closed (requested before
    `open_node`, it is torn down after it: a Mooncake client closing with its master dead waits ~12 s)."""
    from kvprefetch.testbed.local_servers import MooncakeMaster

    master = MooncakeMaster(tmp_path)
    yield master
    master.kill()


def test_mooncake_master_killed_and_restarted_degrades_then_reconnects(own_master, open_node, keyer):
    master = own_master
    remote = remote_section("mooncake", mooncake_master=master)
    node_a, node_b = open_node(remote), open_node(remote)
    keys = keyer.keys(range(16 * 3))
    node_a.put(keys, [chunk_payload(k) for k in keys]).result(30)
    assert node_b.lookup(keys).tiers == [Tier.REMOTE] * 3
    master.kill()
    t0 = time.monotonic()
    assert _load(node_b, keys) == 0
    assert node_b.lookup(keys).num_hit_chunks == 0
    assert time.monotonic() - t0 < 10, "a dead master must not stall requests"
    master.start()
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:  # clients re-register with the new master on their own
        node_a.dram.discard(keys[0])
        node_a.put(keys[:1], [chunk_payload(keys[0])]).result(30)
        if node_b.lookup(keys[:1]).tiers == [Tier.REMOTE]:
            break
        time.sleep(1)
    assert _load(node_b, keys[:1]) == 1


def test_seed_remote_fills_the_shared_tier_only(open_node, keyer, redis_server, tmp_path):
    """A benchmark's remote mode starts with its chunks in the shared tier alone: copied from a disk tier's
    directory through DRAM slots given back unpublished, so this node's DRAM and disk hold none of them."""
    from kvprefetch.tiers.disk import DiskTier

    keys = keyer.keys(range(16 * 3))
    source = open_node(remote_section("redis", redis_server), tiers=("dram", "disk"))
    source.put(keys, [bytes([i]) * source.chunk_bytes for i in range(3)]).result(10)
    assert source.flush(10)
    node = open_node(remote_section("redis", redis_server))
    assert node.seed_remote(keys, DiskTier(source.config.disk.path, 1 << 30, direct_io=False, fsync=False)) == 3
    assert node.residency(keys) == [frozenset({"remote"})] * 3
    with pytest.raises(RuntimeError, match="remote tier"):
        source.seed_remote(keys, DiskTier(source.config.disk.path, 1 << 30, direct_io=False, fsync=False))
