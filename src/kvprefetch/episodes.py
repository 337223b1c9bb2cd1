"""A failure logged once per episode: not once per chunk, and not only once per process either.

A damaged disk or a shared store going down fails every chunk that touches it, often hundreds a second; a line per
chunk buries the log. Logging a cause only the first time a process meets it (what the connector did before)
hides the next outage of the same kind, hours later, completely. An *episode* is a run of failures of one cause
with no gap longer than `quiet_s`: its first failure is logged, the rest are counted, and the line that opens the
next episode says how many the last one had. A cause that never stops failing is logged again every `remind_s`.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

QUIET_S = 30.0
REMIND_S = 600.0


@dataclass
class _Cause:
    last_seen: float
    last_logged: float
    unlogged: int = 0


class EpisodeLog:
    """`warn(cause, msg, *args)` logs msg at WARNING when it opens an episode of `cause`; thread-safe."""

    def __init__(
        self,
        logger: logging.Logger,
        quiet_s: float = QUIET_S,
        remind_s: float = REMIND_S,
        clock: Callable[[], float] = time.monotonic,
    ):
        self.logger, self.quiet_s, self.remind_s, self.clock = logger, quiet_s, remind_s, clock
        self._lock = threading.Lock()
        self._causes: dict[str, _Cause] = {}

    def opens_episode(self, cause: str) -> tuple[bool, int]:
        """Record one failure of `cause`: whether it is to be logged, and how many went unlogged before it."""
        now = self.clock()
        with self._lock:
            c = self._causes.get(cause)
            if c is not None and now - c.last_seen <= self.quiet_s and now - c.last_logged < self.remind_s:
                c.last_seen = now
                c.unlogged += 1
                return False, 0
            before = c.unlogged if c is not None else 0
            self._causes[cause] = _Cause(last_seen=now, last_logged=now)
            return True, before

    def warn(self, cause: str, msg: str, *args: object) -> bool:
        """Log `msg % args` if this failure opens an episode of `cause` (True when it did)."""
        log_it, before = self.opens_episode(cause)
        if log_it:
            more = f" [{before} more of this cause since its last line]" if before else ""
            self.logger.warning(msg + "%s", *args, more)
        return log_it
