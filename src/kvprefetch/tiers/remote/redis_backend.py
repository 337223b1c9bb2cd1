"""Redis / Valkey backend (standalone or Redis Cluster), pipelined, with AUTH and TLS from the config."""

from __future__ import annotations

import redis
import redis.cluster

from kvprefetch.tiers.memory import copy_bytes
from kvprefetch.tiers.remote.base import RemoteBackend, RemoteRejected, RemoteUnavailable

_DOWN = (redis.ConnectionError, redis.TimeoutError, redis.exceptions.ClusterDownError)


class RedisBackend(RemoteBackend):
    name = "redis"
    batch_size = 1  # parallel single GETs on the I/O threads beat one pipeline here (remotebench)

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
        self.ttl_s = ttl_s

    def _run(self, fill) -> list:
        try:
            pipe = self.client.pipeline(transaction=False)
            fill(pipe)
            return pipe.execute()
        except _DOWN as err:
            raise RemoteUnavailable(f"redis: {err}") from err
        except redis.AuthenticationError as err:
            raise RemoteUnavailable(f"redis refused our credentials: {err}") from err
        except redis.ResponseError as err:  # e.g. OOM with a noeviction policy
            raise RemoteRejected(f"redis refused the command: {err}") from err

    def exists(self, names: list[str]) -> list[bool]:
        return [bool(n) for n in self._run(lambda p: [p.exists(n) for n in names])]

    def read_into(self, names: list[str], views: list[memoryview]) -> list[int]:
        values = self._run(lambda p: [p.get(n) for n in names])
        sizes = []
        for value, view in zip(values, views, strict=True):
            if value is None:
                sizes.append(-1)
                continue
            n = min(len(value), len(view))
            copy_bytes(view[:n], memoryview(value)[:n])  # without the GIL, as the store's copies
            sizes.append(len(value))
        return sizes

    def write_from(self, names: list[str], views: list[memoryview]) -> None:
        self._run(lambda p: [p.set(n, bytes(v), ex=self.ttl_s) for n, v in zip(names, views, strict=True)])

    def delete(self, names: list[str]) -> None:
        self._run(lambda p: [p.delete(n) for n in names])

    def close(self) -> None:
        self.client.close()
