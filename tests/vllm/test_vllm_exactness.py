"""Exactness of the connector on a real vLLM CPU engine with a small random-weight Llama (float32).

Greedy tokens and their logprobs must be identical to recomputing, for every way a hit can be served:
(a) a miss (the connector only saves), (b) a hit from DRAM, (c) from disk after the DRAM tier was evicted,
(d) from disk by a new engine process started after the first exited, (e) a partial hit, (f) a hit whose disk
tier breaks mid-run (-> recompute). Plus: prefetch on arrival reaches DRAM before the scheduler reaches a
queued request, and the counters; ``load_mode: sync`` (DRAM and disk hits loaded inside the step); the
load-or-recompute rule firing once the disk has been measured slow.

The engines run in the order of this file (session fixtures; the restart test closes the first engine).
"""

from __future__ import annotations

import pytest

from kvprefetch.testbed.protocol import Completion, CountersReply, Warm

pytest.importorskip("vllm")

from conftest import CHUNK, DRAM_CHUNKS, corrupt_disk_tier, prompt

pytestmark = [pytest.mark.slow, pytest.mark.engine]

LEN = 4 * CHUNK + 76  # four whole chunks and a tail the engine always computes
TOL = 1e-5  # logprob tolerance (observed: 0.0)

_ref_cache: dict[tuple, dict] = {}


def reference(engines, p: list[int], max_tokens: int = 8) -> Completion:
    key = (tuple(p), max_tokens)
    if key not in _ref_cache:
        _ref_cache[key] = engines.get("reference").generate([p], max_tokens)[0]
    return _ref_cache[key]


def assert_same(out: Completion, ref: Completion) -> None:
    assert out.token_ids == ref.token_ids
    assert len(out.logprobs) == len(ref.logprobs)
    diff = max(abs(a - b) for a, b in zip(out.logprobs, ref.logprobs, strict=True))
    assert diff <= TOL, f"logprobs differ by {diff}"


def delta(after: CountersReply, before: CountersReply) -> dict:
    return {k: after.counters[k] - before.counters[k] for k in after.counters}


