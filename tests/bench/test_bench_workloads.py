"""The bench's workloads: prelude vs measured turns, disjoint levels, trace blocks, determinism, scaling."""

from __future__ import annotations

import json

import pytest

from kvprefetch.workload.replay import (
    BenchWorkload,
    ChatBench,
    TraceBench,
    chat_workload,
    reuse_summary,
    trace_workload,
)

SMALL = ChatBench(system_tokens=300, history_tokens=900, user_tokens=100, output_tokens=20, measured_turns=2,
                  min_sessions=2, sessions_per_concurrency=1.0, think_s=0.2)  # fmt: skip


def test_chat_is_deterministic_and_json_roundtrips():
    a = chat_workload(SMALL, [1, 3], vocab_size=500)
    b = chat_workload(SMALL, [1, 3], vocab_size=500)
    assert a.to_json() == b.to_json()
    c = BenchWorkload.from_json(json.loads(json.dumps(a.to_json())))
    assert c.to_json() == a.to_json()
    other = chat_workload(ChatBench(**{**SMALL.__dict__, "seed": 1}), [1, 3], vocab_size=500)
    assert other.to_json() != a.to_json()


def test_chat_levels_have_their_own_sessions_and_sizes():
    w = chat_workload(SMALL, [1, 3], vocab_size=500)
    assert [len(w.levels[c]) for c in (1, 3)] == [2, 3]
    sids = [s.sid for c in w.levels for s in w.levels[c]]
    assert len(sids) == len(set(sids))
    assert len(w.prelude) == 5  # one prelude session per measured session
    assert all(len(s.turns) == SMALL.measured_turns for c in w.levels for s in w.levels[c])
    assert all(t.tokens and max(t.tokens) < 500 and min(t.tokens) >= 4 for c in w.levels for s in w.levels[c]
               for t in s.turns)  # fmt: skip
    assert w.max_len() >= w.max_prompt_tokens()


def test_each_measured_turn_extends_its_prelude_history():
    """Measured turn k reuses the prelude's turn k-1 prompt exactly, and brings new tokens of its own."""
    w = chat_workload(SMALL, [2], vocab_size=1000)
    for pre, meas in zip(w.prelude, w.levels[2], strict=True):
        assert len(pre.turns) == SMALL.measured_turns
        for p, m in zip(pre.turns, meas.turns, strict=True):
            assert len(m.tokens) > len(p.tokens)
            assert m.tokens[: len(p.tokens)] == p.tokens
        assert all(t.max_tokens == 1 for t in pre.turns)
    # Sessions share the system prompt and nothing after it.
    a, b = w.levels[2][0].turns[0].tokens, w.levels[2][1].turns[0].tokens
    assert a[:300] == b[:300]
    assert a[300:400] != b[300:400]


def test_reuse_summary_counts_whole_chunks_the_prelude_holds():
    w = chat_workload(SMALL, [2], vocab_size=1000)
    r = reuse_summary(w, 64)
    assert r["prompt_tokens"] == w.prompt_tokens()
    assert 0.5 < r["reusable_share"] < 1.0
    assert r["reusable_tokens"] % 64 == 0


def _trace(tmp_path, rows):
    p = tmp_path / "t.jsonl"
    p.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return p


def test_trace_equal_hash_ids_give_equal_blocks_and_declared_scaling(tmp_path):
    rows = []
    for k in range(8):  # 8 conversations of two turns; the second extends the first by one block
        rows.append({"timestamp": 1000 * k, "input_length": 512 * 2, "output_length": 40,
                     "hash_ids": [100 * k, 100 * k + 1]})  # fmt: skip
        rows.append({"timestamp": 1000 * k + 500, "input_length": 512 * 3, "output_length": 40,
                     "hash_ids": [100 * k, 100 * k + 1, 100 * k + 2]})  # fmt: skip
    spec = TraceBench(path=str(_trace(tmp_path, rows)), length_scale=1 / 8, chunk_tokens=64, window_start=0.0,
                      level_tokens=1, engine_kv_tokens=1, min_requests=2, requests_per_concurrency=1.0,
                      max_output_tokens=3, use_timestamps=True, time_scale=2.0)  # fmt: skip
    w = trace_workload(spec, [2, 4], vocab_size=700)
    assert w.declared["block_tokens"] == 64 and w.declared["length_scale_note"] is None
    assert w.prelude == []  # the window opens at the trace's start: no conversation has a past
    assert [len(w.levels[c]) for c in (2, 4)] == [1, 2] and all(len(s.turns) == 2 for c in w.levels
                                                                    for s in w.levels[c])  # fmt: skip
    for s in w.levels[2] + w.levels[4]:
        first, second = (t.tokens for t in s.turns)
        assert len(first) == 2 * 64 and len(second) == 3 * 64 and second[:128] == first  # equal ids, equal blocks
        assert [t.max_tokens for t in s.turns] == [3, 3]
        assert s.turns[1].think_s == pytest.approx(1.0)  # the trace's 0.5 s between the turns, times 2
    assert len({tuple(s.turns[0].tokens) for c in w.levels for s in w.levels[c]}) == 3
    # arrival times: relative to the level's first conversation, scaled
    arrivals = [s.arrival_s for s in w.levels[4]]
    assert arrivals[0] == 0.0 and arrivals[1] > 0 and arrivals[1] % 2.0 == pytest.approx(0.0)
    assert w.declared["sample"]["sample_ideal_hit_ratio"] == pytest.approx(2 / 5)


def test_trace_too_short_is_a_clear_error(tmp_path):
    rows = [{"timestamp": 0, "input_length": 512, "output_length": 1, "hash_ids": [i]} for i in range(3)]
    spec = TraceBench(path=str(_trace(tmp_path, rows)), min_requests=5)
    with pytest.raises(ValueError, match="too few conversations"):
        trace_workload(spec, [1], vocab_size=100)


def test_chat_without_reuse_has_nothing_to_hit():
    spec = ChatBench(**{**SMALL.__dict__, "reuse": False})
    w = chat_workload(spec, [2, 3], vocab_size=1000)
    assert w.prelude == []
    assert all(len(s.turns) == 1 for c in w.levels for s in w.levels[c])
    assert reuse_summary(w, 64)["reusable_tokens"] == 0
