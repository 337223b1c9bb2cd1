"""Save admission (`kvprefetch.vllm.admission`): the sketch that counts leading chunks, the request's own wish, the
verdict; and `SchedulerSide` applying it (save_policy seen: a prompt seen once saves nothing, a second time it
saves; warm-ups, leases on finish, hits and kv_transfer_params override; skipped chunks counted once, by reason)."""

from __future__ import annotations

import hashlib
from types import SimpleNamespace

import pytest
from test_scheduler import make_scheduler
from vllm_requests import vllm_request

from kvprefetch.vllm.admission import SeenSketch, save_verdict, save_wish


def key(i: int) -> bytes:
    return hashlib.sha256(i.to_bytes(8, "little")).digest()


# ---- the sketch ----------------------------------------------------------------------------------------------
def test_the_sketch_counts_sightings_and_answers_without_counting():
    s = SeenSketch(width=1024, depth=4)
    assert s.count(key(1)) == 0
    assert [s.record(key(1)) for _ in range(3)] == [0, 1, 2], "each sighting returns the sightings before it"
    assert s.count(key(1)) == 3 and s.count(key(1)) == 3, "a query counts nothing"
    assert s.count(key(2)) == 0
    assert s.record(b"short") == 0 and s.record(b"short") == 1, "a key too short to slice is hashed first"


def test_the_sketch_saturates_and_halves_every_window():
    s = SeenSketch(width=1024, depth=4, window=10, max_count=3)
    for _ in range(5):
        s.record(key(1))
    assert s.count(key(1)) == 3, "saturated"
    for i in range(2, 7):  # the 10th sighting halves every counter
        s.record(key(i))
    assert s.count(key(1)) == 1 and s.sightings == 0
    for i in range(10, 20):  # a prefix not seen again within about a window is forgotten
        s.record(key(i))
    assert s.count(key(1)) == 0


def test_the_sketch_rarely_counts_a_key_it_never_saw():
    s = SeenSketch()  # the scheduler's: 64 Ki columns x 4 rows, halved every 32 Ki sightings
    for i in range(s.window - 1):  # a full window of distinct prompts
        s.record(key(i))
    false = sum(1 for i in range(10**6, 10**6 + 20000) if s.count(key(i)) > 0)
    assert false / 20000 < 0.03, false


def test_a_bad_sketch_is_refused():
    with pytest.raises(ValueError):
        SeenSketch(depth=9)


# ---- the verdict ---------------------------------------------------------------------------------------------
def test_the_requests_wish_is_read_from_its_transfer_params():
    assert save_wish(None) is None and save_wish({}) is None and save_wish("save") is None
    assert save_wish({"save": True}) is True and save_wish({"save": False}) is False
    assert save_wish({"kvprefetch": {"save": False}, "save": True}) is False, "the namespaced one wins"
    assert save_wish({"save": "no"}) is None and save_wish({"save": 0}) is None, "not a bool: ignored"


@pytest.mark.parametrize(
    ("policy", "wish", "signs", "verdict"),
    [
        ("all", None, {}, None),
        ("all", False, {}, "request"),
        ("seen", None, {}, "unseen"),
        ("seen", True, {}, None),
        ("seen", False, {"seen_before": True}, "request"),
        ("seen", None, {"seen_before": True}, None),
        ("seen", None, {"leased": True}, None),
        ("seen", None, {"hit": True}, None),
    ],
)
def test_the_verdict_puts_the_request_first_then_the_policy_and_any_sign_of_reuse(policy, wish, signs, verdict):
    kw = {"seen_before": False, "leased": False, "hit": False} | signs
    assert save_verdict(policy, wish, **kw) == verdict


