"""MLA at tensor parallelism 2 (issue 62): the packaged DeepSeek-V2-like tiny model, random weights (`tiny_hybrid`),
float32, one core per rank. MLA's KV is one latent vector per token, the same on every rank: the connector keeps
one copy of a chunk for both ranks (rank 0's keys, written by rank 0 alone), and every rank loads it. Greedy tokens
of a hit must equal vLLM computing the prompt at TP=2 (the engine's own miss: the connector only saved then; one
TP=2 engine, not two: each starts two worker processes of its own); logprobs within vLLM's own drift on a prefix
hit (`DRIFT`). On disk, one rank's bytes per chunk.
"""

from __future__ import annotations

import pytest

from kvprefetch.testbed.protocol import Completion, CountersReply, Geometry

pytest.importorskip("vllm")

from conftest import CHUNK, prompt

pytestmark = [pytest.mark.slow, pytest.mark.engine]

N = 3  # whole chunks per prompt
LEN = N * CHUNK + 40
# The CPU MLA backend computes a prompt's attention one way (prefill: decompressed K/V) and a token over cached KV
# another (the absorbed latent): vLLM's own prefix-cache hits drift up to this (issue 62: 1.5e-2 at TP=1; this
# test measured 3.9e-4).
DRIFT = 1.5e-2
_computed: dict[str, Completion] = {}


@pytest.fixture(scope="module", autouse=True)
def close_mla_engine(engines):
    yield
    engines.close("mla")


def rank_delta(after: CountersReply, before: CountersReply) -> dict[str, dict[str, int]]:
    return {r: {k: v - before.ranks[r][k] for k, v in after.ranks[r].items()} for r in ("0", "1")}


P = prompt(4001, LEN)


def test_mla_tp2_one_copy_for_both_ranks(engines, disk_dir):
    e = engines.get("mla")
    geo = e.call(Geometry(), timeout=60)
    assert geo.tp_size == 2 and geo.kv_cache_groups == ["mla_attention"]
    before = e.counters()
    _computed["P"] = e.generate([P])[0]  # a miss: vLLM computes the prompt, the connector saves it
    assert e.flush()
    after = e.counters()
    assert after.counters["saved_chunks"] - before.counters["saved_chunks"] == N
    ranks = rank_delta(after, before)
    assert ranks["0"]["saved_chunks"] == N and ranks["1"]["saved_chunks"] == 0  # rank 0 writes the one copy
    files = [f for f in (disk_dir / "mla").rglob("*") if f.is_file() and f.stat().st_size >= geo.chunk_bytes]
    assert len(files) == N  # one file a chunk, one rank's bytes each (not one per rank)
    assert all(f.stat().st_size < 2 * geo.chunk_bytes for f in files)


def test_mla_tp2_hit_loads_the_copy_on_both_ranks(engines):
    e = engines.get("mla")
    before = e.counters()
    out = e.generate([P])[0]
    ref = _computed["P"]
    after = e.counters()
    assert out.token_ids == ref.token_ids
    drift = max(abs(a - b) for a, b in zip(out.logprobs, ref.logprobs, strict=True))
    print(f"MLA TP=2 hit: logprob drift {drift:.2e}")
    assert drift <= DRIFT, f"logprobs differ by {drift}"
    assert after.counters["loaded_chunks"] - before.counters["loaded_chunks"] == N
    ranks = rank_delta(after, before)
    assert ranks["0"]["loaded_chunks"] == N and ranks["1"]["loaded_chunks"] == N
    assert after.counters["load_error_chunks"] == before.counters["load_error_chunks"]
