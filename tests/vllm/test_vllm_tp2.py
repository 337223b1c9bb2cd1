"""Tensor parallelism 2 on a real vLLM CPU engine (one core per rank), small random-weight Llama (float32).

Each rank holds one of the model's two KV heads, so one half of every chunk, under keys of its own. Greedy tokens
and logprobs must equal a TP=2 engine without the connector for: a miss, a DRAM hit, a partial hit, a disk hit,
and a hit from a new engine process; the per-rank counters (kept by the scheduler side, the workers' counts
reported with each step) show that every rank's part was prefetched, found in DRAM and loaded. A queued
request's chunks reach DRAM for both ranks before the scheduler reaches it: the engine is held until every
read has landed (`hold_until_prefetched`), so this is certain, not a race. A TP=2 and a TP=1 engine of the same
model on one disk tier never serve each other's chunks.

The TP=2 engines run in this file's order and are closed at its end.
"""

from __future__ import annotations

import pytest

from kvprefetch.testbed.protocol import Completion, CountersReply, Generate, PromptIdentity

pytest.importorskip("vllm")

from test_vllm_exactness import LEN, assert_same
from test_vllm_exactness import reference as tp1_reference

from conftest import CHUNK, prompt

pytestmark = [pytest.mark.slow, pytest.mark.engine]

N = LEN // CHUNK  # whole chunks per prompt (the tail is always computed)
RANKS = ("0", "1")  # (JSON keys)
_ref: dict[tuple, dict] = {}


@pytest.fixture(scope="module", autouse=True)
def close_tp2_engines(engines):
    yield
    for name in ("tp2", "tp2_reference", "tp2_restarted_prefetch_off"):
        engines.close(name)


def reference(engines, p: list[int], max_tokens: int = 8) -> Completion:
    key = (tuple(p), max_tokens)
    if key not in _ref:
        _ref[key] = engines.get("tp2_reference").generate([p], max_tokens)[0]
    return _ref[key]


def snap(e) -> CountersReply:
    return e.counters()


def rank_delta(after: CountersReply, before: CountersReply) -> dict[str, dict[str, int]]:
    return {r: {k: v - before.ranks[r][k] for k, v in after.ranks[r].items()} for r in RANKS}


def delta(after: CountersReply, before: CountersReply) -> dict[str, int]:
    return {k: after.counters[k] - before.counters[k] for k in after.counters}


def evict_dram(e, seed0: int) -> None:
    """Push more than the DRAM pool holds through the engine (every chunk written back first, every process)."""
    assert e.flush()
    for i in range(6):  # 6 prompts x 4 chunks x 2 ranks = 48 rank-chunks > the pool's 32 slots
        e.generate([prompt(seed0 + i, LEN)], 1)
    assert e.flush()


P = prompt(2001, LEN)


def test_tp2_miss_equals_vllm_alone(engines):
    e = engines.get("tp2")
    before = snap(e)
    assert_same(e.generate([P])[0], reference(engines, P))
    after = snap(e)
    assert delta(after, before)["loaded_chunks"] == 0 and delta(after, before)["saved_chunks"] == N
    assert all(d["loaded_chunks"] == 0 for d in rank_delta(after, before).values())


def test_tp2_dram_hit_loads_every_rank(engines):
    e = engines.get("tp2")
    assert e.flush()  # (the miss's saves are in the store: the workers save after the forward)
    before = snap(e)
    assert_same(e.generate([P])[0], reference(engines, P))
    after = snap(e)
    assert delta(after, before)["loaded_chunks"] == N
    for r, d in rank_delta(after, before).items():
        assert d["reached_hit_chunks"] == N and d["reached_in_dram_chunks"] == N, (r, d)
        assert d["loaded_chunks"] == N and d["loaded_bytes"] > 0, (r, d)


def test_tp2_partial_hit(engines):
    e = engines.get("tp2")
    p2 = P[: 2 * CHUNK] + prompt(2002, 600)
    assert e.flush()
    before = snap(e)
    assert_same(e.generate([p2])[0], reference(engines, p2))
    for r, d in rank_delta(snap(e), before).items():
        assert d["loaded_chunks"] == 2, (r, d)  # the shared prefix; the rest is computed (and saved)


