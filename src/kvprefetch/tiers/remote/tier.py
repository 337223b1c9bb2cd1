"""The remote tier: names, verification and a circuit breaker around a backend.

Every value read back is checked like a disk file (magic, header checksum, key, payload checksum), so a
value another tenant, model or version wrote, or one the store evicted or truncated mid-way, reads as a miss.
Names are `prefix + hex(key)`: keys are 32-byte digests already namespaced by model, layout and tenant, and
hex leaves nothing that could escape into another namespace or a store command. While the backend is down,
the tier answers "miss" at once for `retry_after_s` instead of stalling each request on a timeout.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time

from kvprefetch.config import RemoteConfig
from kvprefetch.episodes import EpisodeLog
from kvprefetch.tiers.chunk_format import CorruptChunk, verify_image
from kvprefetch.tiers.disk import ChunkMissing
from kvprefetch.tiers.errors import ErrorKind, ErrorTally
from kvprefetch.tiers.remote.base import RemoteBackend, RemoteRejected, RemoteUnavailable

log = logging.getLogger(__name__)


def open_backend(cfg: RemoteConfig) -> RemoteBackend:
    """Build the configured backend (imports its client library only when chosen)."""
    if cfg.backend == "redis":
        from kvprefetch.tiers.remote.redis_backend import RedisBackend

        r = cfg.redis
        return RedisBackend(r.url, r.cluster, cfg.timeout_s, r.ttl_s, r.password, r.username,
                            str(r.ssl_ca_certs) if r.ssl_ca_certs else None)  # fmt: skip
    from kvprefetch.tiers.remote.mooncake_backend import MooncakeBackend

    m = cfg.mooncake
    return MooncakeBackend(m.master, m.metadata_server, m.local_hostname, m.protocol, int(m.segment_bytes),
                           int(m.buffer_bytes), m.connect_timeout_s, cfg.timeout_s)  # fmt: skip


class RemoteTier:
    """A shared tier below disk, reached through one backend, never trusted."""

    def __init__(
        self, backend: RemoteBackend, key_prefix: str, retry_after_s: float = 5.0, errors: ErrorTally | None = None
    ):
        """`errors`: where a failed attempt to reach the backend is counted (once per attempt, not per chunk its
        outage turns into a miss: while marked down nothing is attempted, and the store counts nothing)."""
        self.backend = backend
        self.errors = errors if errors is not None else ErrorTally()
        self._episodes = EpisodeLog(log)
        self.prefix = key_prefix
        self.retry_after_s = retry_after_s
        self._down_until = 0.0
        self._lock = threading.Lock()
        self.counters = {"unavailable": 0, "corrupt": 0, "reads": 0, "writes": 0, "write_rejected": 0, "reconnects": 0}

    def name_of(self, key: bytes) -> str:
        return self.prefix + key.hex()

    # ---- circuit breaker ---------------------------------------------------------------------------------
    @property
    def available(self) -> bool:
        return time.monotonic() >= self._down_until

    def _call(self, fn, *args):
        if not self.available:
            raise RemoteUnavailable(f"{self.backend.name}: marked down, retrying in "
                                    f"{self._down_until - time.monotonic():.1f} s")  # fmt: skip
        try:
            result = fn(*args)
        except RemoteUnavailable as err:
            with self._lock:
                self._down_until = time.monotonic() + self.retry_after_s
                self.counters["unavailable"] += 1
            self.errors.add("remote", ErrorKind.UNAVAILABLE)
            # One line per outage: its retries fail every retry_after_s, within one episode of failures.
            self._episodes.warn("unavailable", "kvprefetch: remote tier %s unavailable (%s); serving misses, retrying "
                                "every %.0f s", self.backend.name, err, self.retry_after_s)  # fmt: skip
            raise
        if self._down_until:
            with self._lock:
                if self._down_until:
                    self._down_until = 0.0
                    self.counters["reconnects"] += 1
                    log.warning("kvprefetch: remote tier %s is back", self.backend.name)
        return result

    # ---- operations --------------------------------------------------------------------------------------
    def contains_many(self, keys: list[bytes]) -> list[bool]:
        """Which keys the remote holds; all False while it is unreachable."""
        if not keys:
            return []
        try:
            return self._call(self.backend.exists, [self.name_of(k) for k in keys])
        except RemoteUnavailable:
            return [False] * len(keys)

    def read_into(self, key: bytes, image: memoryview) -> int:
        """Read and verify key's image; return payload size. Raises ChunkMissing, CorruptChunk, RemoteUnavailable."""
        (result,) = self.read_many([key], [image])
        if isinstance(result, Exception):
            raise result
        return result

    def read_many(self, keys: list[bytes], images: list[memoryview]) -> list[int | Exception]:
        """One batched transfer; per key the verified payload size, or the ChunkMissing/CorruptChunk it failed
        with. Raises RemoteUnavailable (for the whole batch) when the backend cannot be reached."""
        names = [self.name_of(k) for k in keys]
        sizes = self._call(self.backend.read_into, names, images)
        results: list[int | Exception] = []
        bad: list[str] = []
        for key, name, image, size in zip(keys, names, images, sizes, strict=True):
            if size < 0:
                results.append(ChunkMissing(key.hex()))
                continue
            try:
                if size > len(image):
                    raise CorruptChunk(f"remote value of {size} B is larger than a chunk image")
                results.append(verify_image(image[:size], key).payload_nbytes)
                self.counters["reads"] += 1
            except CorruptChunk as err:
                self.counters["corrupt"] += 1
                self._episodes.warn("corrupt", "kvprefetch: remote value %s failed verification (%s); dropping it"
                                    " (one line per episode)", name, err)  # fmt: skip
                bad.append(name)
                results.append(err)
        if bad:
            with contextlib.suppress(RemoteUnavailable):
                self._call(self.backend.delete, bad)
        return results

    def write(self, key: bytes, image: memoryview) -> None:
        """Share one chunk image. Raises RemoteUnavailable (down) or RemoteRejected (e.g. full)."""
        try:
            self._call(self.backend.write_from, [self.name_of(key)], [image])
        except RemoteRejected:
            self.counters["write_rejected"] += 1
            raise
        self.counters["writes"] += 1

    def stats(self) -> dict:
        return {"backend": self.backend.name, "available": self.available, **self.counters}

    def close(self) -> None:
        self.backend.close()
