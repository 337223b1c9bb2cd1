"""Trace analysis and the replay sampler on a generated conversation trace whose conversations are known."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest
from tests.clitext import flat
from typer.testing import CliRunner

from kvprefetch.bench.report import trace_reuse_lines
from kvprefetch.cli import app
from kvprefetch.workload import ChatWorkload, generate_chat, read_mooncake_trace
from kvprefetch.workload.analysis import analyse, ideal_hits, prefix_groups
from kvprefetch.workload.prefix_cache import prefix_hits
from kvprefetch.workload.replay import KV_MARGIN, TraceBench, apply_utilisation, reuse_summary, trace_workload
from kvprefetch.workload.sampling import LevelNeed, SampleRule, fit_block_tokens, sample_conversations, spaced_order

# 150 conversations of 1-6 turns sharing a 3-block system prompt, starting over ~25 minutes, minutes between turns
CHAT = ChatWorkload(sessions=150, turns=6, system_tokens=3 * 512, first_user_tokens=2000, user_tokens=700,
                    output_tokens=300, think_s=60.0, arrival="poisson", rate_per_s=0.1, jitter=0.5, seed=5)  # fmt: skip


def _conversations():
    """The generated requests with each conversation cut at a seeded number of turns (1..6), so the trace holds
    single-request conversations too."""
    reqs = generate_chat(CHAT)
    keep = {sid: 1 + (sid * 7919) % 6 for sid in range(CHAT.sessions)}
    return [r for r in reqs if r.turn < keep[r.session_id]]


@pytest.fixture(scope="module")
def trace_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("trace") / "conversations.jsonl"
    rows = [{"timestamp": round(1000 * r.arrival_s), "input_length": r.input_len, "output_length": r.output_len,
             "hash_ids": list(r.hash_ids)} for r in _conversations()]  # fmt: skip
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


def _expected_ideal(reqs) -> float:
    """The unbounded prefix cache's hit ratio, by the generator's construction rather than by the model: a turn
    reuses every full block of its conversation's previous turn (system prompt included), a first turn the
    system prompt blocks, except the trace's very first request, which finds nothing."""
    shared = CHAT.system_tokens // 512
    by_turn = {(r.session_id, r.turn): r for r in reqs}
    first = min(reqs, key=lambda r: r.arrival_s)
    hits = 0
    for r in reqs:
        if r.turn:
            hits += by_turn[(r.session_id, r.turn - 1)].input_len // 512
        elif r is not first:
            hits += shared
    return hits / sum(len(r.hash_ids) for r in reqs)


def test_analysis_finds_the_conversations_and_their_ideal_hit_ratio(trace_file):
    reqs = read_mooncake_trace(trace_file)
    truth = _conversations()
    a = analyse(reqs)
    assert a.requests == len(truth)
    # the shared system prompt is a hub: it does not merge the conversations into one group
    assert a.hub_blocks == CHAT.system_tokens // 512
    ordered = sorted(reqs, key=lambda r: r.arrival_s)
    found = {frozenset((r.input_len, r.hash_ids) for r in map(ordered.__getitem__, g)) for g in prefix_groups(ordered)}
    known: dict[int, set] = {}
    for r in truth:
        known.setdefault(r.session_id, set()).add((r.input_len, r.hash_ids))
    assert found == {frozenset(s) for s in known.values()}
    assert a.groups == len(known) and a.multi_request_groups == sum(len(s) > 1 for s in known.values())
    assert a.ideal_hit_ratio == pytest.approx(_expected_ideal(truth))
    # a bounded cache never does better than the unbounded one, and a larger one never worse
    curve = list(a.hit_ratio_by_capacity.values())
    assert curve == sorted(curve) and curve[-1] <= a.ideal_hit_ratio
    assert a.reuse_distance_s["p50"] > 0 and a.arrival_rate_per_s > 0
    assert json.loads(json.dumps(a.to_json()))["ideal_hit_ratio"] == a.ideal_hit_ratio


