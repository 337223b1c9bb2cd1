"""A bandwidth cap for a tier, to put storage in the regime of a target deployment."""

from __future__ import annotations

import threading
import time


class RateLimiter:
    """Models a pipe of fixed bandwidth: transfers queue behind each other, each completes at its turn."""

    def __init__(self, bytes_per_s: float):
        if bytes_per_s <= 0:
            raise ValueError("bytes_per_s must be positive")
        self.bytes_per_s = float(bytes_per_s)
        self._lock = threading.Lock()
        self._free_at = 0.0

    def reserve(self, nbytes: int) -> float:
        """Book nbytes on the pipe; return the monotonic time at which that transfer completes."""
        with self._lock:
            start = max(time.monotonic(), self._free_at)
            self._free_at = start + nbytes / self.bytes_per_s
            return self._free_at


def wait_until(t: float) -> None:
    """Sleep until the monotonic time t (at once if it has passed)."""
    delay = t - time.monotonic()
    if delay > 0:
        time.sleep(delay)
