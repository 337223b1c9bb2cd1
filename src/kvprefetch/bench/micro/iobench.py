"""`kvprefetch iobench`: the storage-side benchmark, after the whitepaper's R1 cold-read test.

In one run, on one directory, with the page cache out of the way (O_DIRECT): fio's sequential-read ceiling
(best of queue depths and buffer types, huge pages included), our disk tier reading chunks one at a time,
the same with parallel reads, the demand path into caller buffers, and the write-back rate. Each of our
rows is the median of `repeats` passes, and the headline figures are ratios.
"""

from __future__ import annotations

import contextlib
import os
import statistics
import subprocess
import tempfile
import time
import uuid
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np

from kvprefetch.bench.micro.fio_reference import FioReference, FioRun, fio_available
from kvprefetch.bench.micro.hugepages import reserved_huge_pages
from kvprefetch.config import StoreConfig
from kvprefetch.store import TieredStore
from kvprefetch.tiers.chunk_format import image_bytes
from kvprefetch.tiers.dram import hugetlbfs_mount
from kvprefetch.tiers.inflight import InflightBytes


@dataclass
class IOBenchResult:
    chunk_bytes: int
    total_bytes: int
    threads: int
    fio_read_gbps: float | None
    serial_read_gbps: float
    parallel_read_gbps: float
    parallel_read_gbps_unstaged: float | None
    read_inflight_bytes: int
    parallel_read_gbps_4k_pages: float | None
    get_into_gbps: float
    raw_pool_read_gbps: float
    write_gbps: float
    dram_backing: str
    fio_runs: list[FioRun] = field(default_factory=list)
    inflight_sweep: dict[int, float] = field(default_factory=dict)

    @property
    def parallel_over_fio(self) -> float | None:
        return self.parallel_read_gbps / self.fio_read_gbps if self.fio_read_gbps else None

    @property
    def parallel_over_serial(self) -> float:
        return self.parallel_read_gbps / self.serial_read_gbps

    def to_json(self) -> dict:
        out = asdict(self)
        out["fio_runs"] = [asdict(r) for r in self.fio_runs]
        out["parallel_over_fio"] = self.parallel_over_fio
        out["parallel_over_serial"] = self.parallel_over_serial
        return out


Progress = Callable[[str, float], None]


