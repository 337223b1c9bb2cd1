"""Redis as deployed: with AUTH, over TLS, and as a Redis Cluster (keys spread over slots and nodes)."""

from __future__ import annotations

import shutil
import subprocess

import numpy as np
import pytest

from kvprefetch.store import Tier
from kvprefetch.testbed.local_servers import RedisServer, free_port, tls_args, wait_port
from kvprefetch.testbed.local_servers import tls_files as make_tls_files
from tests.remote.conftest import remote_section
from tests.store.conftest import chunk_payload

CHUNK = 64 * 1024


def _round_trip(open_node, keyer, remote: dict) -> int:
    node_a, node_b = open_node(remote), open_node(remote)
    keys = keyer.keys(range(16 * 8))
    node_a.put(keys, [chunk_payload(k) for k in keys]).result(30)
    out = [np.zeros(CHUNK, np.uint8) for _ in keys]
    n = node_b.get_into(keys, out)
    assert all((o == chunk_payload(k)).all() for o, k in zip(out[:n], keys[:n], strict=True))
    return n


def test_auth_with_the_right_password_works_and_a_wrong_one_is_a_miss(open_node, keyer, tmp_path, caplog):
    server = RedisServer(tmp_path, "--requirepass", "s3cret")
    try:
        good = remote_section("redis", redis_server=server)
        good["redis"]["password"] = "s3cret"
        assert _round_trip(open_node, keyer, good) == 8
        bad = remote_section("redis", redis_server=server)
        bad["redis"]["password"] = "wrong"
        node = open_node(bad)
        keys = keyer.keys(range(16 * 2))
        assert node.lookup(keys).num_hit_chunks == 0
        node.put(keys, [chunk_payload(k) for k in keys]).result(30)  # local tiers still take it
        assert node.lookup(keys).tiers == [Tier.DRAM, Tier.DRAM]
        assert "unavailable" in caplog.text and "redis" in caplog.text
    finally:
        server.kill()


@pytest.fixture
def tls_files(tmp_path):
    if shutil.which("openssl") is None:
        pytest.skip("openssl not installed")
    return make_tls_files(tmp_path)


def test_tls(open_node, keyer, tmp_path, tls_files):
    ca, cert, key = tls_files
    tls_port = free_port()
    server = RedisServer(tmp_path, *tls_args(tls_port, ca, cert, key))
    try:
        wait_port(tls_port)
        remote = remote_section("redis", redis_server=server)
        remote["redis"] = {"url": f"rediss://127.0.0.1:{tls_port}/0", "ssl_ca_certs": str(ca)}
        assert _round_trip(open_node, keyer, remote) == 8
    finally:
        server.kill()


@pytest.fixture
def redis_cluster(tmp_path):
    nodes = []
    try:
        for i in range(3):
            work = tmp_path / f"n{i}"
            work.mkdir()
            nodes.append(RedisServer(work, "--cluster-enabled", "yes", "--cluster-config-file", "nodes.conf"))
        addrs = [f"127.0.0.1:{n.port}" for n in nodes]
        subprocess.run(["redis-cli", "--cluster", "create", *addrs, "--cluster-replicas", "0", "--cluster-yes"],
                       check=True, capture_output=True, timeout=60)  # fmt: skip
        for n in nodes:  # wait until every node agrees the cluster is up
            for _ in range(100):
                info = subprocess.run(["redis-cli", "-p", str(n.port), "cluster", "info"], capture_output=True,
                                      text=True).stdout  # fmt: skip
                if "cluster_state:ok" in info:
                    break
                __import__("time").sleep(0.1)
        yield nodes
    finally:
        for n in nodes:
            n.kill()


def test_redis_cluster_spreads_chunks_over_nodes(open_node, keyer, redis_cluster):
    remote = remote_section("redis", redis_server=redis_cluster[0])
    remote["redis"]["cluster"] = True
    assert _round_trip(open_node, keyer, remote) == 8
    counts = [int(subprocess.run(["redis-cli", "-p", str(n.port), "dbsize"], capture_output=True, text=True)
                  .stdout.strip() or 0) for n in redis_cluster]  # fmt: skip
    assert sum(counts) == 8 and sum(1 for c in counts if c) >= 2, counts


def test_redis_cluster_a_key_that_moved_is_followed(redis_cluster):
    """The bulk path sends each key to the node the slot table names; when the table is stale the node answers
    MOVED, and the key goes through redis-py's cluster client, which follows it and mends the table."""
    from kvprefetch.tiers.remote.redis_backend import RedisBackend

    backend = RedisBackend(f"redis://127.0.0.1:{redis_cluster[0].port}/0", True, 2.0, None, None, None, None)
    try:
        names = [f"moved:{i}" for i in range(8)]
        backend.write_from(names, [memoryview(n.encode() * 100) for n in names])
        nodes = backend.client.nodes_manager
        for name in names[:4]:  # point these keys' slots at a node that does not serve them
            slot = backend.client.keyslot(name)
            owner = nodes.slots_cache[slot][0]
            nodes.slots_cache[slot] = [n for n in backend.client.get_primaries() if n.name != owner.name][:1]
        views = [memoryview(bytearray(len(n) * 100)) for n in names]
        assert backend.read_into(names, views) == [len(n) * 100 for n in names]
        assert [bytes(v) for v in views] == [n.encode() * 100 for n in names]
        nodes.slots_cache[backend.client.keyslot(names[0])] = nodes.slots_cache[backend.client.keyslot(names[5])]
        backend.write_from(names[:1], [memoryview(b"rewritten")])
        assert backend.read_into(names[:1], views[:1]) == [9] and bytes(views[0][:9]) == b"rewritten"
    finally:
        backend.close()
