"""The Redis backend's own RESP path (issue 63): values land byte-exact in their views from a real redis-server,
credentials still apply, a dead or stalled server is RemoteUnavailable, and a connection left mid-reply is never
handed to the next command. The reply parser alone is checked against every way the bytes can be split."""

from __future__ import annotations

import socket
import threading
import time
import uuid

import numpy as np
import pytest
import redis
from hypothesis import given, settings
from hypothesis import strategies as st

from kvprefetch.testbed.local_servers import RedisServer
from kvprefetch.tiers.remote import resp
from kvprefetch.tiers.remote.base import RemoteRejected, RemoteUnavailable
from kvprefetch.tiers.remote.redis_backend import RedisBackend

HEAD = 4096  # resp's header buffer: sizes around it cross from the buffer into the view
SIZES = [0, 1, 2, HEAD - 11, HEAD - 10, HEAD - 9, HEAD - 1, HEAD, HEAD + 1, 2 * HEAD + 7, 65535, 65536, 65537,
         (1 << 20) + 3]  # fmt: skip


def _backend(url: str, timeout_s: float = 2.0, **kw) -> RedisBackend:
    return RedisBackend(url, False, timeout_s, kw.get("ttl_s"), kw.get("password"), kw.get("username"), None)


def _value(size: int, seed: int) -> bytes:
    """Random bytes with RESP's own delimiters planted in them."""
    raw = bytearray(np.random.default_rng(seed).integers(0, 256, size, dtype=np.uint8).tobytes())
    for at in range(0, size - 1, 997):
        raw[at : at + 2] = b"\r\n"
    return bytes(raw)


def _names(n: int) -> list[str]:
    tag = uuid.uuid4().hex[:8]
    return [f"wire{tag}:{i}" for i in range(n)]


# ---- on a real redis-server ---------------------------------------------------------------------------------
def test_reads_land_byte_exact_in_their_views(redis_server):
    backend, client = _backend(redis_server.url), redis.Redis.from_url(redis_server.url)
    names = _names(len(SIZES))
    values = [_value(s, i) for i, s in enumerate(SIZES)]
    for name, value in zip(names, values, strict=True):
        client.set(name, value)
    for name, value in zip(names, values, strict=True):  # one per call, as the store's I/O threads read
        view = memoryview(bytearray(len(value)))
        assert backend.read_into([name], [view]) == [len(value)]
        assert bytes(view) == value
    views = [memoryview(bytearray(len(v))) for v in values]  # all in one pipelined call
    assert backend.read_into(names, views) == [len(v) for v in values]
    assert [bytes(v) for v in views] == values


def test_a_value_larger_than_its_view_fills_the_view_and_reports_its_size(redis_server):
    backend, client = _backend(redis_server.url), redis.Redis.from_url(redis_server.url)
    big, after = _names(2)
    value = _value(3 * HEAD + 5, 1)
    client.set(big, value)
    client.set(after, b"next")
    for room in (0, 7, HEAD, 2 * HEAD + 1):
        view = memoryview(bytearray(room))
        out = memoryview(bytearray(4))
        assert backend.read_into([big, after], [view, out]) == [len(value), 4]  # the rest was skipped in step
        assert bytes(view) == value[:room] and bytes(out) == b"next"
    roomy = memoryview(bytearray(b"\xee" * (len(value) + 10)))
    assert backend.read_into([big], [roomy]) == [len(value)]
    assert bytes(roomy[: len(value)]) == value and bytes(roomy[len(value) :]) == b"\xee" * 10


def test_a_missing_key_reads_as_minus_one_between_hits(redis_server):
    backend, client = _backend(redis_server.url), redis.Redis.from_url(redis_server.url)
    a, missing, b = _names(3)
    client.set(a, b"AAAA")
    client.set(b, b"BB")
    views = [memoryview(bytearray(4)) for _ in range(3)]
    assert backend.read_into([a, missing, b], views) == [4, -1, 2]
    assert bytes(views[0]) == b"AAAA" and bytes(views[1]) == bytes(4) and bytes(views[2][:2]) == b"BB"


