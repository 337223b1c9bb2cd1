"""A fake store for the scheduler side's tests: reads that finish when the test says so."""

from __future__ import annotations

from types import SimpleNamespace


class FakeHandle:
    """`PrefetchHandle`'s API over reads that finish when the test says so."""

    def __init__(self, reads):
        self.reads = list(reads)
        self.finished = False
        self.landed: list[bytes] = []
        self.callbacks = []

    @property
    def num_reads(self):
        return len(self.reads)

    def pending(self):
        return 0 if self.finished else len(self.reads) - len(self.landed)

    def cancel(self, keys=None):
        return 0 if self.finished else len(self.reads if keys is None else [k for k in keys if k in self.reads])

    def on_ready(self, callback):
        self.callbacks.append(callback)

    def land(self, key):
        """One read finishes (as an I/O thread reports it)."""
        self.landed.append(key)
        for callback in self.callbacks:
            callback(key, True)

    def wait(self, timeout=None):
        return self.finished

class FakeStore:
    def __init__(self):
        self.tiers: dict[bytes, str] = {}
        self.handles: list[FakeHandle] = []
        self.pins: list[bytes] = []

    def lookup(self, keys):
        out = []
        for k in keys:
            if k not in self.tiers:
                break
            out.append(self.tiers[k])
        return SimpleNamespace(tiers=out, num_hit_chunks=len(out))

    def prefetch(self, keys, to=None, deadline=None):
        h = FakeHandle([k for k in keys if self.tiers.get(k) == "disk"])
        self.handles.append(h)
        return h

    def measure_reads(self, keys):
        return self.prefetch(keys)

    def pin(self, keys):
        self.pins += keys
        return [self.tiers.get(k) == "dram" for k in keys]

    def unpin(self, keys):
        for k in keys:
            self.pins.remove(k)

    def writing(self, key):
        return False

    def in_dram(self, keys):
        return [self.tiers.get(k) == "dram" for k in keys]
