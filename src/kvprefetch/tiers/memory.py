"""Host-memory primitives for the tiers: copies that leave the interpreter lock free, and page-table population.

Why `copy_bytes`: a slice assignment between buffers (``dst[:] = src``) copies while holding the GIL, so the I/O
threads' copies (DRAM slot to caller, caller to slot, staging buffer to destination) take turns instead of using
every core, and every other Python thread (the scheduler, a loading thread) waits behind them. numpy's copy
releases the lock: eight threads copying 8 MiB blocks moved 4.8 GB/s with slice assignment and 8.8 GB/s with
`copy_bytes` on our 2-core VM (one thread: 5.1 vs 5.0).

Why `populate`: the first touch of each 4 KiB page of a mapping faults, and when many threads fault pages of one
shared mapping at once they contend in the kernel: eight threads copying 2 GB out of a freshly attached DRAM pool
spent 1.9 s in the kernel (1.35 s wall), against 0.6 s (0.73 s wall) when each thread first populated its slot's
pages with one `madvise(MADV_POPULATE_WRITE)` call.

Why `map_file_over`: a block that already lies in a shared-memory file (a DRAM pool slot) can be put into a
buffer by mapping the file's pages there instead of copying them: the buffer's readers then read the pool's own
pages. Copying 2 GB of weights out of the pool into shard buffers, on two cores, next to vLLM's own copy into the
parameters and the faults of 2 GB of fresh buffer pages, made a load from the node's DRAM slower than one from
the local disk (kvprefetch.loader.cache).
"""

from __future__ import annotations

import ctypes
import errno
import logging

import numpy as np

log = logging.getLogger(__name__)

MADV_POPULATE_READ = 22  # Linux 5.14
MADV_POPULATE_WRITE = 23
PAGE = 4096
_PROT_READ, _PROT_WRITE = 1, 2
_MAP_PRIVATE, _MAP_FIXED, _MAP_ANONYMOUS = 0x02, 0x10, 0x20


class Segments:
    """One chunk's bytes laid out in several runs of memory, in order: a page of SGLang's host KV pool, whose K and
    V halves (or each layer's K and V) lie apart in the pool. `copy_bytes` scatters a chunk into it and gathers one
    from it, so a chunk goes between a DRAM slot and the engine's memory in one pass, with no staging copy.

    Invariant: the runs are flat writable byte views and never overlap; `len` is their total bytes, as a buffer's."""

    __slots__ = ("nbytes", "runs")

    def __init__(self, runs) -> None:
        self.runs: tuple[memoryview, ...] = tuple(runs)
        if not all(isinstance(r, memoryview) and r.ndim == 1 and r.format == "B" for r in self.runs):
            raise TypeError("Segments holds flat byte memoryviews")
        self.nbytes = sum(r.nbytes for r in self.runs)

    def __len__(self) -> int:
        return self.nbytes


def copy_bytes(dst, src) -> None:
    """Copy src's bytes into dst (equal lengths; any buffers exposing bytes, or `Segments` on either side),
    without holding the GIL."""
    if isinstance(dst, Segments) or isinstance(src, Segments):
        _copy_runs(dst, src)
        return
    np.copyto(np.frombuffer(dst, np.uint8), np.frombuffer(src, np.uint8))


def _copy_runs(dst, src) -> None:
    """Scatter (dst in runs) or gather (src in runs): each run against the flat side's bytes at the same offset."""
    if len(dst) != len(src):
        raise ValueError(f"copy of {len(src)} B into {len(dst)} B")
    if isinstance(dst, Segments) and isinstance(src, Segments):
        src = _gathered(src)
    runs, flat, scatter = (dst.runs, src, True) if isinstance(dst, Segments) else (src.runs, dst, False)
    flat = np.frombuffer(flat, np.uint8)
    at = 0
    for run in runs:
        part = flat[at : at + run.nbytes]
        if scatter:
            np.copyto(np.frombuffer(run, np.uint8), part)
        else:
            np.copyto(part, np.frombuffer(run, np.uint8))
        at += run.nbytes