def test_tp2_queued_requests_chunks_reach_dram_for_both_ranks_first(engines):
    """Two requests whose chunks are on disk only arrive together behind one running slot; the engine is held
    until their reads have landed. When the scheduler reaches each, all its chunks of both ranks are in DRAM,
    and they load inside the forward pass."""
    e = engines.get("tp2")
    rs = [prompt(2010 + i, LEN) for i in range(2)]
    for r in rs:
        e.generate([r], 1)
    evict_dram(e, 2100)
    before = snap(e)
    res = e.call(Generate(prompts=rs, max_tokens=8, hold_until_prefetched=True))
    after = snap(e)
    assert res.prefetches_landed is True
    d = delta(after, before)
    assert d["prefetch_in_time"] == 2 and d["prefetch_late"] == 0, d
    assert d["loaded_chunks"] == 2 * N
    for r, rd in rank_delta(after, before).items():
        assert rd["prefetched_chunks"] == 2 * N, (r, rd)  # every rank's part came up from disk ...
        assert rd["reached_hit_chunks"] == 2 * N and rd["reached_in_dram_chunks"] == 2 * N, (r, rd)  # ... in time
        assert rd["loaded_chunks"] == 2 * N, (r, rd)
    for r, o in zip(rs, res.outputs, strict=True):
        assert_same(o, reference(engines, r))


def test_tp2_disk_hit(engines):
    e = engines.get("tp2")
    evict_dram(e, 2200)
    before = snap(e)
    assert_same(e.generate([P])[0], reference(engines, P))
    after = snap(e)
    for r, d in rank_delta(after, before).items():
        assert d["prefetched_chunks"] == N and d["loaded_chunks"] == N, (r, d)  # read up from disk, every rank


def test_tp1_and_tp2_never_serve_each_others_chunks(engines):
    """One model, one disk tier: P's chunks are there from the TP=2 engine (the disk hit above read them), X's
    from a TP=1 engine. Neither engine finds the other's."""
    e1, e2 = engines.get("restarted_prefetch_off"), engines.get("tp2")
    before = e1.counters()
    assert_same(e1.generate([P])[0], tp1_reference(engines, P))
    assert delta(e1.counters(), before)["loaded_chunks"] == 0
    x = prompt(2003, LEN)
    e1.generate([x], 1)
    assert e1.flush()
    before = e1.counters()
    e1.generate([x], 1)
    assert delta(e1.counters(), before)["loaded_chunks"] == N  # X is cached, for TP=1 ...
    before = snap(e2)
    assert_same(e2.generate([x])[0], reference(engines, x))
    after = snap(e2)
    assert delta(after, before)["loaded_chunks"] == 0
    for r, d in rank_delta(after, before).items():
        assert d["reached_hit_chunks"] == 0 and d["loaded_chunks"] == 0, (r, d)  # ... not for TP=2


def test_tp2_an_adapter_never_loads_the_base_models_kv_and_reuses_its_own_on_every_rank(engines, tmp_path):
    """A LoRA adapter at TP=2: every rank's part of a base-model chunk is in DRAM, none is loaded for the adapter's
    request; the adapter's own chunks are, on both ranks. Every answer equals a TP=2 engine without the connector."""
    from tests.adapters import make_adapter, model_config

    path = make_adapter(tmp_path / "ad", model_config(engines.model_dir), seed=1)
    ad = PromptIdentity(lora_name="ad", lora_path=str(path))
    e, ref = engines.get("tp2"), engines.get("tp2_reference")
    p = prompt(2004, LEN)
    want = ref.generate([p], identities=[ad])[0]
    assert want.token_ids != reference(engines, p).token_ids  # (the adapter changes the answer)
    e.generate([p], 1)  # the base model's chunks, on both ranks
    assert e.flush()
    for loads in (0, N):  # the adapter's first request loads nothing; its second loads its own chunks
        before = snap(e)
        assert_same(e.generate([p], identities=[ad])[0], want)
        assert e.flush()
        after = snap(e)
        assert delta(after, before)["loaded_chunks"] == loads
        for r, d in rank_delta(after, before).items():
            assert d["loaded_chunks"] == loads, (r, d)


def test_tp2_new_engine_process_reads_disk(engines):
    """The cache outlives the engine: a new TP=2 process (fresh DRAM pool, prefetch off) serves P from disk."""
    e = engines.get("tp2")
    assert e.flush()
    engines.close("tp2")
    e2 = engines.get("tp2_restarted_prefetch_off")
    before = snap(e2)
    assert_same(e2.generate([P])[0], reference(engines, P))
    after = snap(e2)
    d = delta(after, before)
    assert d["demand_reads"] == 1 and d["loaded_chunks"] == N
    for r, rd in rank_delta(after, before).items():
        assert rd["loaded_chunks"] == N, (r, rd)
