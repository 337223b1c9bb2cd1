"""Local NVMe/disk tier: one file per chunk, written atomically, verified on every read.

Why one file per chunk: a chunk is large (hundreds of KiB to tens of MiB), so per-file overhead is small
(see `kvprefetch iobench`), and the file system gives us for free what segment files would need a log for:
an atomic commit (write a temp file, fsync, rename), eviction by unlink, safe sharing between processes,
and an index rebuilt on restart by listing the directory. A crash can leave only a temp file, which recovery
removes; a committed file carries its key and checksums, so a torn, truncated, flipped or foreign file reads
as a miss and is removed, never returned.

The files are as private as the prompts they were computed from (see `tiers.access`): chunk files 0600 and
directories 0700 whatever the umask, or group-shared when configured; a file this tier did not write (another
user's, or one others may write) is never trusted, never read and never removed, only counted and logged once.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import mmap
import os
import re
import threading
from collections import OrderedDict
from pathlib import Path

from kvprefetch.crashpoints import crash_point
from kvprefetch.episodes import EpisodeLog
from kvprefetch.tiers.access import PRIVATE, FileAccess
from kvprefetch.tiers.chunk_format import (
    ALIGN,
    HEADER_BYTES,
    ChunkHeader,
    CorruptChunk,
    image_bytes,
    verify_image,
)
from kvprefetch.tiers.dram import pid_alive
from kvprefetch.tiers.inflight import InflightBytes
from kvprefetch.tiers.staging import StagingBuffers, staged_read

log = logging.getLogger(__name__)

_CHUNK_NAME = re.compile(r"^[0-9a-f]{64}\.kv$")
_TEMP_NAME = re.compile(r"^\.([0-9a-f]{64})\.(\d+)\.(\d+)\.tmp$")
_NO_SPACE = {errno.ENOSPC, errno.EDQUOT, errno.EFBIG}


class DiskFullError(OSError):
    """The disk tier could not write a chunk for lack of space; nothing partial was left behind."""


class ChunkMissing(KeyError):
    """The chunk is not (or no longer) on disk."""


class ForeignChunk(ChunkMissing):
    """A file under the chunk's name that this tier did not write (another owner, or writable by others):
    a miss, and left where it is."""


def chunk_files(root: str | os.PathLike) -> list[tuple[bytes, Path]]:
    """(key, file) of every chunk under a disk tier's directory, in key order, read from the directory alone:
    no tier is opened, so nothing is recovered, tightened or evicted (for tools that look at, or copy, a tier
    another process owns). Names that are not chunk names are left out, as the tier leaves them."""
    out = []
    base = Path(root)
    for sub in sorted(base.iterdir()) if base.is_dir() else []:
        if len(sub.name) != 2 or not sub.is_dir() or sub.is_symlink():
            continue
        out += [(bytes.fromhex(f.name[:64]), f) for f in sorted(sub.iterdir()) if _CHUNK_NAME.match(f.name)]
    return out


def chunk_keys(root: str | os.PathLike) -> list[bytes]:
    """The keys of every chunk under a disk tier's directory, in key order (`chunk_files`)."""
    return [key for key, _ in chunk_files(root)]


def link_tree(src: str | os.PathLike, dst: str | os.PathLike) -> int:
    """A second disk tier directory holding the same chunks as `src`, as hard links; returns how many.

    Cheap and safe to diverge: the tier writes a chunk by renaming a new file over its name and deletes by
    unlinking, never in place, so a change on either side never shows through the link on the other."""
    dst = Path(dst)
    dst.mkdir(parents=True, exist_ok=True)
    n = 0
    for _, f in chunk_files(src):
        (dst / f.parent.name).mkdir(exist_ok=True)
        os.link(f, dst / f.parent.name / f.name)
        n += 1
    return n


def aligned_buffer(nbytes: int) -> memoryview:
    """Page-aligned anonymous memory, as O_DIRECT needs."""
    return memoryview(mmap.mmap(-1, max(ALIGN, nbytes)))[:nbytes]


