"""Workload generator and trace reader: determinism, block identity, scaling, multi-turn prefixes."""

from __future__ import annotations

import itertools
import json
import math
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvprefetch.workload import ChatWorkload, TraceScaling, generate_chat, read_mooncake_trace
from kvprefetch.workload.request import Request, TokenRecipe
from kvprefetch.workload.tokens import session_answer_tokens

TRACE = Path(__file__).resolve().parents[2] / "../shared/data/mooncake/synthetic_trace.jsonl"


def test_chat_is_deterministic_from_seed():
    spec = ChatWorkload(sessions=5, turns=3, seed=7)
    a, b = generate_chat(spec), generate_chat(spec)
    assert a == b
    assert [r.token_ids().tolist() for r in a[:3]] == [r.token_ids().tolist() for r in b[:3]]
    other = generate_chat(ChatWorkload(sessions=5, turns=3, seed=8))
    assert [r.input_len for r in a] != [r.input_len for r in other]


@settings(max_examples=25, deadline=None)
@given(shared=st.integers(1, 4), tail_a=st.integers(0, 3), tail_b=st.integers(0, 3), extra=st.integers(1, 511))
def test_equal_hash_ids_give_identical_blocks(shared, tail_a, tail_b, extra):
    recipe = TokenRecipe("trace", 3)
    prefix = tuple(range(100, 100 + shared))
    a_ids = prefix + tuple(range(1000, 1000 + tail_a)) + (5000,)
    b_ids = prefix + tuple(range(2000, 2000 + tail_b)) + (6000,)
    a = Request(0.0, 0, 0, 512 * (len(a_ids) - 1) + extra, 1, a_ids, recipe).token_ids()
    b = Request(0.0, 1, 0, 512 * (len(b_ids) - 1) + extra, 1, b_ids, recipe).token_ids()
    assert np.array_equal(a[: 512 * shared], b[: 512 * shared])
    assert not np.array_equal(a[512 * shared : 512 * (shared + 1)], b[512 * shared : 512 * (shared + 1)])


def test_same_hash_id_at_different_positions_gives_same_block():
    recipe = TokenRecipe("trace", 0)
    a = Request(0.0, 0, 0, 1024, 1, (1, 42), recipe).token_ids()
    b = Request(0.0, 1, 0, 512, 1, (42,), recipe).token_ids()
    assert np.array_equal(a[512:], b)


@settings(max_examples=10, deadline=None)
@given(seed=st.integers(0, 1000), system=st.integers(0, 1500))
def test_later_turn_starts_with_earlier_prompt_and_answer(seed, system):
    spec = ChatWorkload(sessions=2, turns=3, system_tokens=system, first_user_tokens=700, user_tokens=300,
                        output_tokens=90, seed=seed)
    turns = [r for r in generate_chat(spec) if r.session_id == 1]
    turns.sort(key=lambda r: r.turn)
    for prev, nxt in itertools.pairwise(turns):
        expect = np.concatenate([prev.token_ids(), session_answer_tokens(prev)])
        got = nxt.token_ids()
        assert len(got) > len(expect)
        assert np.array_equal(got[: len(expect)], expect)
        full = prev.input_len // 512
        assert nxt.hash_ids[:full] == prev.hash_ids[:full]


def test_sessions_share_only_the_system_prompt():
    spec = ChatWorkload(sessions=2, turns=1, system_tokens=1536, seed=1)
    a, b = sorted(generate_chat(spec), key=lambda r: r.session_id)
    assert a.hash_ids[:3] == b.hash_ids[:3]
    assert set(a.hash_ids[3:]).isdisjoint(b.hash_ids[3:])
    assert np.array_equal(a.token_ids()[:1536], b.token_ids()[:1536])


def test_poisson_arrivals_and_think_time():
    reqs = generate_chat(ChatWorkload(sessions=50, turns=2, arrival="poisson", rate_per_s=2.0, seed=4))
    starts = sorted(r.arrival_s for r in reqs if r.turn == 0)
    assert starts[0] > 0 and 10 < starts[-1] < 50  # 50 sessions at 2/s: about 25 s
    assert all(r.think_s > 0 for r in reqs if r.turn > 0)


def _write_trace(tmp_path: Path) -> Path:
    rows = [
        {"timestamp": 0, "input_length": 1100, "output_length": 10, "hash_ids": [0, 1, 2]},
        {"timestamp": 1500, "input_length": 700, "output_length": 4, "hash_ids": [0, 3]},
    ]
    path = tmp_path / "t.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    return path


def test_trace_scaling_keeps_sharing_structure(tmp_path):
    path = _write_trace(tmp_path)
    plain = read_mooncake_trace(path)
    scaled = read_mooncake_trace(path, TraceScaling(length_scale=0.25, time_scale=2.0))
    assert [r.hash_ids for r in plain] == [r.hash_ids for r in scaled]
    assert [r.input_len for r in scaled] == [275, 175]
    assert [r.arrival_s for r in scaled] == [0.0, 3.0]
    a, b = (r.token_ids() for r in scaled)
    assert np.array_equal(a[:128], b[:128]) and not np.array_equal(a[128:175], b[128:175])
    with pytest.raises(ValueError):
        _ = TraceScaling(length_scale=0.3).block_tokens


@pytest.mark.parametrize(
    ("bad", "why"),
    [
        ("{not json", "Expecting property name"),
        ('{"timestamp": 1, "input_length": 10, "output_length": 2}', "missing 'hash_ids'"),
        ('{"timestamp": 1, "input_length": "ten", "output_length": 2, "hash_ids": [1]}', "invalid literal"),
        ('{"timestamp": 1, "input_length": 10, "output_length": 2, "hash_ids": []}', "no hash_ids"),
    ],
)
def test_a_corrupt_trace_line_is_named_with_its_reason(tmp_path, bad, why):
    path = _write_trace(tmp_path)
    path.write_text(path.read_text() + bad + "\n")
    with pytest.raises(ValueError, match=rf"t\.jsonl:3: not a Mooncake trace line \(.*{why}"):
        read_mooncake_trace(path)


def test_trace_max_requests(tmp_path):
    assert len(read_mooncake_trace(_write_trace(tmp_path), TraceScaling(max_requests=1))) == 1


@pytest.mark.skipif(not TRACE.exists(), reason="Mooncake trace not present")
def test_real_trace_reads_whole():
    reqs = read_mooncake_trace(TRACE)
    assert len(reqs) == 3993
    assert all(len(r.hash_ids) == math.ceil(r.input_len / 512) for r in reqs)
    assert abs(np.mean([r.input_len for r in reqs]) - 15325) < 1
