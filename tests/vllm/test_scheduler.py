"""`scheduler.py`: the scheduler side's request state machine, on a fake store and on real ones."""

from __future__ import annotations

import itertools
import time
from types import SimpleNamespace

from fake_store import FakeStore
from vllm_requests import vllm_request

from kvprefetch.vllm.metrics import ConnectorCounters
from kvprefetch.vllm.settings import parse_extra_config


def make_scheduler(prefetch=True, clock=time.monotonic, **extra):
    from kvprefetch.keys import ChunkKeyer, KVNamespace
    from kvprefetch.vllm.scheduler import SchedulerSide

    settings = parse_extra_config({"prefetch": prefetch, "save_policy": "all", **extra})  # (saves on first sight)
    ns = KVNamespace(model="m", num_layers=2, num_kv_heads=1, head_dim=8, dtype="float32")
    keyer = ChunkKeyer(ns, 256)
    store = FakeStore()
    blocks = {}
    side = SchedulerSide(
        settings, keyer, store, block_size=128, blocks_per_chunk=2, chunk_bytes=1000,
        counters=ConnectorCounters("scheduler"), get_block_ids=lambda rid: blocks.get(rid, []), clock=clock,
    )
    return side, store, keyer, blocks


ids = itertools.count()


def req(tokens):
    return vllm_request(tokens)


def arrive_with_head_on_disk(side, store, keyer):
    """A 1100-token request (4 whole chunks) whose first 3 chunks are on disk, arrived: (request, keys)."""
    toks = list(range(1100))
    keys = keyer.keys(toks)
    for k in keys[:3]:
        store.tiers[k] = "disk"
    r = req(toks)
    side.on_new_request(r)
    return r, keys


def test_scheduler_prefetches_on_arrival_and_loads_async_until_in_dram():
    side, store, keyer, _ = make_scheduler()
    r, _ = arrive_with_head_on_disk(side, store, keyer)
    assert len(store.handles) == 1 and store.handles[0].num_reads == 3  # read starts on arrival
    n, is_async = side.get_num_new_matched_tokens(r, 0)
    assert (n, is_async) == (768, True)
    side.update_state_after_alloc(r, list(range(100, 109)), 768)
    assert side.counters.snapshot()["prefetch_late"] == 1
    so = SimpleNamespace(scheduled_new_reqs=[], scheduled_cached_reqs=SimpleNamespace(req_ids=[]),
                         num_scheduled_tokens={}, total_num_scheduled_tokens=0)
    # The worker gets the job at once and copies each chunk as it reaches DRAM ...
    meta = side.build_connector_meta(so)
    assert len(meta.loads) == 1 and meta.loads[0].is_async and meta.loads[0].awaits_prefetch
    assert meta.loads[0].block_ids == [[100, 101], [102, 103], [104, 105]]
    assert meta.settled == []  # still reading
    store.handles[0].finished = True
    meta = side.build_connector_meta(so)
    assert meta.loads == [] and meta.settled == [r.request_id]  # ... and learns when the reads are over
    assert side.build_connector_meta(so).settled == []  # once


def test_an_empty_step_with_requests_parked_on_their_reads_waits_for_them_instead_of_spinning(monkeypatch):
    """Issue 48: vLLM steps again at once after an empty step and spins on its core waiting for each step's
    reply, so an engine whose requests were all parked spun until their reads were done, on the core the reads
    need (slow reads stalled 10-200 s). Each empty step now sleeps until the next read lands."""
    import threading

    from kvprefetch.vllm import scheduler

    monkeypatch.setattr(scheduler, "PARKED_WAIT_S", 1.0)  # the cap, long enough to tell a wait from none here
    side, store, keyer, _ = make_scheduler(prefetch=False)  # ondemand: the reads start when the request parks
    r, keys = arrive_with_head_on_disk(side, store, keyer)
    assert side.get_num_new_matched_tokens(r, 0) == (768, True)
    side.update_state_after_alloc(r, list(range(100, 109)), 768)
    empty = SimpleNamespace(scheduled_new_reqs=[], scheduled_cached_reqs=SimpleNamespace(req_ids=[]),
                            num_scheduled_tokens={}, total_num_scheduled_tokens=0)
    t0 = time.monotonic()
    assert len(side.build_connector_meta(empty).loads) == 1
    assert time.monotonic() - t0 < 0.5, "the step that hands the job over does not wait"
    handle = store.handles[0]
    landed_at = []

    def reads():  # (an I/O thread) one read lands every 0.1 s
        for k in keys[:3]:
            time.sleep(0.1)
            landed_at.append(time.monotonic())
            handle.land(k)

    reader = threading.Thread(target=reads)
    reader.start()
    steps, settled = 0, []
    while not settled and time.monotonic() - t0 < 5.0:  # vLLM's loop while every request it has is parked
        settled = side.build_connector_meta(empty).settled
        steps += 1
    reader.join()
    assert steps <= 3 * 2 + 2, f"{steps} empty steps for 3 reads in 0.3 s: the engine spun"
    assert settled == [r.request_id]
    assert time.monotonic() - landed_at[-1] < 0.5, "settled as the last read landed, not at the cap"
    side.update_connector_output(SimpleNamespace(finished_recving={r.request_id}))  # the worker copied them
    t0 = time.monotonic()
    side.build_connector_meta(empty)
    assert time.monotonic() - t0 < 0.5, "nothing parked: nothing to wait for"
    # A parked request whose reads do not move costs each empty step the cap, never a hang
    r2 = req(r.prompt_token_ids)  # the same prompt
    side.on_new_request(r2)
    assert side.get_num_new_matched_tokens(r2, 0)[1]
    side.update_state_after_alloc(r2, list(range(200, 209)), 768)
    side.build_connector_meta(empty)
    t0 = time.monotonic()
    assert side.build_connector_meta(empty).settled == []
    assert 1.0 <= time.monotonic() - t0 < 3.0


