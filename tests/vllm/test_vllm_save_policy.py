"""Save admission on a real vLLM CPU engine (issue 64): under ``save_policy: seen`` a prompt seen once saves
nothing and the second time saves, ``kv_transfer_params {"save": true}`` saves on first sight, ``{"save": false}``
saves nothing under ``all``; under ``probation`` a prompt seen once goes into DRAM only, nothing to disk, and its
second sighting loads it; skipped chunks are counted by reason; what is loaded is exact."""

from __future__ import annotations

import uuid
from pathlib import Path

import pytest

pytest.importorskip("vllm")

from test_vllm_exactness import LEN, assert_same, delta, reference
from vllm_harness import Engine

from conftest import extra_config, prompt
from kvprefetch.vllm import transfer_config

pytestmark = [pytest.mark.slow, pytest.mark.engine]


def engine(model_dir, logs, disk: Path, pools, policy: str) -> Engine:
    extra = extra_config(disk, pools, save_policy=policy)
    spec = {"model": model_dir, "max_num_seqs": 1, "kv_transfer_config": transfer_config(extra)}
    return Engine(spec, logs / f"{policy}-{uuid.uuid4().hex[:6]}.log")


@pytest.fixture(scope="module")
def seen(model_dir, logs, disk_dir, pools):
    e = engine(model_dir, logs, disk_dir / "seen", pools, "seen")
    yield e
    e.close()


def test_seen_saves_a_prompt_the_second_time_and_loads_it_exactly_the_third(seen, engines):
    p = prompt(6401, LEN)
    ref = reference(engines, p)
    before = seen.counters()
    assert_same(seen.generate([p])[0], ref)
    d = delta(seen.counters(), before)
    assert (d["saved_chunks"], d["worker_saved_chunks"], d["saves_skipped_unseen"]) == (0, 0, 4)
    before = seen.counters()
    assert_same(seen.generate([p])[0], ref)
    d = delta(seen.counters(), before)
    assert (d["loaded_chunks"], d["saved_chunks"], d["saves_skipped_unseen"]) == (0, 4, 0)
    assert seen.flush()
    before = seen.counters()
    assert_same(seen.generate([p])[0], ref)
    d = delta(seen.counters(), before)
    assert d["loaded_chunks"] == 4 and d["worker_loaded_chunks"] == 4 and d["saved_chunks"] == 0


def test_a_request_that_asks_is_saved_on_first_sight(seen):
    before = seen.counters()
    seen.generate([prompt(6402, LEN)], 1, transfer_params=[{"save": True}])
    d = delta(seen.counters(), before)
    assert (d["saved_chunks"], d["saves_skipped_unseen"]) == (4, 0)


def test_a_request_that_asks_not_to_be_saved_is_not_under_all(engines):
    e = engines.get("prefetch_on")  # save_policy all (the tests' default)
    before = e.counters()
    e.generate([prompt(6403, LEN)], 1, transfer_params=[{"save": False}])
    d = delta(e.counters(), before)
    assert (d["saved_chunks"], d["worker_saved_chunks"], d["saves_skipped_request"]) == (0, 0, 4)


def test_probation_puts_a_prompt_seen_once_into_dram_only_and_its_second_sighting_loads_it(
    model_dir, logs, disk_dir, pools, engines
):
    disk = disk_dir / "probation"
    e = engine(model_dir, logs, disk, pools, "probation")
    try:
        p = prompt(6404, LEN)
        ref = reference(engines, p)
        before = e.counters()
        assert_same(e.generate([p])[0], ref)
        assert e.flush()
        d = delta(e.counters(), before)
        assert (d["worker_saved_chunks"], d["saves_skipped_unseen"]) == (4, 4)
        assert not [f for f in disk.rglob("*") if f.is_file() and f.stat().st_size > 4096], "nothing on disk"
        before = e.counters()
        assert_same(e.generate([p])[0], ref)
        d = delta(e.counters(), before)
        assert d["loaded_chunks"] == 4 and d["worker_loaded_chunks"] == 4, "loaded from DRAM"
    finally:
        e.close()