def _gathered(src: Segments) -> memoryview:
    out = bytearray(len(src))
    _copy_runs(memoryview(out), src)
    return memoryview(out)


def _load_madvise():
    try:
        fn = ctypes.CDLL(None, use_errno=True).madvise
    except (OSError, AttributeError):
        return None
    fn.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    fn.restype = ctypes.c_int
    return fn


_madvise = _load_madvise()  # ctypes releases the GIL for the call


def _load_mmap():
    try:
        fn = ctypes.CDLL(None, use_errno=True).mmap
    except (OSError, AttributeError):
        return None
    fn.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
    fn.restype = ctypes.c_void_p
    return fn


_mmap = _load_mmap()


def populate(start: int, length: int, advice: int = MADV_POPULATE_WRITE) -> bool:
    """Map the pages of [start, start + length) now (rounded out to whole pages), as one kernel call; False where
    the kernel cannot (before 5.14: EINVAL; a read-only mapping asked for write), and nothing changes then:
    the pages fault in on first touch as before. What the pages hold is never changed."""
    if _madvise is None or length <= 0:
        return False
    lo = start // PAGE * PAGE
    if _madvise(lo, start + length - lo, advice) != 0:
        log.debug("madvise(%d) failed (errno %d): pages fault in on first touch", advice, ctypes.get_errno())
        return False
    return True


class MapError(OSError):
    """A range could neither be mapped onto a file nor given back its anonymous memory: it is unusable."""


def map_file_over(start: int, length: int, fd: int, offset: int) -> bool:
    """Make [start, start + length) of this process's memory show fd's bytes [offset, offset + length): a private
    (copy-on-write) mapping of the file replaces whatever was mapped there, and its pages are mapped now
    (MADV_POPULATE_READ), so reading them takes no fault and no copy, and a write copies only the page written:
    the file never changes through this range. The range keeps its addresses, so views of the old mapping
    (a Python mmap, tensors over it) see the file from now on.

    start, length and offset must be multiples of the file's page size. Returns False, and leaves the range
    anonymous, writable and zero-filled, where the kernel maps or populates nothing (then read the bytes into it
    instead); raises MapError if even that cannot be restored. Undo with `privatize` or by unmapping the range.
    """
    if _mmap is None or _madvise is None or length <= 0 or start % PAGE or length % PAGE or offset % PAGE:
        return False
    got = _mmap(start, length, _PROT_READ | _PROT_WRITE, _MAP_PRIVATE | _MAP_FIXED, fd, offset)
    if got == start and _madvise(start, length, MADV_POPULATE_READ) == 0:
        return True
    err = ctypes.get_errno()
    log.debug("mapping a file over %d bytes failed (errno %d): copying instead", length, err)
    if got != start and err == errno.EINVAL:  # refused before anything changed (e.g. inside a huge-page mapping)
        return False
    back = _mmap(start, length, _PROT_READ | _PROT_WRITE, _MAP_PRIVATE | _MAP_FIXED | _MAP_ANONYMOUS, -1, 0)
    if back != start:
        raise MapError(ctypes.get_errno(), f"could not restore {length} bytes of memory at {start:#x}")
    return False


def privatize(start: int, length: int) -> bool:
    """Give [start, start + length) (mapped by `map_file_over`) a private copy of every page now, so it no longer
    depends on the file: for a buffer whose bytes must outlive the file's contents (the pool slot may be reused
    once unpinned). One kernel call (MADV_POPULATE_WRITE breaks copy-on-write page by page); False if refused."""
    return populate(start, length, MADV_POPULATE_WRITE)


def address_of(buffer) -> int:
    """The address of a buffer's first byte (writable or not; the export is released before returning)."""
    return int(np.frombuffer(buffer, np.uint8, count=1).ctypes.data)