def test_writes_go_out_from_the_views_with_their_ttl(redis_server):
    backend = _backend(redis_server.url, ttl_s=600)
    client = redis.Redis.from_url(redis_server.url)
    region = memoryview(bytearray(b"".join(_value(s, s) for s in SIZES)))
    views, at = [], 0
    for size in SIZES:  # slices at odd offsets of one region, as slots in a pool
        views.append(region[at : at + size])
        at += size
    names = _names(len(SIZES))
    backend.write_from(names, views)
    assert [client.get(n) for n in names] == [bytes(v) for v in views]
    assert 0 < client.ttl(names[-1]) <= 600
    backend.write_from(names[:1], [memoryview(b"replaced")])
    assert client.get(names[0]) == b"replaced"


def test_a_server_error_reply_is_rejected_and_the_connection_stays_usable(redis_server):
    backend, client = _backend(redis_server.url), redis.Redis.from_url(redis_server.url)
    a_list, value = _names(2)
    client.rpush(a_list, b"x")
    client.set(value, b"fine")
    out = memoryview(bytearray(4))
    with pytest.raises(RemoteRejected, match="wrong kind"):
        backend.read_into([a_list, value], [memoryview(bytearray(4)), out])
    assert bytes(out) == b"fine", "the reply after the error was still read, in step"
    assert backend.read_into([value], [out]) == [4]


def test_auth_with_a_password_and_an_acl_user(tmp_path):
    server = RedisServer(tmp_path, "--requirepass", "s3cret")
    try:
        admin = redis.Redis.from_url(server.url, password="s3cret")
        admin.acl_setuser("node", enabled=True, passwords=["+n0de"], keys=["*"], commands=["+@all"])
        for kw in ({"password": "s3cret"}, {"username": "node", "password": "n0de"}):
            backend = _backend(server.url, **kw)
            (name,) = _names(1)
            backend.write_from([name], [memoryview(b"secret value")])
            view = memoryview(bytearray(12))
            assert backend.read_into([name], [view]) == [12] and bytes(view) == b"secret value"
        for kw in ({"password": "wrong"}, {}):
            backend = _backend(server.url, **kw)
            with pytest.raises(RemoteUnavailable):
                backend.read_into([name], [view])
            with pytest.raises(RemoteUnavailable):
                backend.write_from([name], [view])
    finally:
        server.kill()


def test_a_server_killed_mid_use_is_unavailable_then_a_restarted_one_serves(tmp_path):
    server = RedisServer(tmp_path)
    try:
        backend = _backend(server.url)
        big, small = _names(2)
        backend.write_from([big, small], [memoryview(_value(64 << 20, 3)), memoryview(b"small")])
        failures: list[BaseException] = []

        def read_forever() -> None:
            view = memoryview(bytearray(64 << 20))
            try:
                while True:
                    backend.read_into([big], [view])
            except RemoteUnavailable as err:
                failures.append(err)

        reader = threading.Thread(target=read_forever)
        reader.start()
        time.sleep(0.5)  # mid-transfer, most likely: a 64 MiB value takes a while here
        server.kill()
        reader.join(30)
        assert not reader.is_alive() and len(failures) == 1
        with pytest.raises(RemoteUnavailable):
            backend.read_into([small], [memoryview(bytearray(5))])
        with pytest.raises(RemoteUnavailable):
            backend.write_from([small], [memoryview(b"small")])
        server.start()  # empty (no persistence), same port
        view = memoryview(bytearray(5))
        assert backend.read_into([small], [view]) == [-1]
        backend.write_from([small], [memoryview(b"again")])
        assert backend.read_into([small], [view]) == [5] and bytes(view) == b"again"
    finally:
        server.kill()


class StallingProxy:
    """A TCP proxy in front of a server that can hold the server's bytes to one connection after n of them, and
    let them through later: a reply broken off mid-value, with its rest arriving after the client gave up."""

    def __init__(self, upstream_port: int):
        self.upstream_port = upstream_port
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.port = self.listener.getsockname()[1]
        self.stall_at: int | None = None  # bytes of the next reply to let through before holding the rest
        self.resumed = threading.Event()
        self.stalled = threading.Event()
        self._socks: list[socket.socket] = []
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                down, _ = self.listener.accept()
            except OSError:
                return
            up = socket.create_connection(("127.0.0.1", self.upstream_port))
            self._socks += [down, up]
            threading.Thread(target=self._pump, args=(down, up, False), daemon=True).start()
            threading.Thread(target=self._pump, args=(up, down, True), daemon=True).start()

    def _pump(self, src: socket.socket, dst: socket.socket, replies: bool) -> None:
        try:
            while data := src.recv(65536):
                if replies and self.stall_at is not None:
                    cut, self.stall_at = self.stall_at, None
                    dst.sendall(data[:cut])
                    self.stalled.set()
                    self.resumed.wait(30)
                    data = data[cut:]
                dst.sendall(data)
        except OSError:
            pass

    def close(self) -> None:
        self.resumed.set()
        self.listener.close()
        for s in self._socks:
            s.close()


