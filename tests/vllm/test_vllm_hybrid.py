"""Exactness of the connector on a sliding-window hybrid (issue 62): the packaged Gemma-3-like tiny model, random
weights (`tiny_hybrid`), float32, vLLM's hybrid KV cache manager on (4 KV cache groups: 3 sliding-window layers with
a 96-token window, 1 full-attention layer; the connector declares `SupportsHMA`).

Every prompt is longer than the window (four 256-token chunks and a tail). Greedy tokens and their logprobs must
equal vLLM alone with the hybrid manager on, for a miss, a hit from DRAM, a hit ending inside the prompt (a shorter
shared prefix), a hit through a chunk saved while decoding, a hit from disk, a load past vLLM's own prefix-cache hit,
and a failed load. The engine runs with vLLM's prefix cache on, emptied before each request whose KV must come
from the connector (`run`). A chunk holds every group's KV;
a load writes the full-attention group's every block and a sliding group's blocks inside the window only (vLLM
freed the others), and goes between steps (`SchedulerSide._between_steps`).
"""

from __future__ import annotations

import pytest

from kvprefetch.testbed.protocol import Completion, CoolDram, CountersReply, Geometry, Reset

pytest.importorskip("vllm")

from test_vllm_exactness import TOL

from conftest import CHUNK, corrupt_disk_tier, prompt

pytestmark = [pytest.mark.slow, pytest.mark.engine]

LEN = 4 * CHUNK + 76
GROUPS = ["sliding_window"] * 3 + ["full_attention"]
_ref: dict[tuple, Completion] = {}


@pytest.fixture(scope="module", autouse=True)
def close_hybrid_engines(engines):
    yield
    for name in ("hybrid", "hybrid_reference"):
        engines.close(name)


def reference(engines, p: list[int], max_tokens: int = 8) -> Completion:
    key = (tuple(p), max_tokens)
    if key not in _ref:
        _ref[key] = engines.get("hybrid_reference").generate([p], max_tokens)[0]
    return _ref[key]


def assert_same(out: Completion, ref: Completion) -> None:
    assert out.token_ids == ref.token_ids
    diff = max(abs(a - b) for a, b in zip(out.logprobs, ref.logprobs, strict=True))
    assert diff <= TOL, f"logprobs differ by {diff}"


def delta(after: CountersReply, before: CountersReply) -> dict:
    return {k: after.counters[k] - before.counters[k] for k in after.counters}


def run(engines, p: list[int], max_tokens: int = 8, own_cache: bool = False) -> tuple[Completion, dict]:
    """The connector's engine's answer to p, checked against vLLM alone; and its counters' change. vLLM's own
    prefix cache is emptied first unless ``own_cache``."""
    e = engines.get("hybrid")
    if not own_cache:
        assert e.call(Reset(), timeout=60).reset
    before = e.counters()
    out = e.generate([p], max_tokens)[0]
    assert_same(out, reference(engines, p, max_tokens))
    return out, delta(e.counters(), before)


P = prompt(3001, LEN)


def test_hybrid_manager_stays_on(engines, logs):
    geo = engines.get("hybrid").call(Geometry(), timeout=60)
    assert geo.kv_cache_groups == GROUPS
    assert "Turning off hybrid kv cache manager" not in (logs / "hybrid.log").read_text()


def test_hybrid_miss_then_dram_hit(engines):
    _, d = run(engines, P)
    assert d["loaded_chunks"] == 0 and d["saved_chunks"] == 4 and d["worker_saved_chunks"] == 4
    assert engines.get("hybrid").flush()
    _, d = run(engines, P)
    assert d["loaded_chunks"] == 4 and d["worker_loaded_chunks"] == 4 and d["hit_tokens_dram"] == 4 * CHUNK
    assert d["async_loads"] == 1 and d["sync_loads"] == 0  # (several groups: loads go between steps)
    assert d["load_error_chunks"] == 0


def test_hybrid_hit_ending_inside_the_prompt(engines):
    """A prompt sharing P's first two chunks: the hit ends at token 512, so the sliding groups need chunk 1's window
    tail, saved when P computed it."""
    _, d = run(engines, P[: 2 * CHUNK] + prompt(3002, 300))
    assert d["loaded_chunks"] == 2 and d["load_error_chunks"] == 0


Q = prompt(3003, 4 * CHUNK - 4)


def test_hybrid_hit_through_a_chunk_saved_while_decoding(engines):
    """A prompt 4 tokens short of four chunks: its fourth chunk completes while decoding and is saved then; the next
    turn (prompt + answer + more) loads all four."""
    q = Q
    out, d = run(engines, q)
    assert d["saved_chunks"] == 4
    assert engines.get("hybrid").flush()
    _, d = run(engines, q + out.token_ids + prompt(3004, 40))
    assert d["loaded_chunks"] == 4 and d["load_error_chunks"] == 0


def test_hybrid_load_past_vllms_own_prefix_cache_hit(engines):
    """vLLM's prefix cache holds P's first two chunks (a request of those and a tail; every group's, the sliding ones'
    window before token 512): the connector loads chunks 2 and 3 after them."""
    _, d = run(engines, P[: 2 * CHUNK] + prompt(3006, 30))
    assert d["loaded_chunks"] == 2
    _, d = run(engines, P, own_cache=True)
    assert d["loaded_chunks"] == 2 and d["load_error_chunks"] == 0


def test_hybrid_disk_hit(engines):
    engines.get("hybrid").call(CoolDram(), timeout=60)  # every chunk written back, then dropped from DRAM
    _, d = run(engines, P)
    assert d["loaded_chunks"] == 4 and d["hit_tokens_disk"] > 0 and d["load_error_chunks"] == 0


def test_hybrid_failed_load_is_computed_by_vllm(engines, disk_dir):
    """Q's chunks are on disk only (`CoolDram` above dropped them from DRAM): damaged there, the load fails
    and is reported as a failed request (vLLM takes no failed block ids from a model with several KV cache
    groups); vLLM computes the prompt, exactly."""
    assert corrupt_disk_tier(disk_dir / "hybrid") > 0
    _, d = run(engines, Q + prompt(3005, 40))
    assert d["loaded_chunks"] == 0 or d["load_error_chunks"] > 0