def evict_dram(e, seed0: int) -> None:
    """Push more than the DRAM tier holds through the engine (every chunk written back first)."""
    assert e.flush()
    fillers = [prompt(seed0 + i, LEN) for i in range(DRAM_CHUNKS // 4 + 2)]
    for f in fillers:
        e.generate([f], 1)
    assert e.flush()


P = prompt(1, LEN)


def test_a_miss_equals_recompute(engines):
    e = engines.get("prefetch_on")
    before = e.counters()
    assert_same(e.generate([P])[0], reference(engines, P))
    d = delta(e.counters(), before)
    assert d["loaded_chunks"] == 0
    assert d["saved_chunks"] == 4 and d["worker_saved_chunks"] == 4


def test_b_dram_hit(engines):
    e = engines.get("prefetch_on")
    before = e.counters()
    assert_same(e.generate([P])[0], reference(engines, P))
    d = delta(e.counters(), before)
    assert d["loaded_chunks"] == 4 and d["worker_loaded_chunks"] == 4
    assert d["sync_loads"] == 1 and d["async_loads"] == 0
    assert d["layer_load_waits"] >= 4  # the forward pass waited layer by layer
    assert d["load_error_chunks"] == 0


def test_e_partial_hit(engines):
    e = engines.get("prefetch_on")
    p2 = P[: 2 * CHUNK] + prompt(2, 600)
    before = e.counters()
    assert_same(e.generate([p2])[0], reference(engines, p2))
    d = delta(e.counters(), before)
    assert d["worker_loaded_chunks"] == 2  # the shared prefix; the rest is computed (and saved)
    assert d["saved_chunks"] == 2  # 512 + 600 tokens: chunks 2 and 3 are new


def test_c_disk_hit_after_dram_eviction(engines):
    e = engines.get("prefetch_on")
    evict_dram(e, 100)
    before = e.counters()
    assert_same(e.generate([P])[0], reference(engines, P))
    after = e.counters()
    d = delta(after, before)
    assert d["worker_loaded_chunks"] == 4, (d, after.cost)
    assert d["async_loads"] == 1  # the chunks had to come up from disk
    promoted = after.stores["scheduler"]["promoted"] + after.stores["worker"]["promoted"]
    assert promoted >= 4


def test_g_a_warmed_load_equals_recompute(engines):
    """The warm-up API (a client naming the next turn's head before it arrives): chunks on disk are read up into
    DRAM and leased; the request that follows loads them from DRAM inside its step, exactly, and its arrival
    ends the lease."""
    e = engines.get("prefetch_on")
    w = prompt(12, LEN)
    e.generate([w], 1)
    evict_dram(e, 700)
    before = e.counters()
    res = e.call(Warm(tokens=w, ttl_s=30, wait=60))
    assert res.warm["chunks"] == 4 and res.warm["on_disk"] == 4 and res.warm["missing"] == 0, res
    assert res.now["in_dram"] == 4, res  # the reads landed (and were pinned) within the wait
    assert res.leases["lease_chunks_pinned"] == 4
    assert_same(e.generate([w])[0], reference(engines, w))
    after = e.counters()
    d = delta(after, before)
    assert d["warm_calls"] == 1 and d["warm_read_chunks"] == 4
    assert d["worker_loaded_chunks"] == 4 and d["sync_loads"] == 1 and d["async_loads"] == 0, d  # from DRAM
    assert d["leases_used"] == 1 and d["lease_pinned_chunks"] == d["lease_unpinned_chunks"] == 4, d


def test_prefetch_reaches_dram_before_the_scheduler(engines):
    """A blocker holds the only running slot; three queued requests' chunks are read while they wait."""
    e = engines.get("prefetch_on")
    rs = [prompt(10 + i, LEN) for i in range(3)]
    for r in rs:
        e.generate([r], 1)
    evict_dram(e, 200)
    blocker = prompt(99, 300)
    before = e.counters()
    outs = e.generate([blocker, *rs], max_tokens_each=[96, 8, 8, 8])
    d = delta(e.counters(), before)
    assert d["prefetched_chunks"] >= 12
    assert d["prefetch_in_time"] >= 2, d  # reached with all chunks already in DRAM
    assert d["sync_loads"] >= 2  # ... so loaded inside the forward, no waiting for the disk
    for r, o in zip(rs, outs[1:], strict=True):
        assert_same(o, reference(engines, r))


def test_f_disk_broken_mid_run(engines, disk_dir):
    """Chunks on disk get corrupted after they were cached: the hit turns into a clean recompute."""
    e = engines.get("prefetch_on")
    s = prompt(3, LEN)
    e.generate([s], 1)
    evict_dram(e, 300)
    assert corrupt_disk_tier(disk_dir) > 0
    before = e.counters()
    assert_same(e.generate([s])[0], reference(engines, s))
    after = e.counters()
    store_errors = after.stores["scheduler"]["load_errors"] + after.stores["worker"]["load_errors"]
    assert store_errors > 0 or delta(after, before)["load_error_chunks"] > 0


def test_d_new_engine_process_reads_disk(engines):
    """The cache outlives the engine: a new process (fresh DRAM pool, prefetch off) serves P from disk."""
    e1 = engines.get("prefetch_on")
    p = prompt(4, LEN)
    e1.generate([p], 1)
    assert e1.flush()
    engines.close("prefetch_on")
    e2 = engines.get("restarted_prefetch_off")
    before = e2.counters()
    assert_same(e2.generate([p])[0], reference(engines, p))
    d = delta(e2.counters(), before)
    assert d["worker_loaded_chunks"] == 4
    assert d["async_loads"] == 1
    assert d["demand_reads"] == 1 and d["prefetch_in_time"] == 0  # prefetch off: the read starts on reaching it


def test_f_load_error_reported_to_vllm(engines, disk_dir):
    """Prefetch off: the hit is planned from the index, the read then fails: vLLM gets the blocks back."""
    e2 = engines.get("restarted_prefetch_off")
    t = prompt(5, LEN)
    e2.generate([t], 1)
    assert e2.flush()
    engines.close("restarted_prefetch_off")
    assert corrupt_disk_tier(disk_dir) > 0
    e3 = engines.get("restarted_prefetch_off")  # fresh DRAM: every hit must come from the broken disk
    before = e3.counters()
    assert_same(e3.generate([t])[0], reference(engines, t))
    d = delta(e3.counters(), before)
    assert d["load_error_chunks"] >= 1 and d["load_error_blocks"] >= 2


def test_sync_mode_dram_and_disk_hits(engines):
    """load_mode sync, prefetch off (the benchmark's ondemand-sync): hits load inside the step, exactly."""
    e = engines.get("sync_slow_disk")
    p = prompt(6, LEN)
    assert_same(e.generate([p])[0], reference(engines, p))  # miss: saved
    e.generate([prompt(7, LEN)], 1)  # cached for the next test, which finds it on disk after the eviction below
    before = e.counters()
    assert_same(e.generate([p])[0], reference(engines, p))  # DRAM hit
    d = delta(e.counters(), before)
    assert d["sync_loads"] == 1 and d["worker_loaded_chunks"] == 4 and d["async_loads"] == 0
    evict_dram(e, 400)
    before = e.counters()
    assert_same(e.generate([p])[0], reference(engines, p))  # disk hit, read by the worker inside the step
    after = e.counters()
    d = delta(after, before)
    assert d["sync_loads"] == 1 and d["async_loads"] == 0 and d["prefetched_chunks"] == 0
    assert d["demand_reads"] == 1 and d["worker_loaded_chunks"] == 4 and d["load_error_chunks"] == 0
    # That read measured the throttled disk (4 MB/s), replacing the 1 GB/s prior.
    assert after.cost["disk_samples"] >= 1 and after.cost["disk_bps"] < 20e6, after.cost


def test_a_late_prefetch_on_an_idle_engine_finishes_in_the_step_instead_of_parking(engines):
    """load_mode auto: a request reached while its prefetch is still reading is not parked for a step when
    nobody else runs (parking would only add a step to its wait): its reads finish inside the step that
    prefills it, joined by the worker, and its tokens are those of recomputing it."""
    e = engines.get("auto_slow_disk")
    p = prompt(11, LEN)
    assert_same(e.generate([p])[0], reference(engines, p))  # miss: computed and saved
    evict_dram(e, 600)  # on disk only
    before = e.counters()
    assert_same(e.generate([p])[0], reference(engines, p))  # prefetched on arrival, reached at once
    d = delta(e.counters(), before)
    assert d["prefetch_late"] == 1 and d["finished_in_step"] == 1, sorted(d.items())  # late, finished in the step
    assert d["sync_loads"] == 1 and d["async_loads"] == 0 and d["worker_loaded_chunks"] == 4, d  # never parked
    assert d["load_error_chunks"] == 0


def test_rule_recomputes_hits_on_a_slow_disk(engines):
    """Never slower than recomputing: with the disk measured slow, a request whose chunks sit on disk is
    recomputed, not loaded, and the counter says so; a DRAM hit is still loaded."""
    e = engines.get("sync_slow_disk")
    q = prompt(7, LEN)  # saved by the previous test, evicted from DRAM since: on disk only
    before = e.counters()
    assert before.cost["prefill_tps"] and before.cost["disk_bps"] < 20e6
    assert_same(e.generate([q])[0], reference(engines, q))
    d = delta(e.counters(), before)
    assert d["recomputed_slower_chunks"] == 4, d
    assert d["loaded_chunks"] == 0 and d["worker_loaded_chunks"] == 0 and d["demand_reads"] == 0
    before = e.counters()
    assert_same(e.generate([q])[0], reference(engines, q))  # now saved again, in DRAM: loading pays
    d = delta(e.counters(), before)
    assert d["worker_loaded_chunks"] == 4 and d["recomputed_slower_chunks"] == 0


def test_an_engine_refuses_a_request_it_cannot_read_and_carries_on(engines):
    """A line that is not a request of the protocol gets an error reply naming why; the engine serves on."""
    from kvprefetch.testbed.client import EngineError

    e = engines.get("reference")
    p = prompt(4242, 300)
    ref = reference(engines, p, 4)
    for line, why in (('{"op": "explode"}', "unknown op 'explode'"), ('{"op": "generate", "prompt": [1]}', "prompts")):
        e.proc.stdin.write(line + "\n")
        e.proc.stdin.flush()
        with pytest.raises(EngineError, match=why):
            e.poll(timeout=60)
    assert_same(e.generate([p], 4)[0], ref)