def test_a_connection_broken_mid_reply_is_not_reused(redis_server):
    client = redis.Redis.from_url(redis_server.url)
    first, second = _names(2)
    client.set(first, b"A" * (1 << 20))
    client.set(second, b"B" * (1 << 20))
    proxy = StallingProxy(redis_server.port)
    try:
        backend = _backend(f"redis://127.0.0.1:{proxy.port}/0", timeout_s=0.5)
        view = memoryview(bytearray(1 << 20))
        assert backend.read_into([second], [view]) == [1 << 20]  # the pool now holds one connection
        proxy.stall_at = 10_000
        with pytest.raises(RemoteUnavailable):
            backend.read_into([first], [view])
        assert proxy.stalled.is_set()
        proxy.resumed.set()  # the rest of `first` now reaches the connection that gave up on it
        time.sleep(0.2)
        view[:] = bytes(len(view))
        assert backend.read_into([second], [view]) == [1 << 20]
        assert bytes(view) == b"B" * (1 << 20), "the next command read the broken reply's leftovers"
    finally:
        proxy.close()


# ---- the reply parser alone -----------------------------------------------------------------------------------
_reply = st.one_of(
    st.tuples(st.just("value"), st.binary(max_size=3 * HEAD), st.integers(0, 3 * HEAD + 8)),
    st.tuples(st.just("null"), st.sampled_from([b"$-1\r\n", b"_\r\n"]), st.integers(0, 8)),
    st.tuples(st.just("error"), st.text("ABCDEFGHIJ xyz", min_size=1, max_size=40).map(str.encode), st.just(0)),
    st.tuples(st.just("ok"), st.just(b""), st.just(0)),
)


def _wire(reply: tuple) -> bytes:
    kind, body, _ = reply
    if kind == "value":
        return b"$%d\r\n%s\r\n" % (len(body), body)
    if kind == "null":
        return body
    if kind == "error":
        return b"-" + body + b"\r\n"
    return b"+OK\r\n"


@settings(max_examples=150, deadline=None)
@given(replies=st.lists(_reply, min_size=1, max_size=8), cuts=st.lists(st.integers(1, 5000), max_size=20))
def test_replies_parse_the_same_however_the_bytes_arrive(replies, cuts):
    stream = b"".join(_wire(r) for r in replies)
    ours, theirs = socket.socketpair()
    with ours, theirs:

        def send() -> None:
            at = 0
            for cut in [*cuts, len(stream)]:
                theirs.sendall(stream[at : at + cut])
                at += cut
                if at >= len(stream):
                    return

        sender = threading.Thread(target=send)
        sender.start()
        reader = resp.ReplyReader(ours)
        for kind, body, room in replies:
            if kind == "ok":
                reader.ok()
            elif kind == "error":
                with pytest.raises(resp.ServerError) as err:
                    reader.bulk_into(memoryview(bytearray(room)))
                assert err.value.line == body.decode()
            else:
                view = memoryview(bytearray(b"\xee" * room))
                got = reader.bulk_into(view)
                if kind == "null":
                    assert got == -1 and bytes(view) == b"\xee" * room
                else:
                    n = min(room, len(body))
                    assert got == len(body) and bytes(view[:n]) == body[:n]
                    assert bytes(view[n:]) == b"\xee" * (room - n)
        sender.join()
        assert reader.buffered == 0


@pytest.mark.parametrize("garbage", [b"*1\r\n", b"$x\r\n", b":12\r\n", b"$3\r\nabcXY", b"A" * 2000])
def test_a_reply_that_is_not_ours_is_a_protocol_error(garbage):
    ours, theirs = socket.socketpair()
    with ours, theirs:
        theirs.sendall(garbage)
        with pytest.raises(resp.ProtocolError):
            resp.ReplyReader(ours).bulk_into(memoryview(bytearray(8)))


def test_a_reply_cut_off_is_a_connection_error():
    ours, theirs = socket.socketpair()
    with ours:
        theirs.sendall(b"$100\r\n" + b"x" * 50)
        theirs.close()
        with pytest.raises(ConnectionError):
            resp.ReplyReader(ours).bulk_into(memoryview(bytearray(100)))
