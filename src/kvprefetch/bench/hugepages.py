"""Temporarily reserved huge pages, for the benchmark's huge-page buffer rows (root only; restored after)."""

from __future__ import annotations

import contextlib
import os
from pathlib import Path

NR = Path("/proc/sys/vm/nr_hugepages")
FREE = Path("/sys/kernel/mm/hugepages/hugepages-2048kB/free_hugepages")
PAGE = 2 << 20


def _read(path: Path) -> int:
    try:
        return int(path.read_text())
    except (OSError, ValueError):
        return 0


@contextlib.contextmanager
def reserved_huge_pages(nbytes: int):
    """Yield True if at least nbytes of 2 MiB pages are free (reserving more if root may), else False."""
    need = -(-nbytes // PAGE)
    free = _read(FREE)
    if free >= need:
        yield True
        return
    before = _read(NR)
    if os.geteuid() != 0:
        yield False
        return
    try:
        NR.write_text(str(before + need - free))
        if _read(FREE) < need:  # fragmented memory: free the page cache, compact, try once more
            Path("/proc/sys/vm/drop_caches").write_text("1")
            Path("/proc/sys/vm/compact_memory").write_text("1")
            NR.write_text(str(before + need - free))
    except OSError:
        yield False
        return
    try:
        yield _read(FREE) >= need
    finally:
        with contextlib.suppress(OSError):
            NR.write_text(str(before))
