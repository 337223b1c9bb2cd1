"""Leases and warm-ups on the connector's scheduler side, over a real store (shared-memory DRAM pool, disk tier):
a finished request's chunks stay pinned until its next turn arrives or its lease expires; leases stay within
their budget; a warm-up reads disk chunks up into DRAM and leases them; a turn that follows its predecessor at
once waits for that turn's save still in flight instead of recomputing it."""

from __future__ import annotations

import itertools
import time
import uuid
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
from vllm_requests import vllm_request

from kvprefetch.keys import ChunkKeyer, KVNamespace
from kvprefetch.store import TieredStore
from kvprefetch.vllm.metadata import KVPrefetchWorkerMeta
from kvprefetch.vllm.metrics import ConnectorCounters
from kvprefetch.vllm.scheduler import SchedulerSide
from kvprefetch.vllm.settings import parse_extra_config

CHUNK_BYTES = 4096
C = 256
KEYER = ChunkKeyer(KVNamespace(model="m", num_layers=2, num_kv_heads=1, head_dim=8, dtype="float32"), C)
_ids = itertools.count()


class Clock:
    def __init__(self):
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


@pytest.fixture
def side(tmp_path):
    """A scheduler side over a 16-slot DRAM pool and a disk tier; its `put` puts chunks as a worker's save does."""
    made: list[tuple[SchedulerSide, TieredStore]] = []

    def make(**extra) -> SchedulerSide:
        pool = f"kvpt-lease-{uuid.uuid4().hex[:8]}"
        cfg = {"dram": {"capacity_bytes": 16 * (CHUNK_BYTES + 4096), "pool_name": pool},
               "disk": {"path": str(tmp_path / "disk"), "fsync": False}}  # fmt: skip
        settings = parse_extra_config(cfg | {"save_policy": "all"} | extra)  # (saves on first sight)
        store = TieredStore(settings.store, CHUNK_BYTES)
        blocks: dict[str, list[int]] = {}
        s = SchedulerSide(settings, KEYER, store, block_size=128, blocks_per_chunk=2, chunk_bytes=CHUNK_BYTES,
                          counters=ConnectorCounters("scheduler"), get_block_ids=lambda rid: blocks.get(rid, []),
                          clock=Clock())  # fmt: skip
        s.test_blocks = blocks
        made.append((s, store))
        return s

    yield make
    for s, store in made:
        s.leases.close()
        store.close()
        for f in Path("/dev/shm").glob(f"*{store.dram.name}*"):
            f.unlink(missing_ok=True)


def req(tokens, **params):
    return vllm_request(tokens, kv_transfer_params=params or None)


def put(store: TieredStore, tokens: list[int]) -> list[bytes]:
    keys = KEYER.keys(tokens)
    store.put(keys, [np.full(CHUNK_BYTES, i, np.uint8) for i in range(len(keys))]).result(timeout=30)
    return keys


