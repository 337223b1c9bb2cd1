"""Redis / Valkey backend (standalone or Redis Cluster), with AUTH and TLS from the config.

The bulk path (`read_into`, `write_from`) speaks RESP itself on the socket of a connection borrowed from redis-py's
pool (`resp`): redis-py connects, authenticates, selects the database and wraps TLS; the value then moves between
the socket and its DRAM slot in one copy, where redis-py's GET costs three (issue 63; `kvprefetch remotebench`
measures both). A connection goes back to the pool only at a reply boundary: any I/O or protocol error mid-reply
disconnects it first. Over TLS the same code runs on the TLS socket, whose decryption adds its own copy.

A Redis Cluster takes the same path to the node its slot table names for each key; a key that moved (`MOVED`/`ASK`)
is read or written through redis-py's cluster client instead, which follows the redirect and refreshes the table.
Existence checks and deletes, small replies, go through redis-py.
"""

from __future__ import annotations

import contextlib
import socket
from collections.abc import Iterator

import redis
import redis.cluster
from redis._parsers.base import BaseParser

from kvprefetch.tiers.memory import copy_bytes
from kvprefetch.tiers.remote import resp
from kvprefetch.tiers.remote.base import RemoteBackend, RemoteRejected, RemoteUnavailable

_DOWN = (redis.ConnectionError, redis.TimeoutError, redis.exceptions.ClusterDownError)
_REDIRECT = (redis.exceptions.MovedError, redis.exceptions.AskError)


class RedisBackend(RemoteBackend):
    name = "redis"
    # Eight values pipelined per round trip: a node's CPU per MiB received (1 / 4 / 16 MiB values) falls from 0.45 /
    # 0.43 / 0.38 ms one per call to 0.37 / 0.27 / 0.34 on loopback, and from 0.70 / 0.57 / 0.39 to 0.38 / 0.34 /
    # 0.33 over a veth link shaped to 482 MB/s, where one connection streaming a pipeline fills the link (README:
    # the shared tier's receive path; `kvprefetch remotebench`, rows redis and redis x8).
    batch_size = 8

    def __init__(self, url: str, cluster: bool, timeout_s: float, ttl_s: int | None, password: str | None,
                 username: str | None, ssl_ca_certs: str | None):  # fmt: skip
        kwargs = {"socket_timeout": timeout_s, "socket_connect_timeout": timeout_s}
        if password is not None:
            kwargs["password"] = password
        if username is not None:
            kwargs["username"] = username
        if ssl_ca_certs is not None:
            kwargs["ssl_ca_certs"] = ssl_ca_certs
        factory = redis.cluster.RedisCluster if cluster else redis.Redis
        self.client = factory.from_url(url, **kwargs)
        self.cluster = cluster
        self.ttl_s = ttl_s

    # ---- redis-py for the small commands -----------------------------------------------------------------
    def _run(self, fill) -> list:
        with _mapped_errors():
            pipe = self.client.pipeline(transaction=False)
            fill(pipe)
            return pipe.execute()

    def exists(self, names: list[str]) -> list[bool]:
        return [bool(n) for n in self._run(lambda p: [p.exists(n) for n in names])]

    def delete(self, names: list[str]) -> None:
        self._run(lambda p: [p.delete(n) for n in names])

    # ---- the bulk path: RESP on the pooled connection's socket -------------------------------------------
    def read_into(self, names: list[str], views: list[memoryview]) -> list[int]:
        sizes: list[int] = [-1] * len(names)
        moved: list[int] = []
        with self._bulk():
            for pool, at in self._by_pool(names):
                answers = self._read_batch(pool, [names[i] for i in at], [views[i] for i in at])
                for i, got in zip(at, answers, strict=True):
                    if isinstance(got, int):
                        sizes[i] = got
                    elif isinstance(got, _REDIRECT) and self.cluster:
                        moved.append(i)
                    else:
                        raise got
            for i in moved:
                sizes[i] = self._read_redirected(names[i], views[i])
        return sizes

    def write_from(self, names: list[str], views: list[memoryview]) -> None:
        with self._bulk():
            for pool, at in self._by_pool(names):
                errors = self._write_batch(pool, [names[i] for i in at], [views[i] for i in at])
                for i, err in zip(at, errors, strict=True):
                    if isinstance(err, _REDIRECT) and self.cluster:
                        self.client.set(names[i], bytes(views[i]), ex=self.ttl_s)
                    elif err is not None:
                        raise err

    @contextlib.contextmanager
    def _bulk(self) -> Iterator[None]:
        """The backend's error mapping; on a cluster, a node that could not be reached may have failed over, so the
        slot table is reloaded for the next attempt (redis-py does so inside its own commands, which the bulk path
        bypasses; the tier's circuit breaker spaces the attempts)."""
        try:
            with _mapped_errors():
                yield
        except RemoteUnavailable:
            if self.cluster:
                with contextlib.suppress(redis.RedisError, OSError):
                    self.client.nodes_manager.initialize()
            raise

    def _by_pool(self, names: list[str]) -> list[tuple[redis.ConnectionPool, list[int]]]:
        """The connection pool each name's server is reached through, with the names' indices (one group on a
        standalone server; per node on a cluster, by the client's slot table)."""
        if not self.cluster:
            return [(self.client.connection_pool, list(range(len(names))))]
        groups: dict[int, tuple[redis.ConnectionPool, list[int]]] = {}
        for i, name in enumerate(names):
            node = self.client.get_node_from_key(name)
            if node is None or node.redis_connection is None:
                raise redis.exceptions.ClusterDownError(f"no node serves {name}")
            pool = node.redis_connection.connection_pool
            groups.setdefault(id(pool), (pool, []))[1].append(i)
        return list(groups.values())

    def _read_batch(self, pool, names: list[str], views: list[memoryview]) -> list[int | Exception]:
        """Pipelined GETs on one connection; per name its size, -1, or the error the server answered with."""
        with _borrowed(pool) as sock:
            sock.sendall(resp.get_request([n.encode() for n in names]))
            reader = resp.ReplyReader(sock)
            got = [_answer(lambda v=v: reader.bulk_into(v)) for v in views]
            _at_boundary(reader)
        return got

    def _write_batch(self, pool, names: list[str], views: list[memoryview]) -> list[Exception | None]:
        """Pipelined SETs on one connection, each value sent from its view; per name None or the server's error."""
        parts: list = []
        for name, view in zip(names, views, strict=True):
            head, tail = resp.set_request(name.encode(), len(view), self.ttl_s)
            parts += [head, view, tail]
        with _borrowed(pool) as sock:
            resp.send_parts(sock, parts)
            reader = resp.ReplyReader(sock)
            got = [_answer(reader.ok) for _ in names]
            _at_boundary(reader)
        return got

    def _read_redirected(self, name: str, view: memoryview) -> int:
        """A key the slot table placed wrong: redis-py follows the redirect (and refreshes the table)."""
        value = self.client.get(name)
        if value is None:
            return -1
        n = min(len(value), len(view))
        copy_bytes(view[:n], memoryview(value)[:n])
        return len(value)

    def close(self) -> None:
        self.client.close()


