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
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

from kvprefetch.bench.micro.fio_reference import FioReference, FioRun, fio_available
from kvprefetch.bench.micro.hugepages import reserved_huge_pages
from kvprefetch.config import StoreConfig
from kvprefetch.store import TieredStore
from kvprefetch.tiers.chunk_format import image_bytes
from kvprefetch.tiers.dram import hugetlbfs_mount
from kvprefetch.tiers.inflight import InflightBytes


@dataclass(frozen=True)
class RunShape:
    """What was read and written: the chunks' size, all of them together, and the reads in flight asked for."""

    chunk_bytes: int
    total_bytes: int
    threads: int


@dataclass(frozen=True)
class FioFigures:
    """fio's ceiling: the median of its best job's rounds (GB/s), and every job of the sweep that picked it."""

    read_gbps: float
    runs: list[FioRun]


@dataclass(frozen=True)
class InflightSweep:
    """Our parallel read's rate (GB/s) per cap on bytes in flight, and the cap the rest of the run read at."""

    rates: dict[int, float]
    best_bytes: int


@dataclass
class IOBenchResult:
    """Every figure of a run (GB/s unless named otherwise); `to_json` is the flat record `--json` writes."""

    shape: RunShape
    fio: FioFigures | None  # None: no fio on this machine, or --no-fio
    inflight: InflightSweep
    serial_read_gbps: float
    parallel_read_gbps: float
    parallel_read_gbps_unstaged: float | None
    parallel_read_gbps_4k_pages: float | None
    get_into_gbps: float
    raw_pool_read_gbps: float
    write_gbps: float
    dram_backing: str

    @property
    def fio_read_gbps(self) -> float | None:
        return self.fio.read_gbps if self.fio else None

    @property
    def parallel_over_fio(self) -> float | None:
        return self.parallel_read_gbps / self.fio_read_gbps if self.fio_read_gbps else None

    @property
    def parallel_over_serial(self) -> float:
        return self.parallel_read_gbps / self.serial_read_gbps

    def to_json(self) -> dict:
        """Flat, its keys in the order they had before the groups (the documented JSON)."""
        shape, inflight = self.shape, self.inflight
        return {
            "chunk_bytes": shape.chunk_bytes,
            "total_bytes": shape.total_bytes,
            "threads": shape.threads,
            "fio_read_gbps": self.fio_read_gbps,
            "serial_read_gbps": self.serial_read_gbps,
            "parallel_read_gbps": self.parallel_read_gbps,
            "parallel_read_gbps_unstaged": self.parallel_read_gbps_unstaged,
            "read_inflight_bytes": inflight.best_bytes,
            "parallel_read_gbps_4k_pages": self.parallel_read_gbps_4k_pages,
            "get_into_gbps": self.get_into_gbps,
            "raw_pool_read_gbps": self.raw_pool_read_gbps,
            "write_gbps": self.write_gbps,
            "dram_backing": self.dram_backing,
            "fio_runs": [asdict(r) for r in self.fio.runs] if self.fio else [],
            "inflight_sweep": dict(inflight.rates),
            "parallel_over_fio": self.parallel_over_fio,
            "parallel_over_serial": self.parallel_over_serial,
        }


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
    plan = _plan(directory, total_bytes, chunk_bytes, threads, repeats)
    with contextlib.ExitStack() as cleanup:  # unwinds last to first: fio's file (once laid out), then our chunks
        cleanup.callback(subprocess.run, ["rm", "-rf", str(plan.data_dir)], check=False)
        with huge_page_pool(plan.huge_page_bytes) as huge_dir:
            pool = _on_the_pool(plan, huge_dir, use_fio, progress, cleanup)
            parallel_4k = _parallel_on_4k_pages(plan, huge_dir, progress)
        progress("done", 1.0)
    return _result(plan, pool, parallel_4k)


