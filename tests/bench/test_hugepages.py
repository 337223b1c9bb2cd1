"""`reserved_huge_pages` against the kernel's real huge-page pool, with pages another holder keeps in use."""

from __future__ import annotations

import mmap
import os

import pytest

from kvprefetch.bench.micro.hugepages import FREE, NR, PAGE, SURPLUS, reserved_huge_pages

pytestmark = pytest.mark.skipif(
    os.geteuid() != 0 or not NR.exists() or not hasattr(os, "MFD_HUGETLB"), reason="needs root and hugetlb"
)


def _hold(pages: int) -> mmap.mmap:
    fd = os.memfd_create("kvprefetch-test-hold", os.MFD_HUGETLB)
    try:
        os.ftruncate(fd, pages * PAGE)
        buf = mmap.mmap(fd, pages * PAGE)
    finally:
        os.close(fd)
    for off in range(0, pages * PAGE, PAGE):
        buf[off] = 1
    return buf


def test_a_reservation_counts_pages_left_in_use_as_surplus():
    """Pages still in use when their reservation is undone stay as surplus pages; the next reservation must
    still leave the pages it asked for free (it came out short by the surplus and reported none before)."""
    before = int(NR.read_text())
    held = None
    try:
        NR.write_text(str(before + 4))
        if int(FREE.read_text()) < 4:
            pytest.skip("the kernel could not allocate 4 huge pages")
        held = _hold(4)
        NR.write_text(str(before))  # undone under the holder: its 4 pages become surplus
        assert int(SURPLUS.read_text()) >= 4
        with reserved_huge_pages(8 * PAGE) as ok:
            assert ok
            assert int(FREE.read_text()) >= 8
        assert int(NR.read_text()) == before  # restored (the held pages are surplus again)
    finally:
        if held is not None:
            held.close()
        NR.write_text(str(before))
    assert int(SURPLUS.read_text()) == 0
