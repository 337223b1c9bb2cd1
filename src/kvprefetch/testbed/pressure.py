"""Other traffic on the node's DRAM tier, for the agent bench: what keeps an unleased session head from lasting
through its tool call.

On a busy node the DRAM pool is shared by every engine there and written all the time (their saves, their
reads from disk); under LRU an unpinned chunk then lasts about (unpinned DRAM) / (write rate) after its last
use. Computing that traffic would take the CPU the bench measures on (two cores here), so `DramPressure` applies
its effect instead: every unpinned chunk not used for `life_s` is dropped from the pool, as the others' writes
would push it out. Pinned chunks (a queued request's prefetch, a lease, a write-back in progress) stay, as they
do under LRU. Declared with the results; `life_s` is the knob (`kvprefetch bench --dram-life-s`).
"""

from __future__ import annotations

import threading
import time
from typing import Any

POLL_S = 0.05


class DramPressure:
    """A thread that drops the pool's chunks idle and unpinned for longer than `life_s` (bounded: it stops when
    asked, or after `max_s`)."""

    def __init__(self, pool: Any, life_s: float, max_s: float = 3600.0):
        self.pool, self.life_s, self.max_s = pool, life_s, max_s
        self.dropped = 0
        self._last_tick: dict[bytes, tuple[int, float]] = {}  # key -> (tick seen, when it was first seen)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="bench-dram-pressure", daemon=True)

    def start(self) -> DramPressure:
        self._thread.start()
        return self

    def stop(self) -> int:
        """Stop and return how many chunks it dropped."""
        self._stop.set()
        self._thread.join(timeout=5)
        return self.dropped

    def _run(self) -> None:
        end = time.monotonic() + self.max_s
        while not self._stop.wait(POLL_S) and time.monotonic() < end:
            self.dropped += len([k for k in self.idle_keys(time.monotonic()) if self.pool.discard(k)])

    def idle_keys(self, now: float) -> list[bytes]:
        """Unpinned chunks whose LRU tick has not moved for life_s (a use or a rewrite moves it)."""
        ticks = self.pool.unpinned_ticks()
        seen = {}
        for key, tick in ticks.items():
            prev = self._last_tick.get(key)
            seen[key] = prev if prev is not None and prev[0] == tick else (tick, now)
        self._last_tick = seen
        return [k for k, (_, since) in seen.items() if now - since >= self.life_s]