# ---- the scheduler side applying it ------------------------------------------------------------------------------
def jobs(side, blocks, tokens, **params):
    """A request arrives, is reached and computes its whole prompt in one step: the step's save jobs."""
    r = vllm_request(tokens, kv_transfer_params=params or None)
    side.on_new_request(r)
    side.get_num_new_matched_tokens(r, 0)
    blocks[r.request_id] = list(range(10, 10 + len(tokens) // 128 + 1))
    nr = SimpleNamespace(req_id=r.request_id, num_computed_tokens=0)
    so = SimpleNamespace(scheduled_new_reqs=[nr], scheduled_cached_reqs=SimpleNamespace(req_ids=[]),
                         num_scheduled_tokens={r.request_id: len(tokens)},
                         total_num_scheduled_tokens=len(tokens))  # fmt: skip
    meta = side.build_connector_meta(so)
    side.request_finished(r)
    return meta.saves


def run(side, blocks, tokens, **params):
    """As `jobs`, but the keys those jobs save (rank 0's)."""
    return [k for job in jobs(side, blocks, tokens, **params) for k in job.keys[0]]


def seen_side(**extra):
    side, store, keyer, blocks = make_scheduler(save_policy="seen", **extra)
    return side, store, keyer, blocks


def test_seen_saves_a_prompt_from_its_second_sighting_and_counts_what_it_skipped_once():
    side, _, keyer, blocks = seen_side()
    a = list(range(600))  # two whole chunks
    assert run(side, blocks, a) == []
    assert side.counters.snapshot()["saves_skipped_unseen"] == 2
    assert run(side, blocks, a + list(range(9000, 9300))) == keyer.keys(a + list(range(9000, 9300)))[:3], \
        "its leading chunk seen before: every whole chunk saved"
    snap = side.counters.snapshot()
    assert snap["saves_skipped_unseen"] == 2 and snap["saved_chunks"] == 3


def test_a_request_whose_saves_are_skipped_skips_its_later_chunks_too():
    side, _, _, blocks = seen_side()
    r = vllm_request(list(range(300)))
    side.on_new_request(r)
    side.get_num_new_matched_tokens(r, 0)
    blocks[r.request_id] = list(range(10, 20))
    for computed, new in ((0, 300), (300, 300)):  # its prompt, then (as if decoded) a second whole chunk
        if computed:
            r.append_output_token_ids([5] * new)
        nr = SimpleNamespace(req_id=r.request_id, num_computed_tokens=computed)
        so = SimpleNamespace(scheduled_new_reqs=[nr], scheduled_cached_reqs=SimpleNamespace(req_ids=[]),
                             num_scheduled_tokens={r.request_id: new}, total_num_scheduled_tokens=new)  # fmt: skip
        assert side.build_connector_meta(so).saves == []
    assert side.counters.snapshot()["saves_skipped_unseen"] == 2, "each chunk counted once"


def test_seen_saves_a_prompt_a_warm_up_named_first():
    side, _, _, blocks = seen_side()
    head = list(range(512))
    side.warm(head, 30, "w")
    assert len(run(side, blocks, head + [7] * 20)) == 2


def test_seen_saves_a_request_that_asks_or_keeps_a_lease_and_all_skips_one_that_asks_not_to():
    side, _, _, blocks = seen_side()
    assert len(run(side, blocks, list(range(1000, 1300)), save=True)) == 1
    assert len(run(side, blocks, list(range(2000, 2300)), kvprefetch={"keep_warm_s": 5})) == 1
    assert len(run(side, blocks, list(range(3000, 3300)), kvprefetch={"save": True})) == 1
    side_all, _, _, blocks_all = make_scheduler()
    assert run(side_all, blocks_all, list(range(4000, 4300)), save=False) == []
    assert side_all.counters.snapshot()["saves_skipped_request"] == 1
    assert side_all.leases.snapshot()["leases"] == 0


def test_seen_saves_what_follows_a_hit():
    side, store, keyer, blocks = seen_side(load_policy="always")
    a = list(range(600))
    store.tiers[keyer.keys(a)[0]] = "dram"  # another engine saved its leading chunk: reuse
    r = vllm_request(a)
    side.on_new_request(r)
    assert side.get_num_new_matched_tokens(r, 0) == (256, False)
    blocks[r.request_id] = list(range(10, 15))
    side.update_state_after_alloc(r, blocks[r.request_id], 256)
    nr = SimpleNamespace(req_id=r.request_id, num_computed_tokens=256)
    so = SimpleNamespace(scheduled_new_reqs=[nr], scheduled_cached_reqs=SimpleNamespace(req_ids=[]),
                         num_scheduled_tokens={r.request_id: 344}, total_num_scheduled_tokens=344)  # fmt: skip
    meta = side.build_connector_meta(so)
    assert [k for job in meta.saves for k in job.keys[0]] == keyer.keys(a)[1:2], "the hit loaded, the next saved"


def test_all_keeps_no_sketch():
    side, _, _, blocks = make_scheduler()
    run(side, blocks, list(range(600)))
    assert not side.seen.table.any()


def test_skipped_chunks_reach_vllms_metrics_by_reason():
    from prometheus_client import CollectorRegistry
    from test_vllm_stats import _metric_types

    from kvprefetch.vllm.stats import KVPrefetchPromMetrics

    registry = CollectorRegistry()
    extra = {"tiers": ["dram", "disk"], "disk": {"path": "/nonexistent/kvp"}}
    config = SimpleNamespace(kv_transfer_config=SimpleNamespace(kv_connector_extra_config=extra))
    prom = KVPrefetchPromMetrics(config, _metric_types(registry), ["model_name", "engine"], {0: ["m", "0"]})
    labels = {"model_name": "m", "engine": "0"}
    name = "vllm:kvprefetch_saves_skipped_total"
    assert registry.get_sample_value(name, labels | {"reason": "unseen"}) == 0, "every series exists from the start"
    prom.observe({"counters": {"saves_skipped_unseen": 3, "saves_skipped_request": 1}, "io": {}, "errors": {}}, 0)
    assert registry.get_sample_value(name, labels | {"reason": "unseen"}) == 3
    assert registry.get_sample_value(name, labels | {"reason": "request"}) == 1
    assert registry.get_sample_value("vllm:kvprefetch_saves_skipped_unseen_total", labels) is None, "labelled only"


def test_seen_saves_a_prompt_whose_leading_chunk_is_stored_even_when_it_recomputes_it():
    side, store, keyer, blocks = seen_side(load_policy="never")  # (nothing loads: the sighting alone decides)
    a = list(range(600))
    store.tiers[keyer.keys(a)[0]] = "disk"  # an earlier run stored its head
    assert len(run(side, blocks, a)) == 2


# ---- probation: a prefix seen once goes into DRAM only ---------------------------------------------------------------
def test_probation_puts_a_prefix_seen_once_into_dram_only_and_writes_it_back_from_its_second_sighting():
    side, _, _, blocks = make_scheduler(save_policy="probation")
    first = jobs(side, blocks, list(range(600)))
    assert [(len(j.keys[0]), j.write_back) for j in first] == [(2, False)]
    assert side.counters.snapshot()["saves_skipped_unseen"] == 2, "counted: not written back"
    again = jobs(side, blocks, list(range(600)) + list(range(9000, 9300)))
    assert [(len(j.keys[0]), j.write_back) for j in again] == [(3, True)]
    asked_not = jobs(side, blocks, list(range(5000, 5300)), save=False)
    assert asked_not == [] and side.counters.snapshot()["saves_skipped_request"] == 1


def test_seen_is_the_default():
    from kvprefetch.vllm.settings import parse_extra_config

    assert parse_extra_config({}).save_policy == "seen"
