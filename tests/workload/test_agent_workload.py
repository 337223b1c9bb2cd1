"""The agent workload: turns that extend each other, the known head a client can warm, tool gaps, the schedule."""

from __future__ import annotations

import json

import pytest

from kvprefetch.testbed.sessions import SessionSchedule
from kvprefetch.workload.agent import AgentBench, agent_from_declared, agent_workload, parse_gap
from kvprefetch.workload.replay import BenchWorkload, reuse_summary

SPEC = AgentBench(task_tokens=512, answer_tokens=16, tool_tokens=48, measured_turns=3, min_sessions=2)


def test_each_turn_is_the_previous_prompt_plus_an_answer_plus_a_tool_result():
    w = agent_workload(SPEC, [1, 4], vocab_size=500)
    assert [len(w.levels[c]) for c in (1, 4)] == [2, 8]
    assert len(w.prelude) == 10 and all(len(s.turns) == 1 for s in w.prelude)
    for p, s in zip(w.prelude, [s for c in (1, 4) for s in w.levels[c]], strict=True):
        prev = p.turns[0].tokens  # the task context, computed before the measured window
        assert len(prev) == SPEC.task_tokens
        for k, t in enumerate(s.turns, start=1):
            assert len(t.tokens) == SPEC.prompt_tokens(k) and t.tokens[: len(prev)] == prev
            # what the client knows when the tool call starts: everything but the tool's result
            assert t.known_tokens == len(prev) + SPEC.answer_tokens
            assert t.max_tokens == SPEC.answer_tokens and SPEC.gap_min_s <= t.think_s <= SPEC.gap_max_s
            prev = t.tokens
        assert s.lead_s == s.turns[0].think_s  # the first turn waits for a tool call too
    tokens = [x for c in w.levels for s in w.levels[c] for t in s.turns for x in t.tokens]
    assert min(tokens) >= 4 and max(tokens) < 500
    # every measured prompt but its new tokens is reusable
    assert reuse_summary(w, 64)["reusable_share"] > 0.85


def test_the_workload_is_rebuilt_token_for_token_from_what_it_declared():
    w = agent_workload(SPEC, [1, 4], vocab_size=500)
    again = agent_from_declared(json.loads(json.dumps(w.declared)), [1, 4], 500)
    assert again.to_json() == w.to_json()
    assert BenchWorkload.from_json(json.loads(json.dumps(w.to_json()))).to_json() == w.to_json()


def test_gap_option():
    assert parse_gap("0.5-3") == (0.5, 3.0) and parse_gap("1.5") == (1.5, 1.5) and parse_gap("0") == (0.0, 0.0)
    for bad in ("3-0.5", "-1", "x", "1-y"):
        with pytest.raises(ValueError, match="gap-s"):
            parse_gap(bad)
    w = agent_workload(AgentBench(gap_min_s=0, gap_max_s=0, min_sessions=1), [1], vocab_size=500)
    assert all(t.think_s == 0 for s in w.levels[1] for t in s.turns) and w.levels[1][0].lead_s == 0


def test_a_sessions_first_turn_is_due_its_lead_after_it_starts():
    sessions = [{"arrival_s": 0.0, "lead_s": 2.0, "turns": [{"think_s": 2.0}, {"think_s": 1.0}]},
                {"arrival_s": 0.0, "lead_s": 0.5, "turns": [{"think_s": 0.5}]}]  # fmt: skip
    sched = SessionSchedule(sessions, concurrency=1)
    assert sched.start_sessions(0.0) == [0]  # one at a time
    assert list(sched.pop_due(1.9)) == [] and sched.next_event_s() == 2.0
    assert list(sched.pop_due(2.0)) == [(2.0, 0, 0)]
    sched.turn_done(0, 0, 3.0, ok=True)
    assert list(sched.pop_due(4.0)) == [(4.0, 0, 1)]
    sched.turn_done(0, 1, 5.0, ok=True)  # the session ends: the next one starts on the driver's next call
    assert sched.start_sessions(5.0) == [1]
    assert list(sched.pop_due(5.5)) == [(5.5, 1, 0)]