class DiskTier:
    """Chunks as files under root/<first byte>/<key>.kv, with an LRU index and a byte capacity."""

    def __init__(
        self,
        root: str | os.PathLike,
        capacity_bytes: int,
        direct_io: bool = True,
        fsync: bool = True,
        staging: StagingBuffers | None = None,
        read_inflight_bytes: int | None = None,
        access: FileAccess = PRIVATE,
    ):
        self.root = Path(root)
        self.access = access
        self.staging = staging
        self.read_gate = InflightBytes(read_inflight_bytes) if read_inflight_bytes else None
        self.capacity_bytes = int(capacity_bytes)
        self.direct_io = direct_io and hasattr(os, "O_DIRECT")
        self.fsync = fsync
        self._lock = threading.Lock()
        self._index: OrderedDict[bytes, int] = OrderedDict()  # key -> file bytes, LRU first
        self.used_bytes = 0
        self.counters = {"corrupt": 0, "foreign": 0, "temp_removed": 0, "evicted": 0, "write_errors": 0}
        self._foreign_seen: set[str] = set()
        self._reported: set[str] = set()
        self._episodes = EpisodeLog(log)
        try:
            self.root.parent.mkdir(parents=True, exist_ok=True)
            access.make_dir(self.root)
            self._check_dir(self.root)
            probe = self.root / f".probe.{os.getpid()}"
            probe.write_bytes(b"")
            probe.unlink()
        except OSError as err:
            raise OSError(err.errno, f"disk tier directory {self.root} is not usable: {err.strerror}") from None
        self.recover()

    # ---- paths -------------------------------------------------------------------------------------------
    def keys(self) -> list[bytes]:
        """The keys this tier holds (its index), least recently used first."""
        with self._lock:
            return list(self._index)

    def path_of(self, key: bytes) -> Path:
        hexkey = key.hex()
        return self.root / hexkey[:2] / f"{hexkey}.kv"

    # ---- recovery ----------------------------------------------------------------------------------------
    def recover(self) -> int:
        """Rebuild the index from the directory; remove temp files of dead writers and damaged files.

        Directories are brought to the configured mode (tightened where this user owns them, reported
        where not), and so are this user's chunk files; files this tier did not write are skipped.
        """
        found: list[tuple[float, bytes, int]] = []
        tightened = 0
        for sub in os.scandir(self.root):
            if not sub.is_dir(follow_symlinks=False) or len(sub.name) != 2:
                if not sub.name.startswith("."):
                    self._foreign(Path(sub.path), "not a chunk name")
                continue
            self._check_dir(Path(sub.path))
            for entry in os.scandir(sub):
                name = entry.name
                if _CHUNK_NAME.match(name):
                    st = entry.stat(follow_symlinks=False)
                    if (why := self.access.distrust(st)) is not None:
                        self._foreign(Path(entry.path), why)
                        continue
                    tightened += self.access.tighten_file(Path(entry.path), st)
                    if st.st_size < HEADER_BYTES or st.st_size % ALIGN:
                        self._remove(Path(entry.path), "corrupt", f"size {st.st_size} is not a chunk image")
                        continue
                    found.append((st.st_mtime, bytes.fromhex(name[:64]), st.st_size))
                elif (m := _TEMP_NAME.match(name)) is not None:
                    writer = int(m.group(2))
                    if writer != os.getpid() and not pid_alive(writer):
                        self._remove(Path(entry.path), "temp_removed", "left by a writer that died")
                        crash_point("disk.recover.temp_removed")
                else:
                    self._foreign(Path(entry.path), "not a chunk name")
        if tightened:
            log.warning("disk tier %s: tightened %d chunk files open to other users to %04o", self.root, tightened,
                        self.access.file_mode)  # fmt: skip
        found.sort()
        with self._lock:
            self._index.clear()
            self.used_bytes = 0
            for _, key, size in found:
                self._index[key] = size
                self.used_bytes += size
        if found:
            log.info("disk tier %s: recovered %d chunks (%.1f MiB)", self.root, len(found), self.used_bytes / 2**20)
        self._evict_to(self.capacity_bytes)
        return len(found)

    def _check_dir(self, path: Path) -> None:
        if (finding := self.access.enforce_dir(path)) is not None:
            log.warning("disk tier: %s", finding)

    def _foreign(self, path: Path, why: str) -> None:
        """Count a file this tier did not write, once per file; log the first for each reason; leave it alone."""
        if str(path) in self._foreign_seen:
            return
        self._foreign_seen.add(str(path))
        self.counters["foreign"] += 1
        kind = re.sub(r"\d+", "N", why)
        if kind not in self._reported:
            self._reported.add(kind)
            log.warning("disk tier %s: ignoring foreign file %s (%s); further ones are only counted (foreign in"
                        " its stats)", self.root, path, why)  # fmt: skip

    def _remove(self, path: Path, counter: str, why: str, logged_by_caller: bool = False) -> None:
        """Remove a file this tier cannot serve, counted; logged once per episode unless the reader that found
        it names the failure itself (the store logs a failed load with its tier and cause: one line, not two)."""
        self.counters[counter] += 1
        if not logged_by_caller:
            self._episodes.warn(counter, "disk tier: removing %s: %s (one line per episode; %s counts every file)",
                                path, why, counter)  # fmt: skip
        with contextlib.suppress(FileNotFoundError):
            path.unlink()

    # ---- index -------------------------------------------------------------------------------------------
    def contains(self, key: bytes) -> bool:
        """Whether key is on disk, including chunks another process wrote since we listed the directory."""
        with self._lock:
            if key in self._index:
                return True
        path = self.path_of(key)
        try:
            st = os.stat(path, follow_symlinks=False)
        except FileNotFoundError:
            return False
        if (why := self.access.distrust(st)) is not None:
            self._foreign(path, why)
            return False
        size = st.st_size
        with self._lock:
            if key not in self._index:
                self._index[key] = size
                self.used_bytes += size
        return True

    def present(self, key: bytes) -> bool:
        """Whether key's file is on disk now, asked of the file system: another process (an engine sharing the
        directory, `kvprefetch status --gc`) may have removed it since this process indexed it, which
        `contains` does not see. A file that would not be trusted is not present."""
        try:
            st = os.stat(self.path_of(key), follow_symlinks=False)
        except OSError:
            return False
        return self.access.distrust(st) is None

    def _touch(self, key: bytes) -> None:
        with self._lock:
            if key in self._index:
                self._index.move_to_end(key)

    def _forget(self, key: bytes) -> None:
        with self._lock:
            size = self._index.pop(key, None)
            if size is not None:
                self.used_bytes -= size

    def __len__(self) -> int:
        return len(self._index)

    # ---- reads -------------------------------------------------------------------------------------------
    def read_into(self, key: bytes, image: memoryview, verify: bool = True) -> int:
        """Read key's whole image into `image` (4 KiB aligned for O_DIRECT) and verify it; return payload size.

        Raises ChunkMissing for a missing file, ForeignChunk for one this tier did not write (left in place),
        and CorruptChunk (after removing the file) for a bad one.
        """
        path = self.path_of(key)
        try:
            fd = self._open(path, os.O_RDONLY | os.O_NOFOLLOW)
        except FileNotFoundError:
            self._forget(key)
            raise ChunkMissing(key.hex()) from None
        except OSError as err:
            if err.errno != errno.ELOOP:
                raise
            self._forget(key)
            self._foreign(path, "a symbolic link")
            raise ForeignChunk(key.hex()) from None
        try:
            st = os.fstat(fd)
            if (why := self.access.distrust(st)) is not None:  # on the open file: no race with a swap
                self._forget(key)
                self._foreign(path, why)
                raise ForeignChunk(key.hex())
            size = st.st_size
            if size > len(image):
                raise CorruptChunk(f"file of {size} B larger than the {len(image)} B buffer")
            header = self._read_verified(fd, image[:size], key, verify)
        except CorruptChunk as err:
            self._forget(key)
            self._remove(path, "corrupt", str(err), logged_by_caller=True)
            raise
        finally:
            os.close(fd)
        self._touch(key)
        return header.payload_nbytes

    def _read_verified(self, fd: int, dst: memoryview, key: bytes, verify: bool) -> ChunkHeader:
        """Read the whole file into dst (through a staging buffer when there is one) and verify it there."""

        def check(buf: memoryview, got: int) -> ChunkHeader:
            if got != len(dst):
                raise CorruptChunk(f"short read: {got} of {len(dst)} bytes")
            return verify_image(buf, key, verify_payload=verify)

        return staged_read(fd, dst, 0, self.read_gate, self.staging, check)

    def read_bounce(self, key: bytes, nbytes_hint: int) -> tuple[memoryview, int]:
        """Read into a fresh aligned buffer (for callers with no DRAM slot); return (image, payload size)."""
        buf = aligned_buffer(image_bytes(nbytes_hint))
        return buf, self.read_into(key, buf)

    def _open(self, path: Path, flags: int, mode: int = 0o600) -> int:
        if self.direct_io:
            try:
                return os.open(path, flags | os.O_DIRECT, mode)
            except OSError as err:
                if err.errno != errno.EINVAL:
                    raise
                log.info("disk tier %s: O_DIRECT not supported here, using buffered I/O", self.root)
                self.direct_io = False
        return os.open(path, flags, mode)

    # ---- writes ------------------------------------------------------------------------------------------
    def write(self, key: bytes, image: memoryview) -> None:
        """Write a verified chunk image durably (temp file, fsync, rename, fsync dir); atomic on crash."""
        size = len(image)
        if size > self.capacity_bytes:
            raise DiskFullError(errno.ENOSPC, f"chunk of {size} B exceeds the disk tier capacity")
        self._evict_to(self.capacity_bytes - size)
        final = self.path_of(key)
        self.access.make_dir(final.parent)
        temp = final.parent / f".{key.hex()}.{os.getpid()}.{threading.get_ident()}.tmp"
        try:
            fd = self._open(temp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, self.access.file_mode)
            try:
                self.access.set_fd(fd)
                done = 0
                while done < size:
                    done += os.pwritev(fd, [image[done:]], done)
                crash_point("disk.write.temp_written")
                if self.fsync:
                    os.fdatasync(fd)
                crash_point("disk.write.temp_synced")
            finally:
                os.close(fd)
            os.rename(temp, final)
            crash_point("disk.write.renamed")
            if self.fsync:
                _fsync_dir(final.parent)
        except OSError as err:
            self.counters["write_errors"] += 1
            with contextlib.suppress(FileNotFoundError):
                temp.unlink()
            if err.errno in _NO_SPACE:
                raise DiskFullError(err.errno, f"disk tier {self.root} is full: {err.strerror}") from None
            raise
        with self._lock:
            old = self._index.pop(key, 0)
            self._index[key] = size
            self.used_bytes += size - old

    # ---- eviction ----------------------------------------------------------------------------------------
    def _evict_to(self, limit: int) -> None:
        while True:
            with self._lock:
                if self.used_bytes <= limit or not self._index:
                    return
                key, size = self._index.popitem(last=False)
                self.used_bytes -= size
            crash_point("disk.evict.unindexed")
            with contextlib.suppress(FileNotFoundError):
                self.path_of(key).unlink()
            self.counters["evicted"] += 1

    def delete(self, key: bytes) -> None:
        self._forget(key)
        with contextlib.suppress(FileNotFoundError):
            self.path_of(key).unlink()

    def stats(self) -> dict:
        return {
            "root": str(self.root),
            "chunks": len(self._index),
            "bytes_used": self.used_bytes,
            "capacity_bytes": self.capacity_bytes,
            "direct_io": self.direct_io,
            **self.counters,
        }


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
