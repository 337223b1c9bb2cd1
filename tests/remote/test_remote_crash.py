"""The remote tier's write path on a real redis-server: a save is reported stored only once the server
acknowledged it, and a half-written value is never served, whether its writer was SIGKILLed mid-way or the
server refused it."""

from __future__ import annotations

import signal
import subprocess
import sys
import uuid

import numpy as np
import pytest
import redis

from kvprefetch.testbed.local_servers import RedisServer
from kvprefetch.tiers.chunk_format import HEADER_BYTES, image_bytes, verify_image, write_header
from kvprefetch.tiers.disk import aligned_buffer
from tests.remote.conftest import remote_section
from tests.store.crash_driver import CHUNK, key_of, payload
from tests.store.crash_harness import DRIVER, Tally, child_env, remove_pool

N_KEYS = 5
LOCAL = ("dram", "remote")


def _read(node, key: bytes) -> bool | None:
    """None on a miss, else whether the bytes served were right."""
    out = np.zeros(CHUNK, np.uint8)
    return None if not node.get_into([key], [out]) else bool((out == payload(key)).all())


def _image(key: bytes) -> memoryview:
    image = aligned_buffer(image_bytes(CHUNK))
    image[HEADER_BYTES : HEADER_BYTES + CHUNK] = payload(key).tobytes()
    write_header(image, key, CHUNK)
    return image


def _assert_every_value_whole(client: redis.Redis, names: dict[bytes, str]) -> None:
    for key, name in names.items():
        value = client.get(name)
        if value is not None:
            verify_image(memoryview(value), key)  # raises on a half or damaged value


@pytest.mark.parametrize("crash_at", ["store.remote_write.sending:3", "store.remote_write.acked:3"])
def test_a_writer_killed_mid_write_through_acked_only_what_the_server_holds_whole(open_node, redis_server, crash_at):
    remote = remote_section("redis", redis_server=redis_server)
    pool = f"rw-{uuid.uuid4().hex[:10]}"
    proc = subprocess.Popen([sys.executable, str(DRIVER), "remote", redis_server.url, remote["key_prefix"], pool,
                             str(N_KEYS)], stdout=subprocess.PIPE, text=True, env=child_env(crash_at))  # fmt: skip
    try:
        out, _ = proc.communicate(timeout=120)
    finally:
        remove_pool(pool)
    assert proc.returncode == -signal.SIGKILL, f"the writer never reached {crash_at}"
    tally = Tally()
    tally.absorb(out)
    keys = [key_of(2000 + i) for i in range(N_KEYS)]
    assert tally.acked == set(keys[:2]), "one put at a time: the two before the killed third were acknowledged"
    node_b = open_node(remote, tiers=LOCAL)
    for key in keys:
        got = _read(node_b, key)
        assert got is not False, "wrong bytes served from the remote tier"
        assert got or key not in tally.acked, "an acknowledged save is missing from the remote tier"
    client = redis.Redis.from_url(redis_server.url)
    _assert_every_value_whole(client, {k: node_b.remote.name_of(k) for k in keys})
    if crash_at.startswith("store.remote_write.sending"):
        assert not client.exists(node_b.remote.name_of(keys[2])), "a write never sent cannot be there"


_HALF_SET = """
import socket, sys, time
port, name, half = int(sys.argv[1]), sys.argv[2], sys.stdin.buffer.read()
sock = socket.create_connection(("127.0.0.1", port))
head = f"*3\\r\\n$3\\r\\nSET\\r\\n${len(name)}\\r\\n{name}\\r\\n${2 * len(half)}\\r\\n".encode()
sock.sendall(head + half)  # the command announces the whole image and sends half of it
print("SENT", flush=True)
time.sleep(120)
"""


def test_a_client_killed_halfway_through_a_set_leaves_no_value(open_node, redis_server):
    remote = remote_section("redis", redis_server=redis_server)
    node = open_node(remote, tiers=LOCAL)
    key = key_of(2100)
    name = node.remote.name_of(key)
    image = _image(key)
    proc = subprocess.Popen([sys.executable, "-c", _HALF_SET, str(redis_server.port), name],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE)  # fmt: skip
    proc.stdin.write(bytes(image[: len(image) // 2]))
    proc.stdin.close()
    assert proc.stdout.readline() == b"SENT\n"
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    client = redis.Redis.from_url(redis_server.url)
    assert not client.exists(name), "redis executes only whole commands: half a SET stores nothing"
    assert node.lookup([key]).num_hit_chunks == 0 and _read(node, key) is None


def test_a_half_value_in_the_remote_is_a_miss_and_is_dropped(open_node, redis_server):
    remote = remote_section("redis", redis_server=redis_server)
    writer, reader = open_node(remote, tiers=LOCAL), open_node(remote, tiers=LOCAL)
    key = key_of(2200)
    assert writer.put([key], [payload(key)]).result(30) == 1
    client = redis.Redis.from_url(redis_server.url)
    name = writer.remote.name_of(key)
    client.set(name, client.get(name)[: image_bytes(CHUNK) // 2])  # what a torn upload would leave
    assert _read(reader, key) is None, "a half value is a miss"
    assert not client.exists(name), "and is dropped from the shared tier"
    assert reader.remote.counters["corrupt"] == 1
    assert reader.errors.totals() == {"remote/corrupt": 1}


def test_a_save_the_server_refuses_is_not_reported_stored(open_node, tmp_path):
    server = RedisServer(tmp_path, "--maxmemory", "2mb", "--maxmemory-policy", "noeviction")
    try:
        remote = remote_section("redis", redis_server=server)
        node = open_node(remote, tiers=LOCAL)
        client = redis.Redis.from_url(server.url)
        keys = [key_of(2300 + i) for i in range(40)]  # 40 images of 68 KiB: more than 2 MiB holds
        reported = {k: node.put([k], [payload(k)]).result(30) == 1 for k in keys}
        stored = {k: bool(client.exists(node.remote.name_of(k))) for k in keys}
        assert reported == stored, "a save is reported stored exactly when the server holds it"
        assert not all(reported.values()), "the server refused some (noeviction, full)"
        assert node.stats()["store"]["remote_writes"] == sum(reported.values())
        _assert_every_value_whole(client, {k: node.remote.name_of(k) for k in keys})
    finally:
        server.kill()

