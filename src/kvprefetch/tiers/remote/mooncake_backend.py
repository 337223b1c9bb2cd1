"""Mooncake Store backend: zero-copy batch transfers between the pool and registered DRAM slots.

Mooncake's client `setup()` blocks for a long time (~90 s here) when no master answers, so it runs in a
background thread: until it succeeds the backend reports itself unavailable and the tier reads as a miss.
Values are written with upsert (a plain put keeps an old value); a key touched in the last seconds holds a
lease, so removing a damaged value uses force.

A master that cannot be reached (its process gone, or the link to it down) shows as Mooncake's RPC error codes in
a batch's results (`RPC_FAIL` -900, `RPC_TIMEOUT` -901; `health_check()` still answers 0 then). The first call that
meets one waits at most `timeout_s` (Mooncake's `MC_RPC_TIMEOUT_MS` and `MC_RPC_CONNECT_TIMEOUT_MS`, read when the
client is made; an environment that sets them wins; their default, 30 s, is how long a request waited on a link
that went down) and raises RemoteUnavailable. From then on each call raises it at once while a background probe
asks the master until it answers: every later call to an unreachable master costs ~4.3 s (its RPC pool's three
connection attempts a second apart, which no setting shortens), paid by the probe, not by requests. A master
restarted empty answers again with no objects: misses, and refused writes (-200) until the pool's memory is
mounted again. Not bounded by `timeout_s`: a transfer under way when the link goes down (Mooncake's TCP transport
has no deadline; the call returns when TCP delivers after the link is back, within the store's own 60 s limit,
and writes into the caller's memory only while the call lasts).
"""

from __future__ import annotations

import ctypes
import os
import threading
import time

from kvprefetch.tiers.remote.base import RemoteBackend, RemoteRejected, RemoteUnavailable

RPC_ERRORS = frozenset({-900, -901})  # RPC_FAIL, RPC_TIMEOUT: the master did not answer
PROBE_KEY = "kvprefetch-probe"
PROBE_PAUSE_S = 0.2


class MooncakeBackend(RemoteBackend):
    name = "mooncake"

    def __init__(self, master: str, metadata_server: str, local_hostname: str, protocol: str,
                 segment_bytes: int, buffer_bytes: int, connect_timeout_s: float,
                 timeout_s: float | None = None):  # fmt: skip
        os.environ.setdefault("MC_TCP_BIND_ADDRESS", local_hostname)
        if timeout_s is not None:
            for var in ("MC_RPC_TIMEOUT_MS", "MC_RPC_CONNECT_TIMEOUT_MS"):
                os.environ.setdefault(var, str(max(1, int(timeout_s * 1000))))
        from mooncake.store import MooncakeDistributedStore

        self._store = MooncakeDistributedStore()
        self._ready = threading.Event()
        self._failed: str | None = None
        self._regions: list = []
        self._pending_regions: list[tuple[int, int]] = []
        self._lost = threading.Event()  # set while the master is unreachable (the probe runs)
        self._closing = threading.Event()
        self._probe_lock = threading.Lock()  # held by the probe's call, so close() never closes under it
        args = (local_hostname, metadata_server, segment_bytes, buffer_bytes, protocol, "", master)
        self._thread = threading.Thread(target=self._setup, args=args, name="mooncake-setup", daemon=True)
        self._thread.start()
        self._ready.wait(connect_timeout_s)

    def _setup(self, *args) -> None:
        try:
            rc = self._store.setup(*args)
        except Exception as err:  # the binding raises on some failures and returns codes on others
            self._failed = str(err)
            return
        if rc != 0:
            self._failed = f"setup returned {rc}"
            return
        for ptr, size in self._pending_regions:
            self._store.register_buffer(ptr, size)
        self._ready.set()

    def _client(self):
        if not self._ready.is_set():
            why = self._failed or "still connecting to the master"
            raise RemoteUnavailable(f"mooncake: {why}")
        if self._lost.is_set():
            raise RemoteUnavailable("mooncake: master unreachable (reconnecting)")
        return self._store

    def _check(self, codes: list[int]) -> None:
        """Raise RemoteUnavailable, and start the probe, when a result says the master did not answer."""
        if not any(c in RPC_ERRORS for c in codes):
            return
        if not self._lost.is_set():
            self._lost.set()
            threading.Thread(target=self._probe, name="mooncake-probe", daemon=True).start()
        raise RemoteUnavailable(f"mooncake: master unreachable (codes {sorted(set(codes) & RPC_ERRORS)})")

    def _probe(self) -> None:
        while not self._closing.is_set():
            with self._probe_lock:
                if self._closing.is_set():
                    return
                codes = self._store.batch_is_exist([PROBE_KEY])
            if not any(c in RPC_ERRORS for c in codes):
                self._lost.clear()
                return
            time.sleep(PROBE_PAUSE_S)

    def register_memory(self, view: memoryview) -> None:
        anchor = (ctypes.c_char * len(view)).from_buffer(view)
        self._regions.append(anchor)  # keeps the address valid for as long as we may transfer into it
        region = (ctypes.addressof(anchor), len(view))
        if self._ready.is_set():
            self._store.register_buffer(*region)
        else:
            self._pending_regions.append(region)

    @staticmethod
    def _address(view: memoryview) -> int:
        return ctypes.addressof((ctypes.c_char * len(view)).from_buffer(view))

    def exists(self, names: list[str]) -> list[bool]:
        codes = self._client().batch_is_exist(names)
        self._check(codes)
        if any(c < 0 for c in codes):
            raise RemoteUnavailable(f"mooncake: existence check failed (codes {sorted({c for c in codes if c < 0})})")
        return [c == 1 for c in codes]

    def read_into(self, names: list[str], views: list[memoryview]) -> list[int]:
        client = self._client()
        got = client.batch_get_into(names, [self._address(v) for v in views], [len(v) for v in views])
        self._check(got)
        if names and all(g < 0 for g in got) and client.health_check() == 2:
            raise RemoteUnavailable("mooncake: master unreachable")
        return [g if g >= 0 else -1 for g in got]

    def write_from(self, names: list[str], views: list[memoryview]) -> None:
        client = self._client()
        codes = client.batch_upsert_from(names, [self._address(v) for v in views], [len(v) for v in views])
        self._check(codes)
        if any(c < 0 for c in codes):
            if client.health_check() == 2:
                raise RemoteUnavailable("mooncake: master unreachable")
            raise RemoteRejected(f"mooncake refused the write (codes {sorted(set(codes))}; pool full?)")

    def delete(self, names: list[str]) -> None:
        client = self._client()
        for name in names:
            client.remove(name, True)

    def close(self) -> None:
        self._closing.set()
        if self._ready.is_set():
            with self._probe_lock:  # a probe's call in flight ends within ~4.3 s
                self._store.close()