def test_a_step_whose_in_step_load_joins_reads_in_flight_waits_for_them_before_the_workers_start_it():
    """Issue 48: the workers' in-step wait for a late prefetch's reads left vLLM's engine core spinning on its core
    (reads stalled about 1 s a step); the scheduler waits for them, blocked, before it hands the step over."""
    import threading

    side, store, keyer, _ = make_scheduler(load_mode="auto")
    side.cost.observe_prefill(256, 0.5)  # a slow engine: loading always pays
    side.cost.observe_disk(10_000, 0.01)
    # the prefetch starts, and stays in flight until the test lands it
    r, keys = arrive_with_head_on_disk(side, store, keyer)
    assert side.get_num_new_matched_tokens(r, 0) == (768, False), "idle engine: the late prefetch ends in the step"
    side.update_state_after_alloc(r, list(range(100, 109)), 768)
    handle = store.handles[0]
    landed_at = []

    def reads():
        for k in keys[:3]:
            time.sleep(0.1)
            landed_at.append(time.monotonic())
            handle.land(k)

    step = SimpleNamespace(scheduled_new_reqs=[], scheduled_cached_reqs=SimpleNamespace(req_ids=[]),
                           num_scheduled_tokens={r.request_id: 332}, total_num_scheduled_tokens=332)
    reader = threading.Thread(target=reads)
    reader.start()
    meta = side.build_connector_meta(step)
    returned, pending = time.monotonic(), handle.pending()
    reader.join()
    assert len(meta.loads) == 1 and not meta.loads[0].is_async
    assert pending == 0, "the workers get the step once its reads are in DRAM"
    assert 0 <= returned - landed_at[-1] < 0.5


def test_scheduler_sync_mode_loads_disk_hits_inside_the_step():
    side, store, keyer, _ = make_scheduler(prefetch=False, load_mode="sync")
    toks = list(range(1100))
    for k in keyer.keys(toks)[:2]:
        store.tiers[k] = "disk"
    r = req(toks)
    side.on_new_request(r)
    assert side.get_num_new_matched_tokens(r, 0) == (512, False)  # a sync load, even from disk
    side.update_state_after_alloc(r, list(range(10, 19)), 512)
    assert store.handles == []  # the worker reads them inside the step, not the scheduler
    so = SimpleNamespace(scheduled_new_reqs=[], scheduled_cached_reqs=SimpleNamespace(req_ids=[]),
                         num_scheduled_tokens={}, total_num_scheduled_tokens=0)
    job = side.build_connector_meta(so).loads[0]
    assert not job.is_async and job.on_disk == 2
    assert side.counters.snapshot()["demand_reads"] == 1


def test_scheduler_recomputes_when_the_disk_is_slow():
    side, store, keyer, _ = make_scheduler(prefetch=False)
    side.cost.observe_prefill(2560, 0.1)  # 25.6k tok/s: 10 ms per chunk
    side.cost.observe_disk(1000, 1.0)  # 1 kB/s: a 1000-byte chunk takes a second to read
    toks = list(range(1100))
    keys = keyer.keys(toks)
    store.tiers.update({keys[0]: "dram", keys[1]: "disk", keys[2]: "disk"})
    r = req(toks)
    side.on_new_request(r)
    assert side.get_num_new_matched_tokens(r, 0) == (256, False)  # the DRAM head only: a split
    side.update_state_after_alloc(r, list(range(9)), 256)
    assert side.counters.snapshot()["recomputed_slower_chunks"] == 2


