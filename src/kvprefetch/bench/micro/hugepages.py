"""Temporarily reserved huge pages, for the benchmark's huge-page buffer rows (root only; restored after)."""

from __future__ import annotations

import contextlib
import os
from pathlib import Path

NR = Path("/proc/sys/vm/nr_hugepages")
FREE = Path("/sys/kernel/mm/hugepages/hugepages-2048kB/free_hugepages")
SURPLUS = Path("/sys/kernel/mm/hugepages/hugepages-2048kB/surplus_hugepages")
PAGE = 2 << 20


def _read(path: Path) -> int:
    try:
        return int(path.read_text())
    except (OSError, ValueError):
        return 0


def _target(need: int, free: int) -> int:
    """The vm.nr_hugepages that leaves `need` pages free. Surplus pages count: they are in use (by overcommit,
    or left in use by another process when an earlier reservation was undone under it), and raising
    nr_hugepages turns them into persistent pages before it allocates any new one, so a target of
    `nr_hugepages + need - free` comes out short by exactly the surplus (CI's store tests found no huge pages
    after the loader's tests had left some in use this way)."""
    return _read(NR) + _read(SURPLUS) + need - free


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
        NR.write_text(str(_target(need, free)))
        if _read(FREE) < need:  # fragmented memory: free the page cache, compact, try once more
            Path("/proc/sys/vm/drop_caches").write_text("1")
            Path("/proc/sys/vm/compact_memory").write_text("1")
            NR.write_text(str(_target(need, _read(FREE))))
    except OSError:
        yield False
        return
    try:
        yield _read(FREE) >= need
    finally:
        with contextlib.suppress(OSError):
            NR.write_text(str(before))
