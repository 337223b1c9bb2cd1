"""Host DRAM tier: a fixed pool of chunk slots in one shared-memory file, shared by every process on the node.

The pool is allocated once (no per-chunk malloc on the hot path) and every process that opens the same name
maps the same pages: the vLLM scheduler prefetches into it, the workers copy out of it, and several engine
instances share it, with one copy of each chunk per node. All bookkeeping lives in the shared file itself:

    [superblock][slot table][pin matrix: process x slot][process table][... 2 MiB aligned ...][slot images]

A slot is FREE, WRITING (allocated, pinned by its writer) or READY (a whole, verified chunk image). Mutations
take a process-wide lock plus flock on the file, so threads and processes serialise on the same order.
Pins are counted per process row, so a process that dies is unpinned by the next one that notices
(`reap_dead`), and LRU eviction never takes a slot that any live process pins.

Crash safety: a process can be SIGKILLed between any two stores to the shared file (the kernel drops its flock),
so every step keeps these invariants, and the next process needs no log to repair anything:
  * a WRITING slot is pinned by its writer: allocate pins the slot before marking it WRITING, commit and abort
    change the state before unpinning. So a WRITING slot with no pin is a dead writer's, and reaping frees it.
  * a READY slot's image is the whole chunk its key names: a slot's key changes only while it is WRITING
    (allocate marks the slot WRITING, then publishes the new key last), and its image is written only while its
    writer holds it WRITING; commit makes it READY after the image and its header are complete. So a READY
    image cannot be torn by a crash; `payload` still checks the image's header names the key (microseconds),
    which would catch a slot table that disagrees with its image however that came about.
See kvprefetch.crashpoints and tests/store/test_crash_points.py, which kill a process at each of these steps.

The pool outlives its processes only as its declared `keep_idle_s` says (0: the last process to detach removes
it); a pool idle past that (processes that died count as gone) is removed by the next process that opens the
name or looks at it (`kvprefetch status`), and by its watcher (`tiers.pool_watch`) when the last process attached
died without detaching.

Reservation invariant: a slot is handed out (`allocate`) only from a *reserved* pool, one whose whole file is
allocated in RAM (posix_fallocate) and marked so in its first page; so a node without the memory fails with a
clear error, never with SIGBUS in the middle of a write into a slot. A pool is reserved when it is created (the
default), or, with reserve="first_write", by the first process that asks it for a slot: a process that only reads
the pool (a weight load whose blocks all come from the disk cache) never pays for memory it does not use.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import functools
import logging
import mmap
import os
import struct
import threading
import time
from contextlib import contextmanager
from dataclasses import dataclass
from enum import Enum
from pathlib import Path
from typing import Literal

import numpy as np

from kvprefetch.crashpoints import crash_point
from kvprefetch.tiers.access import PRIVATE, FileAccess, PoolAccessError
from kvprefetch.tiers.chunk_format import ALIGN, HEADER_BYTES, CorruptChunk, align_up, verify_image
from kvprefetch.tiers.memory import populate
from kvprefetch.tiers.pool_watch import _LIFE, _LIFE_MAGIC, ensure_watcher, pid_alive

log = logging.getLogger(__name__)

POOL_MAGIC = b"KVPFPOOL"
POOL_VERSION = 1
SHM_DIR = Path(os.environ.get("KVPREFETCH_SHM_DIR", "/dev/shm"))
DATA_ALIGN = 2 << 20  # so slot images can sit on huge pages
HUGE_PAGE = 2 << 20

Reserve = Literal["fallocate", "first_write", "touch"]  # how a new pool gets its memory: see SharedChunkPool._reserve
FREE, WRITING, READY = 0, 1, 2
_SUPER = struct.Struct("<8sIIQQQQ")  # magic, version, max_procs, slot_bytes, n_slots, data_offset, tick
_TICK_OFFSET = 8 + 4 + 4 + 8 + 8 + 8
SLOT_DTYPE = np.dtype(
    [("key0", "<u8"), ("key", "V32"), ("state", "<u4"), ("_pad", "<u4"), ("nbytes", "<u8"), ("tick", "<u8")],
    align=False,
)
assert SLOT_DTYPE.itemsize == 64


class PoolGeometryError(ValueError):
    """A pool of this name exists with another slot size or count than this process asks for."""


@dataclass(frozen=True)
class PoolGeometry:
    slot_bytes: int
    n_slots: int
    max_procs: int

    def offsets(self) -> tuple[int, int, int, int, int]:
        table = 4096
        pins = table + align_up(self.n_slots * SLOT_DTYPE.itemsize)
        procs = pins + align_up(self.max_procs * self.n_slots * 4)
        data = align_up(procs + self.max_procs * 8, DATA_ALIGN)
        total = data + self.n_slots * self.slot_bytes
        return table, pins, procs, data, total


def hugetlbfs_mount() -> Path | None:
    """A mounted hugetlbfs of 2 MiB pages, if the node has one."""
    try:
        mounts = Path("/proc/mounts").read_text().splitlines()
    except OSError:
        return None
    for line in mounts:
        parts = line.split()
        if len(parts) >= 4 and parts[2] == "hugetlbfs" and "pagesize=1G" not in parts[3]:
            return Path(parts[1])
    return None


def free_huge_pages() -> int:
    try:
        return int(Path("/sys/kernel/mm/hugepages/hugepages-2048kB/free_hugepages").read_text())
    except (OSError, ValueError):
        return 0


def pool_directory(name: str, backing: str, pool_bytes: int) -> Path:
    """Where the pool of this name lives: an existing pool wins, then huge pages if asked for and available.

    O_DIRECT reads into hugetlbfs-backed memory ran up to 2x faster than into 4 KiB pages here (fio, same
    job), so `auto` uses a hugetlbfs mount when it has enough free pages for the whole pool.
    """
    mount = hugetlbfs_mount()
    for directory in (mount, SHM_DIR):
        if directory is not None and (directory / f"kvprefetch-{name}.pool").exists():
            return directory
    if backing == "shm":
        return SHM_DIR
    fits = mount is not None and free_huge_pages() * HUGE_PAGE >= pool_bytes + 2 * DATA_ALIGN
    if fits:
        return mount
    if backing == "hugetlbfs":
        need = (pool_bytes + 2 * DATA_ALIGN) // HUGE_PAGE + 1
        raise PoolGeometryError(
            f"dram.backing=hugetlbfs needs a hugetlbfs mount with {need} free 2 MiB pages (found"
            f" {'no mount' if mount is None else f'{free_huge_pages()} free at {mount}'}): as root, "
            f"`mount -t hugetlbfs none /dev/hugepages; echo {need} > /proc/sys/vm/nr_hugepages`"
        )
    return SHM_DIR


def _open_pool_file(path: Path, access: FileAccess, create: bool = True) -> int:
    try:
        return os.open(path, os.O_RDWR | os.O_NOFOLLOW | (os.O_CREAT if create else 0), access.pool_mode)
    except OSError as err:
        if err.errno != errno.ELOOP:
            raise
        raise PoolAccessError(f"DRAM pool {path} is a symbolic link: refused (it may point at any file)") from None


# ---- lifecycle: who uses a pool, since when it is idle, and how long it is kept so -------------------------
# The record lives in the superblock's page, clear of the superblock itself: magic, keep_idle_s (-1: forever),
# and when the pool was last attached to or detached from (seconds since the epoch).
_LIFE_OFFSET = 1024  # (_LIFE, _LIFE_MAGIC: `pool_watch`, which reads the record without importing this module)
# The reservation mark (see the module's invariant), in the same page: magic, when the pool was reserved (epoch s).
_RESERVED = struct.Struct("<8sd")
_RESERVED_OFFSET = 1024 + 64
_RESERVED_MAGIC = b"KVPFRSVD"


class Reservation(Enum):
    """Whether this process may hand out slots (see the module's reservation invariant)."""

    RESERVED = "reserved"  # the whole file is allocated: slots may be written
    DEFERRED = "deferred"  # not yet (reserve="first_write", or a pool laid out before the mark existed)
    FAILED = "failed"  # reserving it failed in this process: it hands out no slot (the tier reads as full)


def _reserved(mm: mmap.mmap) -> bool:
    return _RESERVED.unpack_from(mm, _RESERVED_OFFSET)[0] == _RESERVED_MAGIC


def _mark_reserved(mm: mmap.mmap) -> None:
    _RESERVED.pack_into(mm, _RESERVED_OFFSET, _RESERVED_MAGIC, time.time())


class PoolExpired(FileNotFoundError):
    """The pool was idle past its keep_idle_s and has just been removed (or was never laid out)."""


class PoolInUse(RuntimeError):
    """A pool cannot be removed while live processes are attached to it."""


class PoolNoSpace(OSError):
    """The node has not the memory left for a pool of this size."""


@dataclass(frozen=True)
class PoolUsage:
    """A pool's users and lifecycle: the live processes attached, its policy and the RAM its file holds."""

    pids: tuple[int, ...]
    keep_idle_s: float | None  # None: kept until removed by hand (`kvprefetch status --remove/--gc`)
    last_used: float  # when a process last attached or detached (epoch s); an idle pool is idle since then
    held_bytes: int  # the file's allocated blocks: the RAM (or huge pages) it holds, whoever maps it

    def expired(self, now: float | None = None) -> bool:
        """Idle (no live process attached) for at least keep_idle_s."""
        if self.pids or self.keep_idle_s is None:
            return False
        return (time.time() if now is None else now) - self.last_used >= self.keep_idle_s

    def describe(self) -> str:
        kept = "kept until removed" if self.keep_idle_s is None else f"keep_idle_s={self.keep_idle_s:g}"
        idle = time.time() - self.last_used
        return f"idle for {idle:.0f} s, {kept}, held {self.held_bytes / 2**30:.2f} GiB"


def held_bytes(fd: int) -> int:
    """The pool file's allocated blocks in bytes: the memory it really holds (tmpfs and hugetlbfs count them)."""
    return os.fstat(fd).st_blocks * 512


def pool_usage(fd: int) -> PoolUsage | None:
    """Read a pool's users and lifecycle record from its file (None: not laid out, or not a pool of ours).

    Pools laid out before the record existed count as keep_idle_s=0 since their file was last modified.
    """
    head = os.pread(fd, _LIFE_OFFSET + _LIFE.size, 0)
    if len(head) < _LIFE_OFFSET + _LIFE.size:
        return None
    magic, version, max_procs, slot_bytes, n_slots, _data, _tick = _SUPER.unpack_from(head)
    if magic != POOL_MAGIC or version != POOL_VERSION:
        return None
    procs_at = PoolGeometry(slot_bytes, n_slots, max_procs).offsets()[2]
    rows = np.frombuffer(os.pread(fd, max_procs * 8, procs_at), np.int64)
    pids = tuple(int(p) for p in rows if p != 0 and pid_alive(int(p)))
    life_magic, _keep, last_used = _LIFE.unpack_from(head, _LIFE_OFFSET)
    if life_magic != _LIFE_MAGIC:
        last_used = os.fstat(fd).st_mtime
    return PoolUsage(pids, _declared_keep(head), last_used, held_bytes(fd))


def _declared_keep(head: bytes) -> float | None:
    """The keep_idle_s recorded in a pool's first page (0 for pools laid out before the record existed)."""
    if len(head) < _LIFE_OFFSET + _LIFE.size:
        return 0.0
    life_magic, keep, _last_used = _LIFE.unpack_from(head, _LIFE_OFFSET)
    if life_magic != _LIFE_MAGIC:
        return 0.0
    return None if keep < 0 else keep


def _write_life(mm: mmap.mmap, keep_idle_s: float | None, last_used: float) -> None:
    """Through the mapping: hugetlbfs files take no write()."""
    _LIFE.pack_into(mm, _LIFE_OFFSET, _LIFE_MAGIC, -1.0 if keep_idle_s is None else float(keep_idle_s), last_used)


def _names(fd: int, path: Path) -> bool:
    """Whether path still names the open file fd (its last user may have removed it meanwhile)."""
    try:
        st = os.stat(path, follow_symlinks=False)
    except FileNotFoundError:
        return False
    mine = os.fstat(fd)
    return (st.st_dev, st.st_ino) == (mine.st_dev, mine.st_ino)


class SharedChunkPool:
    """A node-wide pool of fixed-size chunk slots with LRU eviction and per-process pins."""

    def __init__(
        self,
        name: str,
        slot_bytes: int,
        capacity_bytes: int,
        max_procs: int = 64,
        hugepages: bool = True,
        directory: str | os.PathLike = SHM_DIR,
        access: FileAccess = PRIVATE,
        keep_idle_s: float | None = 0.0,
        observer: bool = False,
        reserve: Reserve = "fallocate",
    ):
        slot_bytes = align_up(slot_bytes, ALIGN)
        n_slots = capacity_bytes // slot_bytes
        if n_slots < 1:
            raise ValueError(
                f"DRAM capacity {capacity_bytes} B holds no slot of {slot_bytes} B: raise dram.capacity_bytes"
            )
        self.name = name
        self.evictions = 0
        self.wait_timeouts = 0  # reads that gave up waiting on a WRITING slot: a writer that neither commits nor dies
        self.path = Path(directory) / f"kvprefetch-{name}.pool"
        self.observer = observer
        self._tlock = threading.RLock()
        self._fd = self._open_current(access)  # locked
        created = False
        try:
            try:
                created = not observer and os.fstat(self._fd).st_size == 0
                self._map_or_init(PoolGeometry(slot_bytes, n_slots, max_procs), hugepages, reserve)
                self.reaped_at_attach = 0
                self._row = -1 if observer else self._claim_row()
                if not observer:
                    _write_life(self._mm, keep_idle_s, time.time())
            finally:
                fcntl.flock(self._fd, fcntl.LOCK_UN)
        except BaseException:
            os.close(self._fd)
            if created:
                self.path.unlink(missing_ok=True)
            raise
        self.created = created
        self._closed = False
        if not observer and keep_idle_s == 0:
            # the last one out, should the last process attached die without detaching (see `pool_watch`)
            procs_offset = self.geometry.offsets()[2]
            ensure_watcher(str(self.path), procs_offset, self.geometry.max_procs, _LIFE_OFFSET)

    @classmethod
    def attach(
        cls, name: str, directory: str | os.PathLike = SHM_DIR, access: FileAccess = PRIVATE, observer: bool = False
    ) -> SharedChunkPool:
        """Attach to an existing pool with whatever geometry and keep_idle_s it has; an observer (an inspection
        tool) takes no process row, so it neither counts as a user nor changes when the pool was last used."""
        path = Path(directory) / f"kvprefetch-{name}.pool"
        with open(path, "rb") as f:
            head = f.read(_LIFE_OFFSET + _LIFE.size)
        if len(head) < _SUPER.size:
            raise PoolGeometryError(f"{path} is empty or truncated")
        magic, version, max_procs, slot_bytes, n_slots, _data, _tick = _SUPER.unpack_from(head)
        if magic != POOL_MAGIC or version != POOL_VERSION:
            raise PoolGeometryError(f"{path} is not a kvprefetch pool (or an older version)")
        keep = _declared_keep(head)
        return cls(name, slot_bytes, slot_bytes * n_slots, max_procs, False, directory, access, keep, observer)

    # ---- lifecycle ---------------------------------------------------------------------------------------
    def _open_current(self, access: FileAccess) -> int:
        """Open and lock (flock) the file that is the pool's name now.

        A file its last user removed while this process waited for the lock is let go and the name opened
        again, so two processes never end up in two copies of one pool. A pool idle past its declared
        keep_idle_s is removed first (see `PoolUsage.expired`): a member then creates a fresh one, an observer
        raises PoolExpired.
        """
        while True:
            fd = _open_pool_file(self.path, access, create=not self.observer)
            try:
                access.adopt_pool(fd, self.path)  # someone else's pool (or a link to one) is refused
                fcntl.flock(fd, fcntl.LOCK_EX)
                if _names(fd, self.path):
                    usage = pool_usage(fd)
                    if usage is None or not usage.expired():
                        return fd
                    self.path.unlink()
                    log.info("DRAM pool %s removed: %s", self.path, usage.describe())
                    if self.observer:
                        raise PoolExpired(f"{self.path} was removed: {usage.describe()}")
            except BaseException:
                os.close(fd)
                raise
            os.close(fd)

    def usage(self) -> PoolUsage:
        """Who uses the pool, since when it is idle, its policy and the RAM it holds (for `kvprefetch status`)."""
        with self._locked():
            usage = pool_usage(self._fd)
        assert usage is not None
        return usage

    def remove_if_idle(self) -> PoolUsage:
        """Remove the pool from the node if no process but this observer uses it; return what it was.

        Raises PoolInUse (and removes nothing) while any live process is attached.
        """
        with self._locked():
            self._reap_dead_locked()
            usage = pool_usage(self._fd)
            assert usage is not None
            if usage.pids:
                raise PoolInUse(f"DRAM pool {self.name} is in use by process(es) {', '.join(map(str, usage.pids))}")
            self.path.unlink(missing_ok=True)
        return usage

    # ---- setup -------------------------------------------------------------------------------------------
    def _map_or_init(self, want: PoolGeometry, hugepages: bool, reserve: Reserve) -> bool:
        """Map an existing pool (checking its geometry) or lay out a new one. Returns True if created."""
        size = os.fstat(self._fd).st_size
        created = size == 0
        if created:
            if self.observer:
                raise PoolGeometryError(f"{self.path} is empty: being laid out, or its creator died doing so")
            size = align_up(want.offsets()[-1], DATA_ALIGN)  # hugetlbfs wants whole huge pages
            os.ftruncate(self._fd, size)
            # the bookkeeping pages are written now, so they are reserved now whatever `reserve` says
            self._reserve(size if reserve == "fallocate" else want.offsets()[3])
        try:
            self._mm = mmap.mmap(self._fd, size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        except OSError:
            if created:
                os.ftruncate(self._fd, 0)
            raise
        if created:
            head = (POOL_MAGIC, POOL_VERSION, want.max_procs, want.slot_bytes, want.n_slots, want.offsets()[3], 0)
            _SUPER.pack_into(self._mm, 0, *head)
            self.geometry = want
        else:
            self.geometry = self._check_geometry(want)
        self._layout(hugepages, prefault=created and reserve == "touch")
        if created and reserve != "first_write":
            _mark_reserved(self._mm)
        self._reservation = Reservation.RESERVED if _reserved(self._mm) else Reservation.DEFERRED
        return created

    def _reserve(self, size: int) -> None:
        """Allocate the pool's first `size` bytes in RAM now (posix_fallocate), so a node short of memory fails
        here, with a clear error, and never later with SIGBUS in the middle of a write into a slot.

        Faulting every page in by touching it (as before) reserves as well, but on our VM a 2 GiB pool took 1.9 s
        so (3.7 s under load, up to 30 s on a freshly booted VM) against 0.55 s with fallocate, and the first
        request's load into its slots was not faster for it (0.87 s against 0.20 s; `kvprefetch poolbench`).
        """
        try:
            os.posix_fallocate(self._fd, 0, size)
        except OSError as err:
            if err.errno in (errno.EOPNOTSUPP, errno.EINVAL):  # a file system without fallocate: pages on demand
                return
            if err.errno == errno.ENOSPC:
                free = os.statvfs(self.path.parent)
                raise PoolNoSpace(
                    f"DRAM pool '{self.name}' needs {size / 2**30:.2f} GiB but {self.path.parent} has"
                    f" {free.f_bavail * free.f_frsize / 2**30:.2f} GiB free: lower dram.capacity_bytes, or free"
                    f" idle pools (`kvprefetch status --gc`)"
                ) from None
            raise

    def _check_geometry(self, want: PoolGeometry) -> PoolGeometry:
        magic, version, max_procs, slot_bytes, n_slots, _data, _tick = _SUPER.unpack_from(self._mm, 0)
        if magic != POOL_MAGIC or version != POOL_VERSION:
            raise PoolGeometryError(f"{self.path} is not a kvprefetch pool (or an older version): remove it")
        have = PoolGeometry(slot_bytes, n_slots, max_procs)
        if have.slot_bytes != want.slot_bytes or have.n_slots != want.n_slots:
            raise PoolGeometryError(
                f"DRAM pool '{self.name}' exists with {have.n_slots} slots of {have.slot_bytes} B, this process"
                f" asks for {want.n_slots} slots of {want.slot_bytes} B: use another dram.pool_name for a"
                f" different model/layout, or the same capacity"
            )
        return have

    def _layout(self, hugepages: bool, prefault: bool) -> None:
        table, pins, procs, data, total = self.geometry.offsets()
        self.hugepages_advised = False
        if hugepages and hasattr(mmap, "MADV_HUGEPAGE"):
            with contextlib.suppress(OSError):  # not every file system takes the advice (hugetlbfs needs none)
                self._mm.madvise(mmap.MADV_HUGEPAGE, data, total - data)
                self.hugepages_advised = True
        g = self.geometry
        self.slots = np.ndarray((g.n_slots,), SLOT_DTYPE, buffer=self._mm, offset=table)
        self.pins = np.ndarray((g.max_procs, g.n_slots), np.int32, buffer=self._mm, offset=pins)
        self.procs = np.ndarray((g.max_procs,), np.int64, buffer=self._mm, offset=procs)
        self._data = np.ndarray((total - data,), np.uint8, buffer=self._mm, offset=data)
        if prefault:  # fault every page in once, so the hot path never takes a page fault
            self._data[::4096] = 0
        # Slots whose pages this process has mapped (`image`): process-local, like the mapping itself.
        self._mapped = np.full(g.n_slots, prefault)

    def _claim_row(self) -> int:
        self.reaped_at_attach = self._reap_dead_locked()  # an observer reaps in reap_dead()
        pid = os.getpid()
        free = np.flatnonzero(self.procs == 0)
        if len(free) == 0:
            raise RuntimeError(f"DRAM pool '{self.name}' has {self.geometry.max_procs} processes attached already")
        row = int(free[0])
        self.procs[row] = pid
        self.pins[row, :] = 0
        return row

    # ---- locking -----------------------------------------------------------------------------------------
    @contextmanager
    def _locked(self):
        with self._tlock:
            fcntl.flock(self._fd, fcntl.LOCK_EX)
            try:
                yield
            finally:
                fcntl.flock(self._fd, fcntl.LOCK_UN)

    def _next_tick(self) -> int:
        (tick,) = struct.unpack_from("<Q", self._mm, _TICK_OFFSET)
        struct.pack_into("<Q", self._mm, _TICK_OFFSET, tick + 1)
        return tick + 1

    def _reap_dead_locked(self) -> int:
        reaped = 0
        for row in np.flatnonzero(self.procs != 0):
            pid = int(self.procs[row])
            if pid != os.getpid() and not pid_alive(pid):
                self.pins[row, :] = 0
                self.procs[row] = 0
                reaped += 1
        crash_point("dram.reap.rows_cleared")
        # every live writer pins its WRITING slot (see the module's invariants): one nobody pins is a dead
        # writer's half-written image, whether its row was cleared just now or by a reaper killed mid-way
        unowned = np.flatnonzero((self.slots["state"] == WRITING) & (self.pins.sum(axis=0) == 0))
        self.slots["state"][unowned] = FREE
        return reaped

    def reap_dead(self) -> int:
        """Release the pins of processes that died without detaching, and the half-written slots left unowned."""
        with self._locked():
            return self._reap_dead_locked()

    # ---- lookup ------------------------------------------------------------------------------------------
    def _find(self, key: bytes, state: int = READY) -> int | None:
        key0 = int.from_bytes(key[:8], "little")
        for slot in np.flatnonzero((self.slots["key0"] == key0) & (self.slots["state"] == state)):
            if self.slots["key"][slot].tobytes() == key:
                return int(slot)
        return None

    def contains(self, key: bytes) -> bool:
        """Whether key has a READY slot (a hint: it may be evicted right after unless pinned)."""
        return self._find(key) is not None

    def writing(self, key: bytes) -> bool:
        """Whether some thread or process is writing key into a slot right now (a hint, like contains)."""
        return self._find(key, WRITING) is not None

    def wait_ready(self, key: bytes, timeout: float) -> bool:
        """If another thread or process is writing key right now, wait (up to timeout) for it to be READY."""
        start = time.monotonic()
        next_reap = start + 0.5
        while self._find(key, WRITING) is not None:
            now = time.monotonic()
            if now > start + timeout:
                self.wait_timeouts += 1
                return False
            if now > next_reap:  # the writer may have died mid-write
                self.reap_dead()
                next_reap = now + 0.5
            time.sleep(0.0005)
        return self._find(key) is not None

    def contains_many(self, keys: list[bytes]) -> list[bool]:
        """Vectorised contains() for a request's keys: one pass over the slot table."""
        if not keys:
            return []
        want = np.frombuffer(b"".join(k[:8] for k in keys), dtype="<u8")
        ready = self.slots["state"] == READY
        maybe = np.isin(want, self.slots["key0"][ready])
        return [bool(m) and self._find(k) is not None for k, m in zip(keys, maybe, strict=True)]

    def unpinned_ticks(self) -> dict[bytes, int]:
        """Key -> LRU tick of every READY slot that no process pins: what an eviction may take now (the
        bench's stand-in for other engines' traffic reads it, `kvprefetch.testbed.pressure`)."""
        with self._locked():
            idx = np.flatnonzero((self.slots["state"] == READY) & (self.pins.sum(axis=0) == 0))
            return {self.slots["key"][i].tobytes(): int(self.slots["tick"][i]) for i in idx}

    # ---- slot lifecycle ----------------------------------------------------------------------------------
    def allocate(self, key: bytes, payload_nbytes: int) -> int | None:
        """Reserve a slot for key (pinned by this process, state WRITING); None if present or all pinned."""
        if HEADER_BYTES + payload_nbytes > self.geometry.slot_bytes:
            raise ValueError(f"chunk of {payload_nbytes} B does not fit a {self.geometry.slot_bytes} B slot")
        with self._locked():
            if self._find(key) is not None or self._find(key, WRITING) is not None:
                return None
            if not self._reserved_locked():
                return None
            slot = self._free_or_victim()
            if slot is None and self._reap_dead_locked():
                slot = self._free_or_victim()
            if slot is None:
                return None
            # the order is the crash-safety invariant: owner first, then WRITING (the old chunk is no longer
            # served), then the new key, last (nobody finds the slot under it before it is owned and WRITING)
            self.pins[self._row, slot] += 1
            crash_point("dram.allocate.pinned")
            entry = self.slots[slot]
            entry["state"] = WRITING
            crash_point("dram.allocate.writing")
            entry["nbytes"] = payload_nbytes
            entry["key"] = np.frombuffer(key, dtype="V32")[0]
            entry["key0"] = int.from_bytes(key[:8], "little")
            crash_point("dram.allocate.key_published")
            return slot

    def _reserved_locked(self) -> bool:
        """Whether this process may hand out slots; reserves a deferred pool first (the reservation invariant).

        Another process may have reserved it since this one attached (its mark says so); else this process
        reserves it now, under the pool's lock, once. A pool that cannot be reserved (the node has not the
        memory) is logged once and hands out no slot from this process: the tier reads as full, never as an error.
        """
        if self._reservation is Reservation.DEFERRED:
            if not _reserved(self._mm):
                try:
                    self._reserve(len(self._mm))
                except OSError as err:
                    self._reservation = Reservation.FAILED
                    why = "this process keeps no chunk in it"
                    log.warning("DRAM pool %s cannot be reserved (%s): %s", self.path, err, why)
                    return False
                _mark_reserved(self._mm)
            self._reservation = Reservation.RESERVED
        return self._reservation is Reservation.RESERVED

    def _free_or_victim(self) -> int | None:
        states = self.slots["state"]
        free = np.flatnonzero(states == FREE)
        if len(free):
            return int(free[0])
        evictable = (states == READY) & (self.pins.sum(axis=0) == 0)
        if not evictable.any():
            return None
        ticks = np.where(evictable, self.slots["tick"], np.iinfo(np.uint64).max)
        victim = int(np.argmin(ticks))
        self.evictions += 1
        return victim

    def commit(self, slot: int) -> None:
        """Publish a written slot (header already in place) and drop the writer's pin."""
        with self._locked():
            self.slots["tick"][slot] = self._next_tick()
            self.slots["state"][slot] = READY
            crash_point("dram.commit.ready")
            self.pins[self._row, slot] -= 1

    def abort(self, slot: int) -> None:
        """Give back a slot whose write failed."""
        with self._locked():
            self.slots["state"][slot] = FREE
            self.pins[self._row, slot] -= 1

    def acquire(self, key: bytes) -> int | None:
        """Pin key's READY slot for reading and mark it most recently used; None on a miss."""
        with self._locked():
            slot = self._find(key)
            if slot is None:
                return None
            self.pins[self._row, slot] += 1
            crash_point("dram.acquire.pinned")
            self.slots["tick"][slot] = self._next_tick()
            return slot

    def pin_slot(self, slot: int) -> None:
        """Add a pin by this process to a slot it already holds (allocated or acquired)."""
        with self._locked():
            self.pins[self._row, slot] += 1

    def unpin(self, key: bytes) -> bool:
        """Drop one of this process's pins on key's slot."""
        with self._locked():
            slot = self._find(key)
            if slot is None or self.pins[self._row, slot] == 0:
                return False
            self.pins[self._row, slot] -= 1
            return True

    def release(self, slot: int) -> None:
        with self._locked():
            if self.pins[self._row, slot] > 0:
                self.pins[self._row, slot] -= 1

    def discard(self, key: bytes) -> bool:
        """Drop key if nobody pins it (e.g. it was found corrupt)."""
        with self._locked():
            slot = self._find(key)
            if slot is None or self.pins[:, slot].sum() > 0:
                return False
            self.slots["state"][slot] = FREE
            return True

    def image(self, slot: int) -> memoryview:
        """The slot's chunk image (zero-copy view into shared memory).

        The first time this process touches a slot, its pages are mapped in one call (`populate`) instead of
        one fault per page: the I/O threads copy into and out of slots at once, and their concurrent page
        faults on this one mapping contend in the kernel (kvprefetch.tiers.memory)."""
        image = self._image(slot)
        if not self._mapped[slot]:
            self._mapped[slot] = True  # (two threads may both populate it: harmless)
            populate(image.ctypes.data, len(image))
        return memoryview(image)

    def _image(self, slot: int) -> np.ndarray:
        start = slot * self.geometry.slot_bytes
        return self._data[start : start + self.geometry.slot_bytes]

    def data_view(self) -> memoryview:
        """All slot images as one region (for backends that register memory for zero-copy transfers)."""
        return memoryview(self._data)

    def payload(self, slot: int, key: bytes) -> memoryview:
        """The payload of key's slot (pinned by the caller), once its image's header is checked to name key and
        the table's size: raises CorruptChunk otherwise. The payload checksum is not recomputed: a READY image
        cannot be torn (module docstring), and the header check costs microseconds where the checksum costs a
        pass over the chunk."""
        image = self.image(slot)
        return image[HEADER_BYTES : HEADER_BYTES + self._checked_nbytes(slot, key, image)]

    def _checked_nbytes(self, slot: int, key: bytes, image: memoryview) -> int:
        """The payload size of key's slot, once the image's header names key and agrees with the slot table."""
        nbytes = int(self.slots["nbytes"][slot])
        if verify_image(image, key, verify_payload=False).payload_nbytes != nbytes:
            raise CorruptChunk(f"slot {slot}: the image's size disagrees with the slot table's {nbytes} B")
        return nbytes

    def payload_extent(self, slot: int, key: bytes) -> tuple[int, int, int]:
        """Where key's payload lies in the pool's file (slot pinned by the caller): (fd, offset, nbytes), checked
        as `payload` checks it. For mapping the payload elsewhere without a copy (`tiers.memory.map_file_over`):
        the fd stays open while this process is attached; a mapping made from it outlives the fd, not the pin.
        Only the header's page is touched here: the payload is read through the other mapping, so populating
        this process's own mapping of the slot (as `payload` does) would map every page twice."""
        nbytes = self._checked_nbytes(slot, key, memoryview(self._image(slot)))
        offset = self.geometry.offsets()[3] + slot * self.geometry.slot_bytes + HEADER_BYTES
        return self._fd, offset, nbytes

    @functools.cached_property
    def page_bytes(self) -> int:
        """The pool file's page size (4 KiB on tmpfs, 2 MiB on hugetlbfs): what a mapping of it is aligned to."""
        return os.fstatvfs(self._fd).f_bsize

    # ---- accounting --------------------------------------------------------------------------------------
    def stats(self) -> dict:
        states = self.slots["state"]
        ready = int((states == READY).sum())
        return {
            "name": self.name,
            "slots_total": self.geometry.n_slots,
            "slots_ready": ready,
            "slots_writing": int((states == WRITING).sum()),
            "slots_pinned": int((self.pins.sum(axis=0) > 0).sum()),
            "bytes_used": ready * self.geometry.slot_bytes,
            "capacity_bytes": self.geometry.n_slots * self.geometry.slot_bytes,
            "processes": int((self.procs != 0).sum()),
            "evictions_here": self.evictions,
            "wait_timeouts_here": self.wait_timeouts,
            "hugepages_advised": self.hugepages_advised,
            "held_bytes": held_bytes(self._fd),
        }

    def close(self) -> None:
        """Detach: drop this process's pins and row. The pool stays for the other processes; when this was the
        last one, it stays as long as the pool's keep_idle_s says (0: removed now)."""
        if self._closed:
            return
        self._closed = True
        with self._locked():
            if not self.observer:
                mine = np.flatnonzero(self.pins[self._row] > 0)
                writing = mine[self.slots["state"][mine] == WRITING]
                self.slots["state"][writing] = FREE
                self.pins[self._row, :] = 0
                self.procs[self._row] = 0
                self._reap_dead_locked()
                self._detach_last_locked()
        del self.slots, self.pins, self.procs, self._data
        with contextlib.suppress(BufferError):  # a caller still holds a view; it unmaps when collected
            self._mm.close()
        os.close(self._fd)

    def _detach_last_locked(self) -> None:
        """If no live process is attached any more: record when the pool went idle, remove it if its policy
        keeps idle pools for no time at all."""
        usage = pool_usage(self._fd)
        if usage is None or usage.pids or not _names(self._fd, self.path):
            return
        _write_life(self._mm, usage.keep_idle_s, time.time())
        if usage.keep_idle_s == 0:
            self.path.unlink(missing_ok=True)

    def destroy(self) -> None:
        """Detach and remove the pool from the node (every attached process keeps its mapping until it exits)."""
        self.close()
        self.path.unlink(missing_ok=True)

    def __enter__(self) -> SharedChunkPool:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