def test_a_rule_that_recomputes_because_the_disk_looked_slow_measures_it_again_and_loads_once_it_is_fast():
    """Recomputing reads nothing: without a probe, a slow moment (here the prior) would never be corrected."""
    from kvprefetch.keys import ChunkKeyer, KVNamespace
    from kvprefetch.vllm.scheduler import SchedulerSide

    now = [0.0]
    ns = KVNamespace(model="m", num_layers=2, num_kv_heads=1, head_dim=8, dtype="float32")
    keyer, store = ChunkKeyer(ns, 256), FakeStore()

    def side_with(interval):
        settings = parse_extra_config({"prefetch": False, "disk_bps_prior": 1000.0, "prefill_tps_prior": 25600.0,
                                       "disk_probe_interval_s": interval})  # fmt: skip
        return SchedulerSide(settings, keyer, store, block_size=128, blocks_per_chunk=2, chunk_bytes=1000,
                             counters=ConnectorCounters("scheduler"), get_block_ids=lambda rid: [],
                             clock=lambda: now[0])  # fmt: skip

    side = side_with(2.0)
    toks = list(range(1100))
    keys = keyer.keys(toks)
    store.tiers.update({k: "disk" for k in keys[:3]})
    r = req(toks)
    side.on_new_request(r)
    assert side.get_num_new_matched_tokens(r, 0) == (0, False), "1 kB/s (the prior): 1 s a chunk, 10 ms to compute"
    side.update_state_after_alloc(r, [], 0)  # vLLM admits it: the probe starts
    assert len(store.handles) == 1 and store.handles[0].reads == keys[:3], "read in the background, to measure"
    assert side.counters.snapshot()["disk_probe_chunks"] == 3
    r2 = req(r.prompt_token_ids)  # the same prompt
    side.on_new_request(r2)
    assert side.get_num_new_matched_tokens(r2, 0) == (0, False)
    side.update_state_after_alloc(r2, [], 0)
    assert len(store.handles) == 1, "one probe at a time"
    now[0] += 0.003  # the probe's three reads land in 3 ms: 1 MB/s
    for _ in range(3):
        side.disk_meter.completed(True, 1000)
    r3 = req(toks)
    side.on_new_request(r3)
    assert side.get_num_new_matched_tokens(r3, 0) == (768, True), "the disk is fast now: load"
    now[0] += 10.0  # slow again, freshly measured: the next probe waits for the estimate to age
    for _ in range(10):
        side.cost.observe_disk(1000, 1.0)
    r4 = req(toks)
    side.on_new_request(r4)
    assert side.get_num_new_matched_tokens(r4, 0) == (0, False)
    side.update_state_after_alloc(r4, [], 0)
    assert len(store.handles) == 1, "a fresh estimate"
    never = side_with(0.0)
    r5 = req(toks)
    never.on_new_request(r5)
    assert never.get_num_new_matched_tokens(r5, 0) == (0, False)
    never.update_state_after_alloc(r5, [], 0)
    assert len(store.handles) == 1, "0: never probes"


def test_in_step_loads_planned_for_a_step_queue_ahead_of_the_next_requests_reads():
    """Sync loads of one step share the disk: the second request of a burst is weighed behind the first's reads."""
    side, store, keyer, _ = make_scheduler(prefetch=False, load_mode="sync")
    side.cost.observe_prefill(2560, 0.1)  # 10 ms to compute a chunk
    side.cost.observe_disk(1000, 0.006)  # 6 ms to read one
    toks = list(range(1100))
    for k in keyer.keys(toks)[:3]:
        store.tiers[k] = "disk"
    a, b, c = req(toks), req(toks), req(toks)
    for r in (a, b, c):
        side.on_new_request(r)
    assert side.get_num_new_matched_tokens(a, 0) == (768, False), "18 ms of reads against 30 ms of compute"
    side.update_state_after_alloc(a, list(range(9)), 768)
    assert side.get_num_new_matched_tokens(b, 0) == (0, False), "behind a's 18 ms, its own would end at 36 ms"
    so = SimpleNamespace(scheduled_new_reqs=[], scheduled_cached_reqs=SimpleNamespace(req_ids=[]),
                         num_scheduled_tokens={}, total_num_scheduled_tokens=0)
    side.build_connector_meta(so)  # the step with a's reads runs; the next is scheduled after it
    assert side.get_num_new_matched_tokens(c, 0) == (768, False), "nothing planned ahead of it in its step"


def test_scheduler_sync_load_from_dram_skips_engine_prefix_and_keeps_one_token():
    side, store, keyer, _ = make_scheduler(prefetch=False)
    toks = list(range(1024))  # exactly four chunks: the last can't be a hit (a token must be computed)
    for k in keyer.keys(toks):
        store.tiers[k] = "dram"
    r = req(toks)
    side.on_new_request(r)
    assert store.handles == []
    n, is_async = side.get_num_new_matched_tokens(r, 384)  # engine holds 3 blocks already
    assert (n, is_async) == (768 - 384, False)
    side.update_state_after_alloc(r, list(range(200, 208)), n)
    so = SimpleNamespace(scheduled_new_reqs=[], scheduled_cached_reqs=SimpleNamespace(req_ids=[]),
                         num_scheduled_tokens={}, total_num_scheduled_tokens=0)
    job = side.build_connector_meta(so).loads[0]
    assert not job.is_async
    assert job.block_ids == [[-1, 203], [204, 205]]  # block 202 is the engine's own, the rest is loaded


