"""`kvprefetch remotebench`: the remote tier's read bandwidth next to the raw client doing the same transfers.

Per backend, in one run: node A writes N chunks through the store (write-through); node B (its own DRAM
pool, no disk tier) then reads them (1) with the backend's own client in the most direct form it offers
(Redis: one pipelined GET per batch into reused buffers; Mooncake: `batch_get_into` into a registered
buffer) and (2) through kvprefetch (`prefetch` into the DRAM pool, then `get_into` caller buffers). The two
alternate for `repeats` rounds; medians and our/raw ratio are reported: our overhead on top of the backend.
"""

from __future__ import annotations

import contextlib
import ctypes
import statistics
import tempfile
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

from kvprefetch.config import StoreConfig
from kvprefetch.store import TieredStore
from kvprefetch.testbed.local_servers import MooncakeMaster, RedisServer


@dataclass
class RemoteBenchRow:
    backend: str
    chunk_bytes: int
    chunks: int
    raw_read_gbps: float
    prefetch_read_gbps: float
    get_into_gbps: float
    write_gbps: float

    @property
    def prefetch_over_raw(self) -> float:
        return self.prefetch_read_gbps / self.raw_read_gbps

    @property
    def get_into_over_raw(self) -> float:
        return self.get_into_gbps / self.raw_read_gbps

    def to_json(self) -> dict:
        return asdict(self) | {"prefetch_over_raw": self.prefetch_over_raw, "get_into_over_raw": self.get_into_over_raw}


@contextlib.contextmanager
def local_remote(backend: str, workdir: Path) -> Iterator[dict]:
    """Start a throwaway server for the backend on loopback; yield the store config's `remote` section."""
    if backend == "redis":
        server = RedisServer(workdir)
        section = {"backend": "redis", "redis": {"url": server.url}}
    else:
        server = MooncakeMaster(workdir)
        section = {"backend": "mooncake", "mooncake": {"master": server.master, "segment_bytes": 1 << 30,
                   "metadata_server": server.metadata_server, "connect_timeout_s": 30}}  # fmt: skip
    try:
        yield section | {"key_prefix": f"bench{uuid.uuid4().hex[:6]}:", "timeout_s": 10.0}
    finally:
        server.kill()


def _node(remote: dict, chunk_bytes: int, chunks: int, threads: int) -> TieredStore:
    pool = f"rbench-{uuid.uuid4().hex[:8]}"
    cfg = StoreConfig.load(tiers=["dram", "remote"], remote=remote, io={"threads": threads},
                           dram={"capacity_bytes": (chunks + 8) * (chunk_bytes + 8192), "pool_name": pool,
                                 "backing": "shm"})  # fmt: skip
    return TieredStore(cfg, chunk_bytes=chunk_bytes)


def run_remotebench(
    backend: str,
    remote: dict,
    chunk_bytes: int = 1 << 20,
    chunks: int = 256,
    threads: int = 4,
    repeats: int = 3,
    progress: Callable[[str], None] = lambda label: None,
) -> RemoteBenchRow:
    keys = [uuid.uuid4().bytes * 2 for _ in range(chunks)]
    payload = np.random.default_rng(0).integers(0, 256, chunk_bytes, dtype=np.uint8)
    writer, reader = _node(remote, chunk_bytes, chunks, threads), _node(remote, chunk_bytes, chunks, threads)
    try:
        progress(f"{backend}: writing {chunks} chunks")
        t0 = time.perf_counter()
        for i in range(0, chunks, 32):
            writer.put(keys[i : i + 32], [payload] * len(keys[i : i + 32])).result()
        write_gbps = chunks * chunk_bytes / (time.perf_counter() - t0) / 1e9
        if writer.stats()["store"]["remote_writes"] != chunks:
            raise RuntimeError(f"{backend}: only {writer.stats()['store']['remote_writes']}/{chunks} writes landed")
        raw_read = _raw_reader(backend, reader, keys)
        raw, ours, demand = [], [], []
        buffers = [np.empty(chunk_bytes, np.uint8) for _ in range(32)]
        for r in range(repeats):
            progress(f"{backend}: round {r + 1}/{repeats}")
            raw.append(_timed(chunks * chunk_bytes, raw_read))
            _evict(reader, keys)
            ours.append(_timed(chunks * chunk_bytes, lambda: _prefetch_all(reader, keys)))
            _evict(reader, keys)
            demand.append(_timed(chunks * chunk_bytes, lambda: _get_into_all(reader, keys, buffers)))
        return RemoteBenchRow(backend, chunk_bytes, chunks, statistics.median(raw), statistics.median(ours),
                              statistics.median(demand), write_gbps)  # fmt: skip
    finally:
        for node in (writer, reader):
            node.close()
            node.dram.destroy()


def _timed(nbytes: int, fn: Callable[[], None]) -> float:
    t0 = time.perf_counter()
    fn()
    return nbytes / (time.perf_counter() - t0) / 1e9


def _evict(store: TieredStore, keys: list[bytes]) -> None:
    for key in keys:
        store.dram.discard(key)


def _prefetch_all(store: TieredStore, keys: list[bytes]) -> None:
    handle = store.prefetch(keys)
    handle.wait()
    if not all(handle.results().values()):
        raise RuntimeError("a remote prefetch failed")


def _get_into_all(store: TieredStore, keys: list[bytes], buffers: list[np.ndarray]) -> None:
    for i in range(0, len(keys), len(buffers)):
        batch = keys[i : i + len(buffers)]
        if store.get_into(batch, buffers[: len(batch)]) != len(batch):
            raise RuntimeError("a remote load failed")


def _raw_reader(backend: str, store: TieredStore, keys: list[bytes]) -> Callable[[], None]:
    """The backend's own client reading the same values, the most direct way it offers, no checks."""
    names = [store.remote.name_of(k) for k in keys]
    size = store.image_bytes
    client = store.remote.backend
    if backend == "redis":
        buffers = [memoryview(bytearray(size)) for _ in range(32)]

        def read() -> None:
            for i in range(0, len(names), 32):
                values = client.client.pipeline(transaction=False)
                for name in names[i : i + 32]:
                    values.get(name)
                for value, buf in zip(values.execute(), buffers, strict=False):
                    buf[: len(value)] = value

        return read
    region = np.empty(32 * size, np.uint8)
    anchor = (ctypes.c_char * region.nbytes).from_buffer(region)
    base = ctypes.addressof(anchor)
    raw = client._client()
    raw.register_buffer(base, region.nbytes)

    def read_mooncake() -> None:
        _ = anchor  # keep the registered region alive
        for i in range(0, len(names), 32):
            batch = names[i : i + 32]
            got = raw.batch_get_into(batch, [base + j * size for j in range(len(batch))], [size] * len(batch))
            if min(got) < 0:
                raise RuntimeError("raw mooncake read failed")

    return read_mooncake


def run_all(backends: list[str], chunk_bytes: int, chunks: int, threads: int, repeats: int,
            progress: Callable[[str], None]) -> list[RemoteBenchRow]:  # fmt: skip
    rows = []
    with tempfile.TemporaryDirectory(prefix="kvprefetch-remotebench-") as tmp:
        for backend in backends:
            with local_remote(backend, Path(tmp)) as remote:
                rows.append(run_remotebench(backend, remote, chunk_bytes, chunks, threads, repeats, progress))
    return rows
