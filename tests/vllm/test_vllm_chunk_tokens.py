"""The chunk size an engine's connector uses, seen from outside: a configured ``chunk_tokens`` that is not whole KV
blocks is rounded once (`kvprefetch.vllm.spec.whole_blocks`), logged, and reported to the testbed's client as the
effective value (the bench computes per-chunk figures from it); one no request could fill fails the engine's start
with the reason."""

from __future__ import annotations

import pytest
from vllm_harness import Engine

from conftest import extra_config, prompt
from kvprefetch.testbed import protocol as P
from kvprefetch.testbed.client import EngineError
from kvprefetch.vllm import transfer_config

pytestmark = [pytest.mark.slow, pytest.mark.engine]

BLOCK = 128  # the CPU backend's KV block size


def _spec(model_dir: str, disk_dir, pools: list[str], chunk_tokens: int) -> dict:
    extra = extra_config(disk_dir / f"chunk{chunk_tokens}", pools, chunk_tokens=chunk_tokens)
    return {"model": model_dir, "max_num_seqs": 1, "kv_transfer_config": transfer_config(extra)}


def test_the_engine_reports_the_chunk_it_uses(model_dir, logs, disk_dir, pools):
    """192 tokens is one and a half 128-token blocks: the engine uses 384 (their lcm), keys 384-token chunks, says
    so in its log, and its Geometry reply carries both values (the start-up line's: `test_spec`)."""
    log = logs / "chunk192.log"
    eng = Engine(_spec(model_dir, disk_dir, pools, 192), log)
    try:
        geo: P.GeometryReply = eng.call(P.Geometry())
        assert (geo.chunk_tokens, geo.chunk_tokens_configured, geo.block_size) == (384, 192, BLOCK)
        keys: P.KeysReply = eng.call(P.ChunkKeys(tokens=prompt(1, 800)))
        assert [len(rank) for rank in keys.keys] == [2]  # 800 tokens: two whole 384-token chunks
        cost = eng.counters().cost
        assert cost is not None and cost["chunk_tokens"] == 384
    finally:
        eng.close()
    text = log.read_text(errors="replace")
    # once per connector (the scheduler's and the worker's: each builds its spec)
    assert text.count("kvprefetch: chunk_tokens 192 is not a multiple of vLLM's KV block size 128; using 384") == 2


def test_a_chunk_no_request_can_fill_fails_the_start_with_the_reason(model_dir, logs, disk_dir, pools):
    with pytest.raises(EngineError, match="a chunk of 16384 tokens is longer than max_model_len 8192"):
        Engine(_spec(model_dir, disk_dir, pools, 16384), logs / "chunk16384.log")
