"""Bytes, latency and queue depth per (tier, class): what the Prometheus exporter and the planner read."""

from __future__ import annotations

import threading
from collections import deque
from dataclasses import dataclass, field

import numpy as np


@dataclass
class ClassStats:
    ops: int = 0
    bytes: int = 0
    errors: int = 0
    cancelled: int = 0
    expired: int = 0
    joined: int = 0  # ops that moved nothing: another reader (thread or process) had moved the bytes first
    seconds: float = 0.0
    queued: int = 0
    running: int = 0
    max_queued: int = 0
    max_running: int = 0  # the most ops of this class in flight at once (serial reads: 1)
    recent_latency: deque = field(default_factory=lambda: deque(maxlen=2048))

    def snapshot(self) -> dict:
        lat = np.asarray(self.recent_latency) if self.recent_latency else np.zeros(1)
        return {
            "ops": self.ops,
            "bytes": self.bytes,
            "errors": self.errors,
            "cancelled": self.cancelled,
            "expired": self.expired,
            "joined": self.joined,
            "busy_seconds": round(self.seconds, 6),
            "queued": self.queued,
            "running": self.running,
            "max_queued": self.max_queued,
            "max_running": self.max_running,
            "latency_p50_s": float(np.percentile(lat, 50)),
            "latency_p99_s": float(np.percentile(lat, 99)),
            "gbps": self.bytes / self.seconds / 1e9 if self.seconds else 0.0,
        }


class IOStats:
    """Thread-safe counters keyed by (tier name, class name)."""

    def __init__(self):
        self._lock = threading.Lock()
        self._stats: dict[tuple[str, str], ClassStats] = {}

    def _get(self, tier: str, cls: str) -> ClassStats:
        key = (tier, cls)
        if key not in self._stats:
            self._stats[key] = ClassStats()
        return self._stats[key]

    def queued(self, tier: str, cls: str, delta: int) -> None:
        with self._lock:
            s = self._get(tier, cls)
            s.queued += delta
            s.max_queued = max(s.max_queued, s.queued)

    def started(self, tier: str, cls: str) -> None:
        with self._lock:
            s = self._get(tier, cls)
            s.queued -= 1
            s.running += 1
            s.max_running = max(s.max_running, s.running)

    def finished(self, tier: str, cls: str, nbytes: int, seconds: float, ok: bool) -> None:
        with self._lock:
            s = self._get(tier, cls)
            s.running -= 1
            s.ops += 1
            s.seconds += seconds
            if ok:
                s.bytes += nbytes
                s.recent_latency.append(seconds)
            else:
                s.errors += 1

    def joined(self, tier: str, cls: str) -> None:
        """An op ended without moving anything (not an I/O: no bytes, no op, no latency sample)."""
        with self._lock:
            s = self._get(tier, cls)
            s.running -= 1
            s.joined += 1

    def dropped(self, tier: str, cls: str, reason: str) -> None:
        with self._lock:
            s = self._get(tier, cls)
            s.queued -= 1
            if reason == "expired":
                s.expired += 1
            else:
                s.cancelled += 1

    def queue_depth(self, tier: str) -> int:
        with self._lock:
            return sum(s.queued + s.running for (t, _), s in self._stats.items() if t == tier)

    def snapshot(self) -> dict:
        with self._lock:
            return {f"{t}/{c}": s.snapshot() for (t, c), s in sorted(self._stats.items())}

    def totals(self) -> dict[str, dict[str, float]]:
        """The cumulative counts per "tier/cls" (no percentiles: cheap enough to read every engine step)."""
        with self._lock:
            return {
                f"{t}/{c}": {"bytes": s.bytes, "ops": s.ops, "busy_seconds": s.seconds, "errors": s.errors,
                             "cancelled": s.cancelled}
                for (t, c), s in self._stats.items()
            }  # fmt: skip