def _answer(read) -> int | Exception | None:
    """One reply: its value, or the server's error as redis-py's exception for it (the connection stays usable)."""
    try:
        return read()
    except resp.ServerError as err:
        return BaseParser.parse_error(err.line)


def _at_boundary(reader: resp.ReplyReader) -> None:
    if reader.buffered:
        raise resp.ProtocolError(f"{reader.buffered} bytes past the last reply")


@contextlib.contextmanager
def _borrowed(pool) -> Iterator[socket.socket]:
    """A connected, authenticated socket from redis-py's pool; disconnected before it goes back if anything
    failed while it was in use (it may be mid-reply, and a later command would read this one's leftovers)."""
    conn = pool.get_connection()
    try:
        sock = conn._sock
        if sock is None:
            raise redis.ConnectionError("redis-py gave a connection without a socket")
        yield sock
    except BaseException:
        conn.disconnect()
        raise
    finally:
        pool.release(conn)


@contextlib.contextmanager
def _mapped_errors() -> Iterator[None]:
    """The backend contract's two failures: the server cannot be used now (down, timing out, out of step, refusing
    our credentials) or it refused this command (e.g. OOM under noeviction)."""
    try:
        yield
    except _DOWN as err:
        raise RemoteUnavailable(f"redis: {err}") from err
    except redis.AuthenticationError as err:
        raise RemoteUnavailable(f"redis refused our credentials: {err}") from err
    except (OSError, resp.ProtocolError) as err:  # socket timeouts and resets on the bulk path
        raise RemoteUnavailable(f"redis: {err!r}") from err
    except redis.ResponseError as err:
        raise RemoteRejected(f"redis refused the command: {err}") from err
    except redis.RedisError as err:  # e.g. InvalidResponse: a reply redis-py could not parse
        raise RemoteUnavailable(f"redis: {err!r}") from err
