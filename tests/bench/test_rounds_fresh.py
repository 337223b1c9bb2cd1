"""A workload with no reuse stays new to every tier in every round (`engine_proc.salted`)."""

from __future__ import annotations

from kvprefetch.testbed.engine_proc import salted


def test_each_round_changes_every_turns_first_token_and_nothing_else():
    sessions = [{"sid": "s0", "arrival_s": 0.0, "turns": [{"tokens": [5, 6, 7], "max_tokens": 2},
                                                          {"tokens": [900, 8], "max_tokens": 2}]}]  # fmt: skip
    r1, r2 = salted(sessions, 1, 1000), salted(sessions, 2, 1000)
    firsts = {tuple(t["tokens"][0] for t in s["turns"]) for s in (sessions[0], r1[0], r2[0])}
    assert len(firsts) == 3  # round 0, 1 and 2 start every prompt differently: no chunk key is shared
    for r in (r1, r2):
        for new, old in zip(r[0]["turns"], sessions[0]["turns"], strict=True):
            assert new["tokens"][1:] == old["tokens"][1:] and new["max_tokens"] == old["max_tokens"]
            assert 4 <= new["tokens"][0] < 1000
    assert salted(sessions, 1, 1000) == r1 and sessions[0]["turns"][0]["tokens"] == [5, 6, 7]  # pure
