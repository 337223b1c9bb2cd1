"""Mooncake Store backend: zero-copy batch transfers between the pool and registered DRAM slots.

Mooncake's client `setup()` blocks for a long time (~90 s here) when no master answers, so it runs in a
background thread: until it succeeds the backend reports itself unavailable and the tier reads as a miss.
Values are written with upsert (a plain put keeps an old value); a key touched in the last seconds holds a
lease, so removing a damaged value uses force.
"""

from __future__ import annotations

import ctypes
import os
import threading

from kvprefetch.tiers.remote.base import RemoteBackend, RemoteRejected, RemoteUnavailable


class MooncakeBackend(RemoteBackend):
    name = "mooncake"

    def __init__(self, master: str, metadata_server: str, local_hostname: str, protocol: str,
                 segment_bytes: int, buffer_bytes: int, connect_timeout_s: float):  # fmt: skip
        os.environ.setdefault("MC_TCP_BIND_ADDRESS", local_hostname)
        from mooncake.store import MooncakeDistributedStore

        self._store = MooncakeDistributedStore()
        self._ready = threading.Event()
        self._failed: str | None = None
        self._regions: list = []
        self._pending_regions: list[tuple[int, int]] = []
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
        return self._store

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
        if any(c < 0 for c in codes):
            raise RemoteUnavailable("mooncake: existence check failed")
        return [c == 1 for c in codes]

    def read_into(self, names: list[str], views: list[memoryview]) -> list[int]:
        client = self._client()
        got = client.batch_get_into(names, [self._address(v) for v in views], [len(v) for v in views])
        if names and all(g < 0 for g in got) and client.health_check() == 2:
            raise RemoteUnavailable("mooncake: master unreachable")
        return [g if g >= 0 else -1 for g in got]

    def write_from(self, names: list[str], views: list[memoryview]) -> None:
        client = self._client()
        codes = client.batch_upsert_from(names, [self._address(v) for v in views], [len(v) for v in views])
        if any(c < 0 for c in codes):
            if client.health_check() == 2:
                raise RemoteUnavailable("mooncake: master unreachable")
            raise RemoteRejected(f"mooncake refused the write (codes {sorted(set(codes))}; pool full?)")

    def delete(self, names: list[str]) -> None:
        client = self._client()
        for name in names:
            client.remove(name, True)

    def close(self) -> None:
        if self._ready.is_set():
            self._store.close()
