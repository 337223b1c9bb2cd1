"""`soak-serve`'s plan, without a server: the fault schedule and the load's prompts."""

from __future__ import annotations

from collections import Counter

from kvprefetch.bench.soak_serve import FAULT_KINDS, Answer, Conversation, fault_schedule, windows


def test_every_fault_kind_comes_twice_or_more_inside_the_run_and_the_schedule_is_the_seeds():
    for seconds in (90, 900):
        faults = fault_schedule(seconds, seed=3)
        kinds = Counter(f.kind for f in faults)
        assert set(kinds) == set(FAULT_KINDS) and min(kinds.values()) >= 2 + (seconds >= 600)
        assert all(0.1 * seconds <= f.at_s <= 0.8 * seconds for f in faults)
        assert [f.at_s for f in faults] == sorted(f.at_s for f in faults)
        assert faults == fault_schedule(seconds, seed=3) != fault_schedule(seconds, seed=4)


def test_a_conversation_grows_by_turns_and_starts_over_before_the_context_is_full():
    c = Conversation(seed=1, head=100, turn=10, max_words=300)
    first = c.next_prompt()
    c.answered("w7 w8")
    second = c.next_prompt()
    assert second.startswith(first + " w7 w8 ") and len(second.split()) == len(first.split()) + 2 + 10
    lengths = []
    for _ in range(60):
        lengths.append(len(c.next_prompt().split()))
        c.answered("w9")
    assert max(lengths) <= 300 and min(lengths[5:]) < lengths[4]  # it started over at least once


def test_ttft_windows_leave_out_failed_requests():
    answers = [Answer(1.0, 0.1, True, True), Answer(2.0, 0.3, True, True), Answer(3.0, None, False, None),
               Answer(12.0, 0.2, True, False)]  # fmt: skip
    w = windows(answers)
    assert [t for t, _, _ in w] == [0.0, 10.0] and w[0][1] == 0.2 and w[1][1] == 0.2