def test_scheduler_saves_whole_chunks_and_holds_blocks_while_saving():
    from kvprefetch.vllm.metadata import KVPrefetchWorkerMeta

    side, _, _, blocks = make_scheduler()
    toks = list(range(600))
    r = req(toks)
    side.on_new_request(r)
    assert side.get_num_new_matched_tokens(r, 0) == (0, False)
    blocks[r.request_id] = list(range(10, 15))
    nr = SimpleNamespace(req_id=r.request_id, num_computed_tokens=0)
    so = SimpleNamespace(scheduled_new_reqs=[nr], scheduled_cached_reqs=SimpleNamespace(req_ids=[]),
                         num_scheduled_tokens={r.request_id: 600}, total_num_scheduled_tokens=600)
    meta = side.build_connector_meta(so)
    assert len(meta.saves) == 1 and meta.saves[0].block_ids == [[10, 11], [12, 13]]
    assert side.request_finished(r) is True  # the save may still be reading the blocks
    so2 = SimpleNamespace(scheduled_new_reqs=[], scheduled_cached_reqs=SimpleNamespace(req_ids=[]),
                          num_scheduled_tokens={}, total_num_scheduled_tokens=0)
    assert side.build_connector_meta(so2).await_saves == [r.request_id]
    # A request whose save the worker confirmed is released at once.
    r2 = req(list(range(5000, 5300)))
    side.on_new_request(r2)
    blocks[r2.request_id] = [1, 2, 3]
    so3 = SimpleNamespace(scheduled_new_reqs=[SimpleNamespace(req_id=r2.request_id, num_computed_tokens=0)],
                          scheduled_cached_reqs=SimpleNamespace(req_ids=[]),
                          num_scheduled_tokens={r2.request_id: 300}, total_num_scheduled_tokens=300)
    job = side.build_connector_meta(so3).saves[0]
    side.update_connector_output(SimpleNamespace(kv_connector_worker_meta=KVPrefetchWorkerMeta({job.job_id: 1})))
    assert side.request_finished(r2) is False


def test_scheduler_holds_prefetched_chunks_in_dram_until_the_request_is_served(tmp_path):
    """Prefetched chunks are pinned as they land, so later arrivals cannot evict them before their request is
    served; the pins go when it is (here: when it finishes), and never exceed half the DRAM tier."""
    import uuid

    import numpy as np

    from kvprefetch.config import StoreConfig
    from kvprefetch.keys import ChunkKeyer, KVNamespace
    from kvprefetch.store import TieredStore
    from kvprefetch.vllm.scheduler import SchedulerSide

    chunk = 4096
    cfg = {"dram": {"capacity_bytes": 64 * 8192}, "disk": {"path": str(tmp_path), "fsync": False}}
    keyer = ChunkKeyer(KVNamespace(model="m", num_layers=2, num_kv_heads=1, head_dim=8, dtype="float32"), 256)
    toks = list(range(1100))
    keys = keyer.keys(toks)
    pools = []
    try:
        pools.append(f"kvpt-{uuid.uuid4().hex[:8]}")
        writer = TieredStore(StoreConfig.from_dict(cfg | {"dram": cfg["dram"] | {"pool_name": pools[-1]}}), chunk)
        writer.put(keys, [np.full(chunk, i, np.uint8) for i in range(len(keys))]).result(timeout=30)
        writer.close()
        pools.append(f"kvpt-{uuid.uuid4().hex[:8]}")  # a fresh DRAM pool: the chunks are on disk only
        settings = parse_extra_config(cfg | {"dram": cfg["dram"] | {"pool_name": pools[-1]}})
        store = TieredStore(settings.store, chunk)
        side = SchedulerSide(settings, keyer, store, block_size=128, blocks_per_chunk=2, chunk_bytes=chunk,
                             counters=ConnectorCounters("scheduler"))
        r = req(toks)
        side.on_new_request(r)
        assert side.reqs[r.request_id].prefetch.wait(10)
        deadline = time.monotonic() + 5
        while side.holds.held < len(keys) and time.monotonic() < deadline:
            time.sleep(0.01)
        assert side.holds.held == len(keys) and store.dram.stats()["slots_pinned"] == len(keys)
        assert side.holds.budget == 64 * 8192 // chunk // 2
        side.request_finished(r)
        assert side.holds.held == 0 and store.dram.stats()["slots_pinned"] == 0
        store.close()
    finally:
        from pathlib import Path

        for n in pools:
            for f in Path("/dev/shm").glob(f"*{n}*"):
                f.unlink(missing_ok=True)


