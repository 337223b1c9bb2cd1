"""Huge-page staging buffers for disk reads.

Why: on a virtualised block device the host copies each read into guest memory, and that copy runs fastest
into a small, reused (cache-hot) buffer backed by huge pages. Reading a chunk into such a buffer, verifying it
there while it is hot and then copying it into its DRAM slot measured 15-30% faster here than reading straight
into a pool-sized footprint (`kvprefetch iobench`: the parallel row vs "no staging"). Staging buffers on 4 KiB pages
were slower than no staging, so without free huge pages there is none and reads go straight to the slot.
"""

from __future__ import annotations

import contextlib
import logging
import mmap
import os
import threading
from collections.abc import Callable, Iterator
from typing import TypeVar

from kvprefetch.tiers.chunk_format import align_up
from kvprefetch.tiers.inflight import InflightBytes
from kvprefetch.tiers.memory import copy_bytes

log = logging.getLogger(__name__)

T = TypeVar("T")

HUGE_PAGE = 2 << 20


class StagingBuffers:
    """Up to `max_buffers` huge-page buffers of `nbytes`, lent one per read, most recently returned first."""

    def __init__(self, nbytes: int, max_buffers: int):
        self.nbytes = align_up(nbytes, HUGE_PAGE)
        self.max_buffers = max_buffers
        self._lock = threading.Lock()
        self._free: list[memoryview] = []
        self._maps: list[mmap.mmap] = []
        self.available = hasattr(os, "MFD_HUGETLB")
        self.reads_staged = 0

    def _allocate(self) -> memoryview | None:
        """A new huge-page buffer, or None (and staging off for good) when the node has no free huge pages."""
        try:
            fd = os.memfd_create("kvprefetch-staging", os.MFD_HUGETLB)
            try:
                os.ftruncate(fd, self.nbytes)
                buf = mmap.mmap(fd, self.nbytes)  # a shared hugetlb mapping reserves its pages here, or fails
            finally:
                os.close(fd)
        except OSError as err:
            self.available = False
            log.info("kvprefetch: no huge pages for read staging (%s); disk reads go straight to DRAM slots", err)
            return None
        view = memoryview(buf)
        for offset in range(0, self.nbytes, HUGE_PAGE):  # fault the pages in now, not on the first read
            view[offset] = 0
        self._maps.append(buf)
        return view

    @contextlib.contextmanager
    def lend(self, nbytes: int) -> Iterator[memoryview | None]:
        """A staging buffer of at least nbytes for one read, or None: then read straight into the destination."""
        buf = None
        if self.available and nbytes <= self.nbytes:
            with self._lock:
                if self._free:
                    buf = self._free.pop()
                elif len(self._maps) < self.max_buffers:
                    buf = self._allocate()
        if buf is not None:
            self.reads_staged += 1
        try:
            yield None if buf is None else buf[:nbytes]
        finally:
            if buf is not None:
                with self._lock:
                    self._free.append(buf)

    def close(self) -> None:
        with self._lock:
            for view in self._free:
                view.release()
            self._free.clear()
            for buf in self._maps:
                with contextlib.suppress(BufferError):
                    buf.close()
            self._maps.clear()
            self.available = False


def pread_full(fd: int, dst: memoryview, offset: int = 0) -> int:
    """Read into dst from offset until it is full or the file ends; return the bytes read."""
    done = 0
    while done < len(dst):
        n = os.preadv(fd, [dst[done:]], offset + done)
        if n == 0:
            break
        done += n
    return done


def staged_read(
    fd: int,
    dst: memoryview,
    offset: int,
    gate: InflightBytes | None,
    staging: StagingBuffers | None,
    inspect: Callable[[memoryview, int], T],
) -> T:
    """Read len(dst) bytes at offset into dst, through a staging buffer when one is free: the disk read path.

    The staging buffer is taken once the read is admitted, so the read lands in the most recently used
    (hottest) buffer, and the next read is admitted as soon as this one is off the device: `inspect(buf, got)`
    (verification, while the bytes are cache-hot) and the copy into dst overlap it. Returns inspect's result;
    nothing is copied into dst if inspect raises.
    """
    with contextlib.ExitStack() as held:
        admitted = held.enter_context(contextlib.ExitStack())
        if gate is not None:
            admitted.enter_context(gate.admit(len(dst)))
        staged = held.enter_context(staging.lend(len(dst))) if staging is not None else None
        buf = dst if staged is None else staged
        got = pread_full(fd, buf, offset)
        admitted.close()
        result = inspect(buf, got)
        if staged is not None:
            copy_bytes(dst[:got], staged[:got])
        return result
