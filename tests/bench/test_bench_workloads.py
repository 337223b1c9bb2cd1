"""The bench's workloads: prelude vs measured turns, disjoint levels, trace blocks, determinism, scaling."""

from __future__ import annotations

import json

import numpy as np
import pytest

from kvprefetch.bench.workloads import (
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
    rows = [{"timestamp": 100 * i, "input_length": 512 * 3, "output_length": 40, "hash_ids": [1, 2, 10 + i]}
            for i in range(8)]  # fmt: skip
    spec = TraceBench(path=str(_trace(tmp_path, rows)), length_scale=1 / 8, prelude=2, min_requests=2,
                      requests_per_concurrency=1.0, max_output_tokens=3, use_timestamps=True,
                      time_scale=2.0)  # fmt: skip
    w = trace_workload(spec, [2, 4], vocab_size=700)
    assert w.declared["block_tokens"] == 64
    assert len(w.prelude) == 2 and [len(w.levels[c]) for c in (2, 4)] == [2, 4]
    toks = [s.turns[0].tokens for s in w.prelude] + [s.turns[0].tokens for c in w.levels for s in w.levels[c]]
    assert all(len(t) == 3 * 64 for t in toks)
    first = np.array([t[:128] for t in toks])
    assert (first == first[0]).all()  # hash ids 1, 2 shared by every request
    assert len({tuple(t[128:]) for t in toks}) == len(toks)
    assert all(s.turns[0].max_tokens == 3 for c in w.levels for s in w.levels[c])
    # arrival times: relative to the segment's first request, scaled
    assert [s.arrival_s for s in w.levels[4]] == pytest.approx([0.0, 0.2, 0.4, 0.6])


def test_trace_too_short_is_a_clear_error(tmp_path):
    rows = [{"timestamp": 0, "input_length": 512, "output_length": 1, "hash_ids": [i]} for i in range(3)]
    spec = TraceBench(path=str(_trace(tmp_path, rows)), prelude=2, min_requests=2)
    with pytest.raises(ValueError, match="needs"):
        trace_workload(spec, [1], vocab_size=100)


def test_chat_without_reuse_has_nothing_to_hit():
    spec = ChatBench(**{**SMALL.__dict__, "reuse": False})
    w = chat_workload(spec, [2, 3], vocab_size=1000)
    assert w.prelude == []
    assert all(len(s.turns) == 1 for c in w.levels for s in w.levels[c])
    assert reuse_summary(w, 64)["reusable_tokens"] == 0
