"""Named crash points: the steps of a write where a test may SIGKILL this process, to prove each is crash-safe.

Every step of put, allocate/commit, write-back, eviction and recovery that leaves shared state (the DRAM
pool's slot table, files in the disk tier, values in the remote tier) calls `crash_point(name)`, and POINTS
says what a kill there leaves behind. A test arms one point in a child process with the environment variable
KVPREFETCH_CRASH_AT=name[:nth]: the nth time that process reaches the point (default the first), it kills
itself with SIGKILL, as the OOM killer or an operator would, with no cleanup of any kind. Unarmed (always, in
production) a point costs one comparison against None.

Why a hook rather than random timing: a kill at a random moment lands in the wide windows (copies, I/O) and
almost never in the narrow ones between two stores to the slot table, which is where the bugs were.
"""

from __future__ import annotations

import os
import signal
import threading

ENV = "KVPREFETCH_CRASH_AT"

POINTS: dict[str, str] = {
    # DRAM slot lifecycle (tiers/dram.py)
    "dram.allocate.pinned": "the writer's pin is on the chosen slot; the slot still holds its old state and key",
    "dram.allocate.writing": "the slot is WRITING (pinned by its writer), still under its old key",
    "dram.allocate.key_published": "the new key is on the WRITING slot; no payload yet",
    "dram.commit.ready": "the slot is READY, the writer's pin not yet dropped",
    "dram.acquire.pinned": "a reader's pin is on a READY slot (a reader killed mid-copy leaks it)",
    "dram.reap.rows_cleared": "the reaper cleared dead processes' pins and rows; their WRITING slots not yet freed",
    # store (store.py)
    "store.put.payload_copied": "the payload is in the WRITING slot, the header not yet written",
    "store.put.header_written": "the slot image is whole, not yet committed",
    "store.put.queued": "the slot is READY and its write-back queued; the save is not acknowledged",
    "store.writeback.written": "the chunk's file is committed; the write-back's pin on the slot not yet released",
    "store.promote.read": "a promotion read the image into its WRITING slot, not yet committed",
    "store.remote_write.sending": "a write-through to the remote tier is about to be sent",
    "store.remote_write.acked": "the remote acknowledged the value; the slot pin not yet released",
    # disk tier (tiers/disk.py)
    "disk.write.temp_written": "the temp file holds the whole image, not yet fsynced",
    "disk.write.temp_synced": "the temp file is fsynced, not yet renamed",
    "disk.write.renamed": "the file is renamed into place, the directory not yet fsynced",
    "disk.evict.unindexed": "eviction dropped a file from the index, not yet unlinked",
    "disk.recover.temp_removed": "recovery removed a dead writer's temp file, the index not yet rebuilt",
}


def _parse(spec: str | None) -> tuple[str, int] | None:
    if not spec:
        return None
    name, _, nth = spec.partition(":")
    if name not in POINTS:
        raise ValueError(f"{ENV}={spec!r}: no crash point {name!r} (known: {', '.join(sorted(POINTS))})")
    count = int(nth) if nth else 1
    if count < 1:
        raise ValueError(f"{ENV}={spec!r}: nth must be >= 1")
    return name, count


_ARMED = _parse(os.environ.get(ENV))
_lock = threading.Lock()
_reached = 0


def arm(spec: str | None) -> None:
    """Arm (or with None disarm) a point in this process, as KVPREFETCH_CRASH_AT does at import: for a child
    forked from a test process that imported kvprefetch already."""
    global _ARMED, _reached
    with _lock:
        _ARMED, _reached = _parse(spec), 0


def crash_point(name: str) -> None:
    """SIGKILL this process here if the test armed this point and this is its nth arrival; else nothing."""
    if _ARMED is None or _ARMED[0] != name:
        return
    global _reached
    with _lock:
        _reached += 1
        if _reached >= _ARMED[1]:
            os.kill(os.getpid(), signal.SIGKILL)