def test_scheduler_auto_mode_finishes_a_late_prefetch_in_the_step_unless_that_stalls_a_busy_batch():
    """load_mode auto: a request reached with its prefetch still in flight is not parked for a step when its
    reads cost the batch less than the step it would wait; on a busy engine with long reads it is."""
    side, store, keyer, _ = make_scheduler(load_mode="auto")
    side.cost.observe_prefill(256, 0.5)  # a slow engine: loading always pays
    side.cost.observe_disk(10_000, 0.01)  # 1 MB/s: a 1000-byte chunk in 1 ms
    toks = list(range(1100))
    for k in keyer.keys(toks)[:3]:
        store.tiers[k] = "disk"
    r = req(toks)
    side.on_new_request(r)  # the prefetch starts, and (fake store) stays in flight
    assert side.get_num_new_matched_tokens(r, 0) == (768, False)  # idle engine: read in the step
    side.update_state_after_alloc(r, list(range(9)), 768)
    assert side.counters.snapshot()["finished_in_step"] == 1 and side.counters.snapshot()["prefetch_late"] == 1
    # a busy engine (4 running, 5 ms steps) and reads of 100 ms: parking costs this request less than stalling 5
    busy = SimpleNamespace(scheduled_new_reqs=[], scheduled_cached_reqs=SimpleNamespace(req_ids=[]),
                           num_scheduled_tokens={f"x{i}": 1 for i in range(4)}, total_num_scheduled_tokens=4)
    store.handles[0].finished = True  # r's reads are over (in its step): no queue ahead of r2's
    side.build_connector_meta(busy)
    side.cost.observe_disk(1000, 0.1)
    r2 = req(toks[:1000] + [7] * 100)
    side.on_new_request(r2)
    assert side.get_num_new_matched_tokens(r2, 0) == (768, True)
    side.update_state_after_alloc(r2, list(range(9, 18)), 768)
    assert side.counters.snapshot()["finished_in_step"] == 1


def test_scheduler_tp2_hit_needs_every_rank_and_prefetches_and_holds_both(tmp_path):
    """Rank 1 has only the first two of four chunks: the hit is two chunks; both ranks' parts are read into
    DRAM on arrival, held there for the request, handed to the workers under each rank's keys, and released
    once the load has run."""
    import uuid
    from pathlib import Path

    import numpy as np

    from kvprefetch.config import StoreConfig
    from kvprefetch.keys import ChunkKeyer, KVNamespace
    from kvprefetch.store import TieredStore
    from kvprefetch.vllm.scheduler import Phase, SchedulerSide

    chunk = 4096
    cfg = {"dram": {"capacity_bytes": 64 * 8192}, "disk": {"path": str(tmp_path), "fsync": False}}
    ns = KVNamespace(model="m", num_layers=2, num_kv_heads=1, head_dim=8, dtype="float32", tp_size=2)
    keyer = ChunkKeyer(ns, 256)
    toks = list(range(1100))
    k0, k1 = (k.keys(toks) for k in keyer.rank_keyers())
    pools = [f"kvpt-{uuid.uuid4().hex[:8]}" for _ in range(2)]
    try:
        writer = TieredStore(StoreConfig.from_dict(cfg | {"dram": cfg["dram"] | {"pool_name": pools[0]}}), chunk)
        writer.put(k0 + k1[:2], [np.full(chunk, i, np.uint8) for i in range(6)]).result(timeout=30)
        writer.close()
        settings = parse_extra_config(cfg | {"dram": cfg["dram"] | {"pool_name": pools[1]}})  # fresh DRAM
        store = TieredStore(settings.store, chunk)
        side = SchedulerSide(settings, keyer, store, block_size=128, blocks_per_chunk=2, chunk_bytes=chunk,
                             counters=ConnectorCounters("scheduler"))  # fmt: skip
        assert side.tp_size == 2 and side.cost.chunk_bytes == 2 * chunk  # the rule weighs every rank's bytes
        r = req(toks)
        side.on_new_request(r)
        st = side.reqs[r.request_id]
        assert st.phase is Phase.PREFETCHING and st.prefetch is not None and st.prefetch.num_reads == 4
        assert side.wait_for_reads(30)
        assert side.get_num_new_matched_tokens(r, 0) == (512, False)  # two chunks, both ranks in DRAM: sync
        side.update_state_after_alloc(r, list(range(10, 19)), 512)
        ranks = side.rank_counters.snapshot()
        for rank in (0, 1):
            assert ranks[rank]["prefetched_chunks"] == 2 and ranks[rank]["reached_in_dram_chunks"] == 2
        assert st.phase is Phase.LOADING and st.holds == {*k0[:2], *k1[:2]} and side.holds.held == 4
        so = SimpleNamespace(scheduled_new_reqs=[], scheduled_cached_reqs=SimpleNamespace(req_ids=[]),
                             num_scheduled_tokens={}, total_num_scheduled_tokens=0)  # fmt: skip
        job = side.build_connector_meta(so).loads[0]
        assert job.keys == [k0[:2], k1[:2]] and job.block_ids == [[10, 11], [12, 13]] and not job.is_async
        side.build_connector_meta(so)  # the step with the load has run
        assert st.phase is Phase.DONE and side.holds.held == 0 and store.dram.stats()["slots_pinned"] == 0
        side.request_finished(r)
        store.close()
    finally:
        for n in pools:
            for f in Path("/dev/shm").glob(f"*{n}*"):
                f.unlink(missing_ok=True)


