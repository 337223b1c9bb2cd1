"""A cap on the bytes of device reads in flight at once.

Why: one large read is already several device requests (the kernel splits a 4 MiB read into max_sectors_kb
pieces), and on some devices more reads at once only interleave them and lose bandwidth: on this VM, fio read
4 MiB blocks fastest at iodepth 1, and our disk tier at one 4 MiB read in flight (`kvprefetch iobench` sweeps
the cap and prints the best). Threads beyond the cap still overlap verification and copies with the reads.
NVMe arrays want more in flight; raise `disk.read_inflight_bytes` for them.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator


class InflightBytes:
    """Admits a read when it fits under the cap; a read larger than the cap runs alone."""

    def __init__(self, limit_bytes: int):
        if limit_bytes <= 0:
            raise ValueError(f"limit_bytes must be positive, got {limit_bytes}")
        self.limit_bytes = int(limit_bytes)
        self._cond = threading.Condition()
        self._inflight = 0

    @contextlib.contextmanager
    def admit(self, nbytes: int) -> Iterator[None]:
        with self._cond:
            while self._inflight and self._inflight + nbytes > self.limit_bytes:
                self._cond.wait()
            self._inflight += nbytes
        try:
            yield
        finally:
            with self._cond:
                self._inflight -= nbytes
                self._cond.notify_all()
