"""Closed-loop session admission, shared by the one-engine driver and the two-instance client.

Sessions start in arrival order, at most `concurrency` at once; a session's first turn is due `lead_s` after it
starts (the agent workload's first tool call; default 0), turn k+1 `think_s` after turn k finished, and a session
that ends (or fails) lets the next waiting one start.
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Iterator


class SessionSchedule:
    """Which (session, turn) is due when. Sessions are dicts with `arrival_s` and `turns` (each `think_s`)."""

    def __init__(self, sessions: list[dict], concurrency: int):
        self.sessions, self.concurrency = sessions, concurrency
        self.pending = sorted(range(len(sessions)), key=lambda i: (sessions[i]["arrival_s"], i), reverse=True)
        self.active = 0
        self._due: list[tuple[float, int, int, int]] = []  # (due time, seq, session, turn)
        self._seq = itertools.count()

    def start_sessions(self, now: float) -> list[int]:
        """Admit waiting sessions whose arrival has come, while fewer than `concurrency` are active; the ones
        admitted now."""
        started = []
        while self.pending and self.active < self.concurrency and self.sessions[self.pending[-1]]["arrival_s"] <= now:
            i = self.pending.pop()
            self.active += 1
            start = max(self.sessions[i]["arrival_s"], now)
            heapq.heappush(self._due, (start + float(self.sessions[i].get("lead_s", 0.0)), next(self._seq), i, 0))
            started.append(i)
        return started

    def pop_due(self, now: float) -> Iterator[tuple[float, int, int]]:
        """(arrival, session, turn) of every turn due by `now`, earliest first."""
        while self._due and self._due[0][0] <= now:
            arrival, _, i, k = heapq.heappop(self._due)
            yield arrival, i, k

    def turn_done(self, i: int, k: int, now: float, ok: bool) -> None:
        """Schedule the session's next turn, or end the session (last turn, or a failed one: the driver's next
        `start_sessions` admits a waiting one in its place)."""
        turns = self.sessions[i]["turns"]
        if ok and k + 1 < len(turns):
            heapq.heappush(self._due, (now + float(turns[k + 1].get("think_s", 0.0)), next(self._seq), i, k + 1))
        else:
            self.active -= 1

    def waiting(self) -> bool:
        """Sessions not started yet, or turns not yet due."""
        return bool(self.pending or self._due)

    def next_event_s(self) -> float | None:
        """When the next turn falls due or the next session may start (None: nothing scheduled)."""
        times = [self._due[0][0]] if self._due else []
        if self.pending and self.active < self.concurrency:
            times.append(self.sessions[self.pending[-1]]["arrival_s"])
        return min(times) if times else None