# ---- asking decides, admitting acts (vLLM may ask more than once before it admits a request) ------------------


def slow_disk_request(side, store, keyer):
    """A request whose head chunk is in DRAM and whose next two are on a disk the rule finds too slow (a 1 kB/s
    prior, never measured: stale), their prefetch still in flight."""
    toks = list(range(1100))
    keys = keyer.keys(toks)
    store.tiers.update({keys[0]: "dram", keys[1]: "disk", keys[2]: "disk"})
    r = req(toks)
    side.on_new_request(r)
    return r, keys


def test_asking_has_no_effect_until_vllm_admits_the_request():
    """get_num_new_matched_tokens only decides: the reads it would drop, the probe it would start, the counts and
    the phase change all wait for update_state_after_alloc, and happen once however often vLLM asked."""
    from kvprefetch.vllm.scheduler import Phase

    side, store, keyer, _ = make_scheduler(disk_bps_prior=1000.0, prefill_tps_prior=25600.0)
    r, keys = slow_disk_request(side, store, keyer)
    st, prefetch = side.reqs[r.request_id], store.handles[0]
    before = side.counters.snapshot()
    for _ in range(3):  # vLLM skipped it twice (its blocks did not fit), then admits it
        assert side.get_num_new_matched_tokens(r, 0) == (256, False), "the DRAM head only"
    assert side.counters.snapshot() == before and side.rank_counters.snapshot()[0].get("reached_hit_chunks", 0) == 0
    assert prefetch.cancelled == [] and len(store.handles) == 1 and st.phase is Phase.PREFETCHING
    side.update_state_after_alloc(r, list(range(9)), 256)
    counts = side.counters.snapshot()
    assert prefetch.cancelled == keys[1:3] and counts["prefetch_cancelled_chunks"] == 2, "reads it recomputes"
    assert counts["recomputed_slower_chunks"] == 2 and counts["prefetch_late"] == 1
    assert len(store.handles) == 2 and counts["disk_probe_chunks"] == 2, "the stale disk rate measured again"
    assert st.phase is Phase.LOADING and st.plan is None


def test_a_request_vllm_did_not_admit_is_decided_afresh_and_only_the_admitted_plan_acts():
    """A plan vLLM never admitted leaves no trace: had its drops happened when it was asked, the reads the next
    plan loads from would have been dropped already."""
    side, store, keyer, _ = make_scheduler(disk_bps_prior=1000.0, prefill_tps_prior=25600.0)
    r, _ = slow_disk_request(side, store, keyer)
    assert side.get_num_new_matched_tokens(r, 0) == (256, False)  # not admitted: the disk looks slow
    for _ in range(10):
        side.cost.observe_disk(1000, 0.0001)  # measured fast meanwhile
    assert side.get_num_new_matched_tokens(r, 0) == (768, True), "load all three, parked on the prefetch"
    side.update_state_after_alloc(r, list(range(9)), 768)
    assert store.handles[0].cancelled == [] and side.counters.snapshot()["recomputed_slower_chunks"] == 0
    assert len(store.handles) == 1, "no probe: the rate is fresh"


def test_a_recompute_answer_vllm_admits_releases_the_requests_holds_then():
    """A request the rule recomputes leaves the holding phases when vLLM admits it, which releases its pins."""
    from kvprefetch.vllm.scheduler import Phase

    side, store, keyer, _ = make_scheduler(load_policy="auto")
    toks = list(range(600))
    keys = keyer.keys(toks)
    store.tiers[keys[0]] = "dram"
    r = req(toks)
    side.on_new_request(r)
    st = side.reqs[r.request_id]
    assert st.holds == {keys[0]} and store.pins == [keys[0]]
    assert side.get_num_new_matched_tokens(r, 300) == (0, False)  # the engine has the chunk already
    assert st.holds == {keys[0]}, "still held while vLLM has not admitted it"
    side.update_state_after_alloc(r, [], 0)
    assert st.phase is Phase.RECOMPUTED and st.holds == set() and store.pins == []


def test_waiting_for_a_save_in_flight_is_set_when_vllm_first_asks():
    """The one effect of asking: a None answer (wait for the save of the chunk after the hit) gets no call back
    from vLLM, so its deadline is set, and counted, the first time it is asked; later asks are held to it."""
    now = [100.0]
    side, store, keyer, _ = make_scheduler(prefill_tps_prior=2560.0, clock=lambda: now[0])  # 0.1 s a chunk
    toks = list(range(1100))
    keys = keyer.keys(toks)
    store.tiers[keys[0]] = "dram"
    store.writing = lambda key: key == keys[1]  # chunk 1 is being written into DRAM (a save of the turn before)
    r = req(toks)
    side.on_new_request(r)
    assert side.get_num_new_matched_tokens(r, 0) == (None, False)
    assert side.counters.snapshot()["joined_saves"] == 1 and side.reqs[r.request_id].join_until == 100.2
    now[0] += 0.1
    assert side.get_num_new_matched_tokens(r, 0) == (None, False) and side.counters.snapshot()["joined_saves"] == 1
    now[0] += 0.15  # past recomputing chunks 0 and 1: stop waiting, load what is there
    assert side.get_num_new_matched_tokens(r, 0) == (256, False)


