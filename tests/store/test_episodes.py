"""A failure cause is logged once per episode: the first failure of a burst, the next burst again (with how many
the last one had), and a cause that never stops failing again after `remind_s`."""

from __future__ import annotations

import logging

from kvprefetch.episodes import EpisodeLog


class Clock:
    """Time as the test sets it (an EpisodeLog takes its clock as a parameter)."""

    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def test_one_line_per_burst_and_the_next_burst_counts_the_last(caplog):
    clock = Clock()
    episodes = EpisodeLog(logging.getLogger("kvprefetch.test"), quiet_s=30, remind_s=600, clock=clock)
    with caplog.at_level(logging.WARNING):
        logged = []
        for _ in range(50):  # a damaged disk: 50 chunks fail within a few seconds
            logged.append(episodes.warn("disk:CorruptChunk", "chunk %s failed", "x"))
            clock.now += 0.1
        clock.now += 31  # quiet for longer than quiet_s: the next failure opens a new episode
        logged.append(episodes.warn("disk:CorruptChunk", "chunk %s failed", "y"))
        logged.append(episodes.warn("remote:RemoteUnavailable", "remote down"))  # another cause: its own episodes
    assert logged == [True] + [False] * 49 + [True, True]
    lines = [r.getMessage() for r in caplog.records]
    assert lines == ["chunk x failed", "chunk y failed [49 more of this cause since its last line]", "remote down"]


def test_a_cause_that_never_stops_is_logged_again_every_remind_s(caplog):
    clock = Clock()
    episodes = EpisodeLog(logging.getLogger("kvprefetch.test"), quiet_s=30, remind_s=600, clock=clock)
    with caplog.at_level(logging.WARNING):
        n = 0
        for _ in range(1300):  # one failure a second for 1300 s, never quiet
            clock.now += 1.0
            n += episodes.warn("disk:OSError", "read failed")
    assert n == 3  # at 0, 600 and 1200 s
    assert "[599 more of this cause" in caplog.records[1].getMessage()