def test_sampled_replay_keeps_the_ideal_hit_ratio_within_ten_percent(trace_file):
    reqs = sorted(read_mooncake_trace(trace_file), key=lambda r: r.arrival_s)
    rule = SampleRule(window_start=0.3, max_prompt_tokens=10**6)
    sample = sample_conversations(reqs, [LevelNeed(8, 30_000), LevelNeed(8, 30_000)], rule)
    assert abs(sample.ideal_hit_ratio - sample.full_ideal_hit_ratio) <= 0.1 * sample.full_ideal_hit_ratio
    assert not sample.lost_most_reuse()
    measured = sample.measured()
    # whole conversations: each in one level only, in trace order, every request of it from the window on
    keys = [{r.session_id for r in conv} for level in sample.levels for conv in level]
    assert all(not a & b for i, a in enumerate(keys) for b in keys[i + 1 :])
    assert all([r.arrival_s for r in conv] == sorted(r.arrival_s for r in conv) for lv in sample.levels for conv in lv)
    # the prelude makes each measured request hit exactly what the full trace's unbounded cache gave it
    full = dict(zip(map(id, reqs), ideal_hits(reqs), strict=True))
    replayed = prefix_hits([r.hash_ids for r in [*sample.prelude, *measured]])[len(sample.prelude) :]
    assert replayed == [full[id(r)] for r in measured]
    assert sample.prelude and all(p.arrival_s == 0.0 for p in sample.prelude)


