"""Fault the model's host memory in ahead of the copies into it, on a background thread.

Why: a CPU model's parameters are allocated untouched (torch.empty), so the first write into each 4 KiB page
faults and zeroes it, inside vLLM's copy of every tensor: copying 2 GB into fresh memory took 1.1-1.5 s here
against 0.45-0.56 s into memory already faulted in. The copies run on the loading thread, after the bytes land;
the faults do not need the bytes, so a second thread takes them (MADV_POPULATE_WRITE, which never changes what a
page holds) while the first blocks are still being read. Parameters are walked in model order, which is
roughly checkpoint order, so the pages the next copies need are faulted first.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterable, Iterator

from kvprefetch.tiers.memory import PAGE, populate

STEP = 4 << 20
"""Bytes per madvise call. Small because the call holds the process's mmap lock: every mmap and thread start of
the load (the reader's I/O threads, its shard buffers) waits for the call in progress, and the page faults behind
such a writer wait too. With 64 MiB calls the reader's start took 0.1-0.19 s instead of 2 ms; with 4 MiB,
0.03-0.05 s."""


def host_ranges(tensors: Iterable) -> list[tuple[int, int]]:
    """(page-aligned start, length) of each distinct CPU tensor's storage, in order (shared storage once)."""
    seen: set[int] = set()
    out = []
    for t in tensors:
        if t.device.type != "cpu" or t.numel() == 0:
            continue
        storage = t.untyped_storage()
        ptr, nbytes = storage.data_ptr(), storage.nbytes()
        if ptr in seen:
            continue
        seen.add(ptr)
        start, end = -(-ptr // PAGE) * PAGE, (ptr + nbytes) // PAGE * PAGE
        if end > start:
            out.append((start, end - start))
    return out


def _populate(ranges: list[tuple[int, int]], stop: threading.Event) -> None:
    for start, length in ranges:  # (populate releases the GIL for the call: the loading thread runs meanwhile)
        for off in range(0, length, STEP):
            if stop.is_set():
                return
            if not populate(start + off, min(STEP, length - off)):
                return  # an old kernel (EINVAL) or memory it will not populate: the copies fault as before


@contextlib.contextmanager
def prefaulted(tensors: Iterable) -> Iterator[None]:
    """Populate the tensors' host pages on a background thread while the block runs; stopped when it exits."""
    ranges = host_ranges(tensors)
    if not ranges:
        yield
        return
    stop = threading.Event()
    thread = threading.Thread(target=_populate, args=(ranges, stop), name="kvprefetch-prefault", daemon=True)
    thread.start()
    try:
        yield
    finally:
        stop.set()
        thread.join()