# ---- issue 59: a request never waits for KV without bound -------------------------------------------------------


def empty_step(tokens: int = 0) -> SimpleNamespace:
    """A step's output as vLLM builds it: nothing scheduled (or `tokens` of a running request's decode)."""
    running = {"other": tokens} if tokens else {}
    return SimpleNamespace(scheduled_new_reqs=[], scheduled_cached_reqs=SimpleNamespace(req_ids=[]),
                           num_scheduled_tokens=running, total_num_scheduled_tokens=tokens)  # fmt: skip


def parked(side, store, keyer):
    """A request parked on its 3 disk chunks, its load handed to the workers: (request, keys)."""
    r, keys = arrive_with_head_on_disk(side, store, keyer)
    r.num_preemptions = 0
    assert side.get_num_new_matched_tokens(r, 0) == (768, True)
    side.update_state_after_alloc(r, list(range(100, 109)), 768)
    assert len(side.build_connector_meta(empty_step()).loads) == 1
    return r, keys


def test_a_request_asked_again_after_its_async_load_failed_is_not_parked_again():
    """Issue 59: the workers reported the load finished with its first blocks failed (a damaged file they removed),
    and vLLM asks again from token 0. vLLM still counts the request among its in-flight prefills, whose remaining
    blocks an async admission must leave free: parked again, it needed its blocks twice over, never fitted, and
    headed vLLM's queue of requests holding KV, so no request ran for minutes. It loads what DRAM holds in the
    step instead (here: nothing, the scheduler's own index still lists the damaged chunk on disk)."""
    side, store, keyer, _ = make_scheduler()
    r, keys = parked(side, store, keyer)
    store.handles[0].finished = True  # (its reads ended: DRAM was full)
    side.update_connector_output(SimpleNamespace(finished_recving={r.request_id}))
    assert side.get_num_new_matched_tokens(r, 0) == (0, False), "computes its prompt"
    side.update_state_after_alloc(r, [], 0)
    assert side.counters.snapshot()["reasked_unparked"] == 1
    # what is in DRAM by then is loaded, inside the step
    store.tiers[keys[0]] = "dram"
    assert side.get_num_new_matched_tokens(r, 0) == (256, False)
    # preempted since (vLLM dropped its reservation with its blocks): it may be parked again
    r.num_preemptions = 1
    store.tiers[keys[0]] = "disk"
    assert side.get_num_new_matched_tokens(r, 0) == (768, True)
    assert side.counters.snapshot()["stalls_released"] == 0


def test_a_parked_load_unfinished_past_its_bound_is_released_to_compute(monkeypatch):
    """The watchdog on parked loads: whatever holds one up, the workers are told to report it finished (what they
    did not copy as load errors) once it has waited twice its prefix's recompute time, at least STALL_MIN_S."""
    from kvprefetch.vllm import scheduler

    monkeypatch.setattr(scheduler, "PARKED_WAIT_S", 0.001)
    now = [0.0]
    side, store, keyer, _ = make_scheduler(prefill_tps_prior=2560.0, clock=lambda: now[0])  # 768 tokens: 0.3 s
    r, _ = parked(side, store, keyer)
    now[0] = scheduler.STALL_MIN_S - 0.1
    assert side.build_connector_meta(empty_step()).release_loads == []
    now[0] = scheduler.STALL_MIN_S + 0.1
    meta = side.build_connector_meta(empty_step())
    assert meta.release_loads == [r.request_id]
    assert store.handles[0].cancelled, "its reads still queued are dropped"
    assert side.counters.snapshot()["stalls_released"] == 1
    assert side.build_connector_meta(empty_step()).release_loads == [], "once"
    side.update_connector_output(SimpleNamespace(finished_recving={r.request_id}))  # the workers let it go
    assert side.get_num_new_matched_tokens(r, 0) == (0, False), "then computes, never parked again"
    # a longer prefix on a slow engine waits longer, and never more than STALL_MAX_S
    assert side._wait_bound_s(256) == scheduler.STALL_MIN_S
    side.cost.prefill_tps.value = 100.0
    assert side._wait_bound_s(256) == scheduler.STALL_MAX_S
    side.cost.prefill_tps.value = 200.0
    assert side._wait_bound_s(256) == 2.56


