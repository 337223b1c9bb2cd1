"""Which cores the store's and the connector's threads run on.

On a GPU node the model computes on the accelerator while host cores read, checksum and copy; overlapping the
two is free. A CPU engine binds its model's OpenMP threads to cores of its own (vLLM's CPU build:
``VLLM_CPU_OMP_THREADS_BIND``), and every thread its worker starts afterwards inherits that binding: left alone,
the connector's copies and reads would run on the model's cores and slow its forward pass. `pin_thread` moves
the calling thread to the configured cores (``io.cpus``) when it starts.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Collection


def pin_thread(cpus: Collection[int] | None) -> None:
    """Bind the calling thread (not its process: Linux applies the mask to the caller) to `cpus`; None leaves
    it where it was. Cores beyond the machine's are dropped, and a mask the kernel refuses (none left, or a
    cpuset narrower than the config) leaves the thread where it was: the binding is a placement hint, never a
    reason to fail."""
    if not cpus or not hasattr(os, "sched_setaffinity"):
        return
    allowed = set(cpus) & set(range(os.cpu_count() or 1))
    if allowed:
        with contextlib.suppress(OSError):
            os.sched_setaffinity(0, allowed)


def pinned_initializer(cpus: Collection[int] | None):
    """A ThreadPoolExecutor initializer that pins each of its threads."""
    frozen = tuple(cpus) if cpus else None
    return lambda: pin_thread(frozen)