def step(s: SchedulerSide, r, computed: int, new: int):
    """One engine step that computes `new` tokens of r (its blocks allocated): returns the step's metadata."""
    s.test_blocks[r.request_id] = list(range(100, 100 + (computed + new) // 128 + 1))
    nr = SimpleNamespace(req_id=r.request_id, num_computed_tokens=computed)
    so = SimpleNamespace(scheduled_new_reqs=[nr], scheduled_cached_reqs=SimpleNamespace(req_ids=[]),
                         num_scheduled_tokens={r.request_id: new}, total_num_scheduled_tokens=new)  # fmt: skip
    return s.build_connector_meta(so)


def saves_done(s: SchedulerSide, job_ids) -> None:
    s.update_connector_output(SimpleNamespace(kv_connector_worker_meta=KVPrefetchWorkerMeta(dict.fromkeys(job_ids, 1))))


def pinned(s: SchedulerSide) -> int:
    return s.store.dram.stats()["slots_pinned"]


def test_a_finished_requests_chunks_stay_leased_until_its_next_turn_arrives(side):
    s = side()
    turn1 = list(range(600))  # two whole chunks
    r1 = req(turn1, kvprefetch={"keep_warm_s": 30})  # per request, through vLLM's kv_transfer_params
    s.on_new_request(r1)
    assert s.get_num_new_matched_tokens(r1, 0) == (0, False)
    meta = step(s, r1, 0, 600)
    assert [len(j.keys[0]) for j in meta.saves] == [2]
    assert s.request_finished(r1) is True  # its save is in flight: the blocks are held
    assert s.leases.reserved == 2 and s.leases.pinned == 0, "leased, nothing in DRAM yet"
    put(s.store, turn1)  # the worker's save lands ...
    saves_done(s, [meta.saves[0].job_id])  # ... and is reported with the next step
    assert s.leases.pinned == 2 and pinned(s) == 2
    snap = s.counters.snapshot()
    assert snap["leases_granted"] == 1 and snap["lease_pinned_chunks"] == 2
    # The next turn (turn 1 + answer + a tool result) arrives: it holds the chunks itself, the lease has done its job.
    r2 = req(turn1 + list(range(5000, 5300)))
    s.on_new_request(r2)
    assert s.leases.snapshot()["leases"] == 0 and s.counters.snapshot()["leases_used"] == 1
    assert pinned(s) == 2, "held for the new turn now, not for the lease"
    s.request_finished(r2)  # no keep_warm_s: no lease
    assert pinned(s) == 0 and s.leases.snapshot()["leases"] == 0


def test_no_lease_without_keep_warm_s_and_a_bad_value_is_ignored(side):
    s = side()
    for params in ({}, {"kvprefetch": {"keep_warm_s": "soon"}}, {"kvprefetch": {"keep_warm_s": -1}}):
        r = req(list(range(300)), **params)
        s.on_new_request(r)
        s.get_num_new_matched_tokens(r, 0)
        step(s, r, 0, 300)
        s.request_finished(r)
    assert s.counters.snapshot()["leases_granted"] == 0
    s2 = side(keep_warm_s=5)  # the connector's own default
    r = req(list(range(300)))
    s2.on_new_request(r)
    s2.get_num_new_matched_tokens(r, 0)
    step(s2, r, 0, 300)
    s2.request_finished(r)
    assert s2.counters.snapshot()["leases_granted"] == 1


def test_leases_expire_and_never_hold_more_than_their_budget(side):
    s = side(lease_budget_share=0.25)  # 16 slots: 4 chunks for leases
    assert s.leases.budget == 4
    heads = [list(range(1000 * i, 1000 * i + 512)) for i in range(4)]  # two chunks each
    for h in heads:
        put(s.store, h)
    a = s.warm(heads[0], 10, "a")
    s.clock.t += 1
    s.warm(heads[1], 10, "b")
    assert (a.in_dram, s.leases.pinned, pinned(s)) == (2, 4, 4)
    s.warm(heads[2], 10, "c")  # no room: the oldest lease ends
    assert s.leases.get("a") is None and s.leases.pinned == 4 and pinned(s) == 4
    assert s.counters.snapshot()["leases_evicted"] == 1
    five = list(range(30000, 30000 + 5 * C))
    put(s.store, five)
    big = s.warm(five, 10, "big")  # 5 chunks: cut to the 4 that fit, every older lease gives way
    assert (big.chunks, big.in_dram, big.leased_keys) == (5, 5, 4)
    assert s.leases.reserved == 4 and pinned(s) == 4 and s.leases.get("c") is None
    s.clock.t += 11
    assert s.warm_status("big") is None, "expired"
    assert s.leases.pinned == 0 and pinned(s) == 0 and s.counters.snapshot()["leases_expired"] >= 1


def test_a_warm_up_reads_disk_chunks_into_dram_and_leases_them(side):
    s = side()
    head = list(range(1100))  # four whole chunks and a tail
    keys = put(s.store, head)
    s.store.dram.destroy()  # a fresh pool: the chunks are on disk only
    s.store.dram = type(s.store.dram)(s.store.dram.name, s.store.image_bytes, 16 * (CHUNK_BYTES + 4096))
    counts = s.warm(head + [1, 2, 3] * 200, 30, "w1")  # the named prefix runs past what is cached
    assert (counts.chunks, counts.in_dram, counts.on_disk, counts.missing) == (6, 0, 4, 2)
    deadline = time.monotonic() + 10
    while (now := s.warm_status("w1")).in_dram < 4 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert now.in_dram == 4 and s.store.in_dram(keys) == [True] * 4
    deadline = time.monotonic() + 5
    while s.leases.pinned < 4 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert s.leases.pinned == 4 and pinned(s) == 4, "each chunk pinned as it landed"
    assert s.counters.snapshot()["warm_read_chunks"] == 4
    assert s.end_lease("w1") and not s.end_lease("w1") and s.warm_status("w1") is None
    assert pinned(s) == 0
    nothing = s.warm(list(range(7000, 7600)), 30, "w2")
    assert (nothing.chunks, nothing.missing, nothing.in_dram) == (2, 2, 0)


def test_a_turn_waits_for_its_predecessors_save_in_flight_instead_of_recomputing(side):
    s = side()
    turn1 = list(range(600))
    r1 = req(turn1)
    s.on_new_request(r1)
    s.get_num_new_matched_tokens(r1, 0)
    meta = step(s, r1, 0, 600)
    s.request_finished(r1)
    r2 = req(turn1 + list(range(5000, 5200)))
    s.on_new_request(r2)
    assert s.get_num_new_matched_tokens(r2, 0) == (None, False), "its head is being saved: ask again next step"
    assert s.counters.snapshot()["joined_saves"] == 1
    put(s.store, turn1)
    saves_done(s, [meta.saves[0].job_id])
    n, is_async = s.get_num_new_matched_tokens(r2, 0)
    assert n == 2 * C and not is_async, "loaded from DRAM, not recomputed"
    # A save that never lands is waited for only up to io.join_timeout_s, then the turn recomputes.
    r3 = req(list(range(20000, 20600)))
    s.on_new_request(r3)
    s.get_num_new_matched_tokens(r3, 0)
    step(s, r3, 0, 600)
    s.request_finished(r3)
    r4 = req(list(range(20000, 20700)))
    s.on_new_request(r4)
    assert s.get_num_new_matched_tokens(r4, 0) == (None, False)
    s.clock.t += s.settings.store.io.join_timeout_s + 0.1
    assert s.get_num_new_matched_tokens(r4, 0) == (0, False)