def test_a_request_vllm_never_admits_while_the_engine_computes_nothing_is_answered_without_parking():
    """The watchdog on waits to be admitted: vLLM is answered "wait" and skips the request every step. While other
    requests run, it is short of blocks they will free; while nothing runs past the bound, it is stuck (a cause
    not known here): the request is answered again without parking, and counted once vLLM admits it."""
    from kvprefetch.vllm import scheduler

    now = [0.0]
    side, store, keyer, _ = make_scheduler(prefill_tps_prior=2560.0, clock=lambda: now[0])
    r, _ = arrive_with_head_on_disk(side, store, keyer)
    assert side.get_num_new_matched_tokens(r, 0) == (768, True)  # (vLLM cannot admit it: no alloc)
    for _ in range(5):  # others run: a wait for blocks, however long
        now[0] += scheduler.STALL_MAX_S
        side.build_connector_meta(empty_step(tokens=1))
        assert side.get_num_new_matched_tokens(r, 0) == (768, True)
    side.build_connector_meta(empty_step())  # nothing runs from here on
    now[0] += scheduler.STALL_MIN_S - 0.1
    assert side.get_num_new_matched_tokens(r, 0) == (768, True)
    now[0] += 0.2
    assert side.get_num_new_matched_tokens(r, 0) == (0, False)
    assert side.counters.snapshot()["stalls_released"] == 0, "counted when vLLM admits it on that answer"
    side.update_state_after_alloc(r, [], 0)
    assert side.counters.snapshot()["stalls_released"] == 1


def test_a_hybrid_model_loads_a_windows_blocks_between_steps_and_saves_chunks_with_their_window_resident():
    """Several KV cache groups (`groups`: a sliding group with a 96-token window, a full one): a DRAM hit loads
    between steps, the sliding group's blocks inside the window before the hit's end only; a request whose first
    chunks came from vLLM's own prefix cache (the sliding group holds only the window before its end) saves the
    chunks whose window tail is resident, no others."""
    from kvprefetch.keys import ChunkKeyer, KVNamespace
    from kvprefetch.vllm.groups import NULL_BLOCK, SKIP, KVGroup, KVGroups
    from kvprefetch.vllm.scheduler import SchedulerSide

    groups = KVGroups((KVGroup(0, "sliding_window", ("s",), window=95), KVGroup(1, "full_attention", ("f",))), 128)
    keyer = ChunkKeyer(KVNamespace(model="m", num_layers=2, num_kv_heads=1, head_dim=8, dtype="float32"), 256)
    store, blocks = FakeStore(), {}
    side = SchedulerSide(parse_extra_config({"save_policy": "all"}), keyer, store, block_size=128, blocks_per_chunk=2,
                         chunk_bytes=1000,
                         counters=ConnectorCounters("scheduler"), get_block_ids=lambda rid: blocks.get(rid, ()),
                         groups=groups)  # fmt: skip
    toks = list(range(1100))
    for k in keyer.keys(toks):
        store.tiers[k] = "dram"
    r = req(toks)
    side.on_new_request(r)
    assert side.get_num_new_matched_tokens(r, 0) == (1024, True)  # DRAM, yet between steps
    # vLLM's allocation for 1024 external tokens: the token at 1024 reads 929.., so blocks 0-6 are its null block
    side.update_state_after_alloc(r, ([NULL_BLOCK] * 7 + [57, 58], list(range(100, 109))), 1024)
    so = SimpleNamespace(scheduled_new_reqs=[], scheduled_cached_reqs=SimpleNamespace(req_ids=[]),
                         num_scheduled_tokens={}, total_num_scheduled_tokens=0)
    (job,) = side.build_connector_meta(so).loads
    assert job.is_async and job.block_ids[0] == [SKIP, SKIP, 100, 101] and job.block_ids[3] == [SKIP, 57, 106, 107]

    r2 = req(list(range(5000, 6100)))  # vLLM's prefix cache had its first 768 tokens: sliding blocks 0-4 are null
    side.on_new_request(r2)
    blocks[r2.request_id] = ([NULL_BLOCK] * 5 + [60, 61, 62, 63], list(range(200, 209)))
    step = SimpleNamespace(scheduled_new_reqs=[SimpleNamespace(req_id=r2.request_id, num_computed_tokens=768)],
                           scheduled_cached_reqs=SimpleNamespace(req_ids=[]),
                           num_scheduled_tokens={r2.request_id: 332}, total_num_scheduled_tokens=332)  # fmt: skip
    (save,) = side.build_connector_meta(step).saves
    # chunks 0 and 1 lack their window's tail (blocks 1 and 3): not saved; 2 and 3 are, their first block as null
    assert save.block_ids == [[NULL_BLOCK, 60, 204, 205], [NULL_BLOCK, 62, 206, 207]]
    assert save.keys == [keyer.keys(list(range(5000, 6100)))[2:4]]
    assert side.counters.snapshot()["window_unsaved_chunks"] == 2 and side.counters.snapshot()["saved_chunks"] == 2