def run_iobench(
    directory: Path,
    total_bytes: int = 1 << 30,
    chunk_bytes: int = 4 << 20,
    threads: int = 4,
    repeats: int = 5,
    use_fio: bool = True,
    progress: Progress = lambda label, fraction: None,
) -> IOBenchResult:
    """Measure everything on `directory` (its device is what is measured).

    fio first sweeps queue depths and buffer types; then its best job and our parallel read run
    alternately `repeats` times, and both figures are medians of those interleaved runs, so a noisy
    shared disk moves both alike.
    """
    directory.mkdir(parents=True, exist_ok=True)
    n_chunks = max(1, total_bytes // chunk_bytes)
    total_bytes = n_chunks * chunk_bytes
    keys = [uuid.uuid4().bytes * 2 for _ in range(n_chunks)]
    data_dir = Path(tempfile.mkdtemp(prefix="iobench-", dir=directory))
    pool_bytes = 64 * image_bytes(chunk_bytes) + (8 << 20)
    fio: FioReference | None = None
    fio_runs: list[FioRun] = []
    fio_medians: list[float] = []
    parallel_runs: list[float] = []
    unstaged_runs: list[float] = []
    try:
        staging_bytes = threads * (image_bytes(chunk_bytes) + (2 << 20))
        with huge_page_pool(pool_bytes + 64 * chunk_bytes + staging_bytes) as huge_dir:
            backing = "hugetlbfs" if huge_dir else "shm"
            progress("write-back", 0.0)
            store = _store(data_dir, chunk_bytes, threads, pool_bytes, backing)
            try:
                write_gbps = _write_all(store, keys, chunk_bytes)
                if use_fio and fio_available():
                    progress("fio: laying out its file, sweeping depths and buffers", 0.15)
                    fio = FioReference(directory, total_bytes, chunk_bytes)
                    memories = ["malloc"] + ([f"mmaphuge:{huge_dir}/fio-buffer", "shmhuge"] if huge_dir else [])
                    fio_runs = fio.sweep((1, 4, 16), memories)
                    best = max(fio_runs, key=lambda r: r.gbps)
                progress("serial reads", 0.45)
                serial = _median(repeats, lambda: _read_all(store, keys, parallel=False))
                progress("parallel reads: sweeping reads in flight", 0.5)
                sweep = _sweep_inflight(store, keys, threads)
                inflight = max(sweep, key=sweep.get)
                _set_inflight(store, inflight)
                for i in range(repeats):
                    progress(f"parallel reads vs fio, round {i + 1}/{repeats}", 0.6 + 0.25 * i / repeats)
                    parallel_runs.append(_read_all(store, keys, parallel=True))
                    if fio is not None:
                        fio_medians.append(fio.read(best.iodepth, best.iomem).gbps)
                    if store.disk.staging is not None:
                        with _unstaged(store):
                            unstaged_runs.append(_read_all(store, keys, parallel=True))
                progress("demand loads into caller memory", 0.8)
                get_into = _median(repeats, lambda: _get_into_all(store, keys, chunk_bytes))
                progress("raw preadv into the pool's memory", 0.85)
                raw_pool = _median(repeats, lambda: _raw_read_all(store, keys))
            finally:
                _close(store)
                if huge_dir:  # fio leaves its huge-page buffer file behind
                    (huge_dir / "fio-buffer").unlink(missing_ok=True)
            parallel_4k = None
            if huge_dir:
                progress("parallel reads, 4 KiB pages", 0.9)
                store = _store(data_dir, chunk_bytes, threads, pool_bytes, "shm")
                try:
                    parallel_4k = _median(repeats, lambda: _read_all(store, keys, parallel=True))
                finally:
                    _close(store)
        progress("done", 1.0)
    finally:
        if fio is not None:
            fio.close()
        subprocess.run(["rm", "-rf", str(data_dir)], check=False)
    return IOBenchResult(
        chunk_bytes=chunk_bytes,
        total_bytes=total_bytes,
        threads=threads,
        fio_read_gbps=statistics.median(fio_medians) if fio_medians else None,
        serial_read_gbps=serial,
        parallel_read_gbps=statistics.median(parallel_runs),
        parallel_read_gbps_unstaged=statistics.median(unstaged_runs) if unstaged_runs else None,
        parallel_read_gbps_4k_pages=parallel_4k,
        get_into_gbps=get_into,
        raw_pool_read_gbps=raw_pool,
        write_gbps=write_gbps,
        dram_backing=backing,
        fio_runs=fio_runs,
        read_inflight_bytes=inflight,
        inflight_sweep=sweep,
    )


def _store(data_dir: Path, chunk_bytes: int, threads: int, pool_bytes: int, backing: str) -> TieredStore:
    config = StoreConfig.load(
        dram={"capacity_bytes": pool_bytes, "pool_name": f"iobench-{uuid.uuid4().hex[:8]}", "backing": backing},
        disk={"path": str(data_dir), "capacity_bytes": 1 << 50},
        io={"threads": threads},
    )
    return TieredStore(config, chunk_bytes=chunk_bytes)


def _close(store: TieredStore) -> None:
    store.close()
    store.dram.destroy()


def _sweep_inflight(store: TieredStore, keys: list[bytes], threads: int) -> dict[int, float]:
    """Parallel read rate per cap on bytes in flight (1, 2, ... `threads` chunk reads), as fio sweeps depths."""
    caps = sorted({store.image_bytes * n for n in (1, 2, 4, threads) if n <= threads})
    rates: dict[int, float] = {}
    for cap in caps:
        _set_inflight(store, cap)
        rates[cap] = _read_all(store, keys, parallel=True)
    return rates


def _set_inflight(store: TieredStore, nbytes: int) -> None:
    assert store.disk is not None
    store.disk.read_gate = InflightBytes(nbytes)


@contextlib.contextmanager
def _unstaged(store: TieredStore):
    """Reads straight into the DRAM slots, for the side-by-side row (see tiers/staging.py)."""
    assert store.disk is not None
    staging, store.disk.staging = store.disk.staging, None
    try:
        yield
    finally:
        store.disk.staging = staging


def _median(repeats: int, measure: Callable[[], float]) -> float:
    return statistics.median(measure() for _ in range(repeats))


def _write_all(store: TieredStore, keys: list[bytes], chunk_bytes: int, batch: int = 16) -> float:
    """Write-back rate: chunks put through DRAM and written to disk (fsync'd), end to end."""
    payload = np.random.default_rng(0).integers(0, 256, chunk_bytes, dtype=np.uint8)
    t0 = time.perf_counter()
    for i in range(0, len(keys), batch):
        store.put(keys[i : i + batch], [payload] * len(keys[i : i + batch])).result()
    return len(keys) * chunk_bytes / (time.perf_counter() - t0) / 1e9


def _evict_all(store: TieredStore, keys: list[bytes]) -> None:
    for key in keys:
        store.dram.discard(key)


def _read_all(store: TieredStore, keys: list[bytes], parallel: bool) -> float:
    """Cold reads from disk into the DRAM pool (promotion), one at a time or all in flight."""
    _evict_all(store, keys)
    t0 = time.perf_counter()
    if parallel:
        handle = store.prefetch(keys)
        handle.wait()
        ok = all(handle.results().values())
    else:
        ok = all(_prefetch_one(store, k) for k in keys)
    elapsed = time.perf_counter() - t0
    if not ok:
        raise RuntimeError("a benchmark read failed")
    return len(keys) * store.chunk_bytes / elapsed / 1e9


def _raw_read_all(store: TieredStore, keys: list[bytes]) -> float:
    """Bare O_DIRECT preadv of the same files into the pool's slots, no bookkeeping or checks: separates our
    software overhead from the cost of DMA into a pool-sized memory footprint (fio reuses one small buffer)."""
    assert store.disk is not None
    n_slots = store.dram.geometry.n_slots
    t0 = time.perf_counter()
    for i, key in enumerate(keys):
        fd = os.open(store.disk.path_of(key), os.O_RDONLY | (os.O_DIRECT if store.disk.direct_io else 0))
        try:
            os.preadv(fd, [store.dram.image(i % n_slots)[: store.image_bytes]], 0)
        finally:
            os.close(fd)
    return len(keys) * store.chunk_bytes / (time.perf_counter() - t0) / 1e9


def _prefetch_one(store: TieredStore, key: bytes) -> bool:
    handle = store.prefetch([key])
    handle.wait()
    return handle.results()[key]


def _get_into_all(store: TieredStore, keys: list[bytes], chunk_bytes: int, window: int = 16) -> float:
    """The demand path: disk -> DRAM -> caller buffers, `window` chunks per call, buffers reused."""
    buffers = [np.empty(chunk_bytes, np.uint8) for _ in range(window)]
    _evict_all(store, keys)
    t0 = time.perf_counter()
    for i in range(0, len(keys), window):
        batch = keys[i : i + window]
        if store.get_into(batch, buffers[: len(batch)]) != len(batch):
            raise RuntimeError("a benchmark load failed")
    return len(keys) * chunk_bytes / (time.perf_counter() - t0) / 1e9


@contextlib.contextmanager
def huge_page_pool(nbytes: int):
    """Yield a hugetlbfs directory with room for nbytes (reserved and mounted temporarily if root), or None."""
    with reserved_huge_pages(nbytes + (8 << 20)) as reserved:
        if not reserved:
            yield None
            return
        mount = hugetlbfs_mount()
        if mount is not None:
            yield mount
            return
        mnt = Path(tempfile.mkdtemp(prefix="kvprefetch-huge-"))
        ok = os.geteuid() == 0 and subprocess.run(["mount", "-t", "hugetlbfs", "none", str(mnt)]).returncode == 0
        try:
            yield mnt if ok else None
        finally:
            if ok:  # lazy: a pool mapping may outlive its store until it is garbage-collected
                subprocess.run(["umount", "-l", str(mnt)], check=False)
            with contextlib.suppress(OSError):
                mnt.rmdir()