@dataclass(frozen=True)
class _Plan:
    """What every phase shares: the chunks (their keys and size), where their files go, and the run's shape."""

    directory: Path
    data_dir: Path
    keys: list[bytes]
    chunk_bytes: int
    threads: int
    repeats: int

    @property
    def total_bytes(self) -> int:
        return len(self.keys) * self.chunk_bytes

    @property
    def pool_bytes(self) -> int:
        """The DRAM pool: 64 chunk images and 8 MiB, whatever the run's size."""
        return 64 * image_bytes(self.chunk_bytes) + (8 << 20)

    @property
    def huge_page_bytes(self) -> int:
        """What the huge pages must hold: the pool, 64 chunks besides (fio's buffers) and the threads' staging."""
        staging = self.threads * (image_bytes(self.chunk_bytes) + (2 << 20))
        return self.pool_bytes + 64 * self.chunk_bytes + staging


def _plan(directory: Path, total_bytes: int, chunk_bytes: int, threads: int, repeats: int) -> _Plan:
    """`total_bytes` rounded down to whole chunks (one at least), each under a fresh key."""
    n_chunks = max(1, total_bytes // chunk_bytes)
    keys = [uuid.uuid4().bytes * 2 for _ in range(n_chunks)]
    data_dir = Path(tempfile.mkdtemp(prefix="iobench-", dir=directory))
    return _Plan(directory, data_dir, keys, chunk_bytes, threads, repeats)


@dataclass(frozen=True)
class _FioCeiling:
    """fio's file on the device, every job of its sweep, and the best one (the one the rounds repeat)."""

    reference: FioReference
    runs: list[FioRun]
    best: FioRun


@dataclass(frozen=True)
class _Rounds:
    """The interleaved rounds' figures (GB/s), one per round each: ours, fio's best job, ours without staging."""

    parallel: list[float]
    fio: list[float]
    unstaged: list[float]


@dataclass(frozen=True)
class _PoolRun:
    """Everything measured on the first pool (on huge pages where they could be had)."""

    backing: str
    write_gbps: float
    fio: _FioCeiling | None
    serial_gbps: float
    inflight_sweep: dict[int, float]
    read_inflight_bytes: int
    rounds: _Rounds
    get_into_gbps: float
    raw_pool_gbps: float


def _on_the_pool(
    plan: _Plan, huge_dir: Path | None, use_fio: bool, progress: Progress, cleanup: contextlib.ExitStack
) -> _PoolRun:
    """Write-back, fio's sweep, then our reads on one store, in that order: fio lays its file out after our
    chunks are written, and our parallel reads run at the best cap on reads in flight that the sweep found."""
    backing = "hugetlbfs" if huge_dir else "shm"
    progress("write-back", 0.0)
    store = _store(plan, backing)
    try:
        write_gbps = _write_all(store, plan.keys, plan.chunk_bytes)
        fio = _fio_ceiling(plan, huge_dir, progress, cleanup) if use_fio and fio_available() else None
        progress("serial reads", 0.45)
        serial = _median(plan.repeats, lambda: _read_all(store, plan.keys, parallel=False))
        progress("parallel reads: sweeping reads in flight", 0.5)
        sweep = _sweep_inflight(store, plan.keys, plan.threads)
        inflight = max(sweep, key=sweep.get)
        _set_inflight(store, inflight)
        rounds = _interleaved_rounds(store, plan, fio, progress)
        progress("demand loads into caller memory", 0.8)
        get_into = _median(plan.repeats, lambda: _get_into_all(store, plan.keys, plan.chunk_bytes))
        progress("raw preadv into the pool's memory", 0.85)
        raw_pool = _median(plan.repeats, lambda: _raw_read_all(store, plan.keys))
    finally:
        _close(store)
        if huge_dir:  # fio leaves its huge-page buffer file behind
            (huge_dir / "fio-buffer").unlink(missing_ok=True)
    return _PoolRun(backing, write_gbps, fio, serial, sweep, inflight, rounds, get_into, raw_pool)


def _fio_ceiling(plan: _Plan, huge_dir: Path | None, progress: Progress, cleanup: contextlib.ExitStack) -> _FioCeiling:
    """fio's file laid out in the measured directory (removed by `cleanup`, however the run ends) and every
    (queue depth, buffer type) pair read once; buffers on huge pages where the run has a hugetlbfs mount."""
    progress("fio: laying out its file, sweeping depths and buffers", 0.15)
    reference = cleanup.enter_context(
        contextlib.closing(FioReference(plan.directory, plan.total_bytes, plan.chunk_bytes))
    )
    memories = ["malloc"] + ([f"mmaphuge:{huge_dir}/fio-buffer", "shmhuge"] if huge_dir else [])
    runs = reference.sweep((1, 4, 16), memories)
    return _FioCeiling(reference, runs, max(runs, key=lambda r: r.gbps))


def _interleaved_rounds(store: TieredStore, plan: _Plan, fio: _FioCeiling | None, progress: Progress) -> _Rounds:
    """Our parallel read, fio's best job and our read straight into the slots, in turn, `repeats` times."""
    rounds = _Rounds(parallel=[], fio=[], unstaged=[])
    for i in range(plan.repeats):
        progress(f"parallel reads vs fio, round {i + 1}/{plan.repeats}", 0.6 + 0.25 * i / plan.repeats)
        rounds.parallel.append(_read_all(store, plan.keys, parallel=True))
        if fio is not None:
            rounds.fio.append(fio.reference.read(fio.best.iodepth, fio.best.iomem).gbps)
        if store.disk.staging is not None:
            with _unstaged(store):
                rounds.unstaged.append(_read_all(store, plan.keys, parallel=True))
    return rounds


def _parallel_on_4k_pages(plan: _Plan, huge_dir: Path | None, progress: Progress) -> float | None:
    """The parallel read again on a pool of ordinary pages, for the side-by-side row; None when the first pool
    was on them already."""
    if not huge_dir:
        return None
    progress("parallel reads, 4 KiB pages", 0.9)
    store = _store(plan, "shm")
    try:
        return _median(plan.repeats, lambda: _read_all(store, plan.keys, parallel=True))
    finally:
        _close(store)


def _result(plan: _Plan, pool: _PoolRun, parallel_4k: float | None) -> IOBenchResult:
    """The medians of the rounds, and the rest as measured."""
    rounds, fio = pool.rounds, pool.fio
    return IOBenchResult(
        shape=RunShape(plan.chunk_bytes, plan.total_bytes, plan.threads),
        fio=FioFigures(statistics.median(rounds.fio), fio.runs) if fio else None,
        inflight=InflightSweep(pool.inflight_sweep, pool.read_inflight_bytes),
        serial_read_gbps=pool.serial_gbps,
        parallel_read_gbps=statistics.median(rounds.parallel),
        parallel_read_gbps_unstaged=statistics.median(rounds.unstaged) if rounds.unstaged else None,
        parallel_read_gbps_4k_pages=parallel_4k,
        get_into_gbps=pool.get_into_gbps,
        raw_pool_read_gbps=pool.raw_pool_gbps,
        write_gbps=pool.write_gbps,
        dram_backing=pool.backing,
    )


def _store(plan: _Plan, backing: str) -> TieredStore:
    config = StoreConfig.load(
        dram={"capacity_bytes": plan.pool_bytes, "pool_name": f"iobench-{uuid.uuid4().hex[:8]}", "backing": backing},
        disk={"path": str(plan.data_dir), "capacity_bytes": 1 << 50},
        io={"threads": plan.threads},
    )
    return TieredStore(config, chunk_bytes=plan.chunk_bytes)


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


def evict_all(store: TieredStore, keys: list[bytes]) -> None:
    """Every one of keys out of the store's DRAM pool (what no reader pins), so the next pass reads the disk."""
    for key in keys:
        store.dram.discard(key)


def _read_all(store: TieredStore, keys: list[bytes], parallel: bool) -> float:
    """Cold reads from disk into the DRAM pool (promotion), one at a time or all in flight."""
    evict_all(store, keys)
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
    evict_all(store, keys)
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