def test_a_sample_that_loses_the_reuse_says_so(tmp_path):
    # conversations of two turns in the first half of the trace, one-request ones in the second
    rows = [{"timestamp": 1000 * i, "input_length": 512 * (2 + i % 2), "output_length": 8,
             "hash_ids": [100 * (i // 2) + b for b in range(2 + i % 2)]} for i in range(40)]  # fmt: skip
    rows += [{"timestamp": 1000 * (40 + i), "input_length": 1024, "output_length": 8, "hash_ids": [10**6 + 2 * i,
              10**6 + 2 * i + 1]} for i in range(40)]  # fmt: skip
    path = tmp_path / "t.jsonl"
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    reqs = read_mooncake_trace(path)
    sample = sample_conversations(reqs, [LevelNeed(10)], SampleRule(window_start=0.6))
    assert sample.full_ideal_hit_ratio == pytest.approx(40 / 180) and sample.ideal_hit_ratio == 0
    assert sample.lost_most_reuse()
    lines = trace_reuse_lines({"workload": {"sample": sample.summary(), "reusable_share": 0.0}, "rows": []})
    assert any("WARNING: the sample lost most of the trace's reuse" in line for line in lines)
    with pytest.raises(ValueError, match="too few conversations"):
        sample_conversations(reqs, [LevelNeed(4, 10**9)], SampleRule())


def test_a_length_scale_that_breaks_blocks_below_a_chunk_is_corrected_or_refused(trace_file):
    assert fit_block_tokens(None, 128) == (0.25, None)
    assert fit_block_tokens(0.5, 128) == (0.5, None)
    scale, note = fit_block_tokens(1 / 8, 128)
    assert scale == 0.25 and "64 tokens, below one 128-token chunk" in note
    scale, note = fit_block_tokens(0.375, 128)  # 192-token blocks straddle two chunks
    assert scale == 0.5 and "not a whole number of 128-token chunks" in note
    with pytest.raises(ValueError, match="must be a whole number of 128-token chunks"):
        fit_block_tokens(0.3, 128)
    # the bench's workload replays the corrected scale and declares why
    w = trace_workload(TraceBench(path=str(trace_file), length_scale=1 / 8, level_tokens=4000, min_requests=2,
                                  max_prompt_tokens=4096), [2], vocab_size=500)  # fmt: skip
    assert w.declared["block_tokens"] == 128 and "below one 128-token chunk" in w.declared["length_scale_note"]
    # the command refuses a scale it cannot correct before it starts anything
    res = CliRunner().invoke(app, ["bench", "--trace", str(trace_file), "--trace-length-scale", "0.3"])
    assert res.exit_code != 0 and "must be a whole number of 128-token chunks" in flat(res.output)


def test_bench_trace_workload_outgrows_the_engine_kv_and_keeps_the_reuse(trace_file):
    spec = TraceBench(path=str(trace_file), engine_kv_tokens=9000, level_tokens=1000, max_prompt_tokens=4096,
                      min_requests=2, use_timestamps=True)  # fmt: skip
    w = trace_workload(spec, [2, 4], vocab_size=500)
    assert all(w.prompt_tokens(c) >= KV_MARGIN * 9000 for c in (2, 4))
    sample = w.declared["sample"]
    assert sample["sample_ideal_hit_ratio"] > 0.5 * sample["full_trace_ideal_hit_ratio"]
    # the replayed tokens keep the reuse as whole 128-token chunks (one chunk a block at the default scale)
    reuse = reuse_summary(w, 128)
    assert reuse["reusable_share"] >= 0.8 * sample["sample_ideal_hit_ratio"]
    # a conversation's later turns follow its first, after the trace's gap between their arrivals
    assert any(len(s.turns) > 1 and all(t.think_s > 0 for t in s.turns[1:]) for s in w.levels[2])
    # times scaled so recomputing every level's prompts would keep the engine 50% busy at 1,000 tokens/s
    before = [s.arrival_s for s in w.levels[4]]
    factor = apply_utilisation(w, 1000.0, 0.5)
    span = sum(max(s.arrival_s + sum(t.think_s for t in s.turns[1:]) for s in w.levels[c]) for c in w.levels)
    assert sum(w.prompt_tokens(c) for c in w.levels) / 1000.0 / span == pytest.approx(0.5)
    assert [s.arrival_s for s in w.levels[4]] == pytest.approx([factor * a for a in before])
    assert w.declared["utilisation_time_factor"] == factor
    # the simulator rebuilds the same workload from what it declared (up to the rounding of the times)
    again = trace_workload(replace(spec, time_scale=w.declared["time_scale"]), [2, 4], vocab_size=500)

    def times(x):
        return [(s.arrival_s, *(t.think_s for t in s.turns)) for c in x.levels for s in x.levels[c]]

    def tokens(x):
        return [(s.sid, [(t.tokens, t.max_tokens) for t in s.turns]) for c in x.levels for s in x.levels[c]]

    assert tokens(again) == tokens(w) and again.prelude == w.prelude
    assert all(a == pytest.approx(b) for a, b in zip(times(again), times(w), strict=True))


def test_trace_command_writes_json_and_a_plot(trace_file, tmp_path):
    res = CliRunner().invoke(app, ["trace", str(trace_file), "--json", str(tmp_path / "a.json"),
                                   "--plot", str(tmp_path / "a.png")])  # fmt: skip
    assert res.exit_code == 0, res.output
    data = json.loads((tmp_path / "a.json").read_text())
    assert "ideal prefix hit ratio" in flat(res.output) and f"{100 * data['ideal_hit_ratio']:.1f}%" in res.output
    assert (tmp_path / "a.png").stat().st_size > 0
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"timestamp": 1}\n')
    res = CliRunner().invoke(app, ["trace", str(bad)])
    assert res.exit_code == 2 and "not a Mooncake trace line" in flat(res.output)


TRACE = Path(__file__).resolve().parents[2] / "../shared/data/mooncake/synthetic_trace.jsonl"


@pytest.mark.skipif(not TRACE.exists(), reason="Mooncake trace not present")
def test_the_bench_sample_of_the_public_trace_keeps_its_reuse():
    w = trace_workload(TraceBench(path=str(TRACE), min_requests=4, requests_per_concurrency=1.0), [2, 8], 4096)
    sample = w.declared["sample"]
    assert abs(sample["sample_ideal_hit_ratio"] / sample["full_trace_ideal_hit_ratio"] - 1) <= 0.2
    assert w.declared["block_tokens"] == 128 and w.max_len() <= 2048 + 16


def test_replay_without_timestamps_spaces_a_conversations_turns_and_keeps_their_order(trace_file):
    reqs = read_mooncake_trace(trace_file)
    sample = sample_conversations(reqs, [LevelNeed(8, 60_000)], SampleRule(window_start=0.3, max_prompt_tokens=10**6))
    level = sample.levels[0]
    gap = 6000
    order = spaced_order(level, gap)
    assert sorted(map(id, order)) == sorted(id(r) for conv in level for r in conv)
    conv_of = {id(r): i for i, conv in enumerate(level) for r in conv}
    for i, conv in enumerate(level):
        assert [r for r in order if conv_of[id(r)] == i] == conv  # each conversation in trace order
    # two turns of one conversation closer than the gap only where nothing else could go in between
    tokens, last, close = 0, {}, 0
    for k, r in enumerate(order):
        c = conv_of[id(r)]
        if c in last and tokens - last[c] < gap:
            close += 1
            waiting = {conv_of[id(x)] for x in order[k:]}
            assert all(tokens - last.get(o, -gap) < gap for o in waiting)
        tokens += r.input_len
        last[c] = tokens
    assert close < sum(len(conv) - 1 for conv in level) / 2
    # the bench replays that order, one request a session
    w = trace_workload(TraceBench(path=str(trace_file), engine_kv_tokens=gap, level_tokens=60_000,
                                  max_prompt_tokens=10**6), [8], vocab_size=500)  # fmt: skip
    assert all(len(s.turns) == 1 and s.arrival_s == 0.0 for s in w.levels[8])
