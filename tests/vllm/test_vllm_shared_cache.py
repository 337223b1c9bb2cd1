"""One cache for several engines (issue 5): two engines on one node share one DRAM pool and one disk tier, and
two "nodes" (own pool, own disk directory, own engine) share a remote tier on a real Redis and a real Mooncake
master. Every hit must give the same greedy tokens and logprobs as recomputing; a remote that dies mid-run
turns hits into recomputes, never into failed requests, and is used again once it is back."""

from __future__ import annotations

import uuid

import pytest

pytest.importorskip("vllm")

from test_vllm_exactness import LEN, assert_same, delta, reference
from vllm_harness import Engine

from conftest import CHUNK, extra_config, prompt
from kvprefetch.testbed.local_servers import MooncakeMaster, RedisServer
from kvprefetch.vllm import transfer_config

pytestmark = [pytest.mark.slow, pytest.mark.engine]


def start(model_dir, logs, name: str, extra: dict) -> Engine:
    spec = {"model": model_dir, "max_num_seqs": 1, "kv_transfer_config": transfer_config(extra)}
    return Engine(spec, logs / f"{name}-{uuid.uuid4().hex[:6]}.log")


def store_counter(e: Engine, name: str) -> int:
    stores = e.counters().stores
    return sum((s or {}).get(name, 0) for s in stores.values())


def test_two_engines_on_one_node_share_one_cache(engines, model_dir, logs, tmp_path, pools):
    extra = extra_config(tmp_path / "disk", pools)  # one pool name, one directory: what both engines see
    first, second = start(model_dir, logs, "node-engine-1", extra), start(model_dir, logs, "node-engine-2", extra)
    try:
        p = prompt(501, LEN)
        assert_same(first.generate([p])[0], reference(engines, p))
        assert first.flush()
        before = second.counters()
        assert_same(second.generate([p])[0], reference(engines, p))
        d = delta(second.counters(), before)
        assert d["worker_loaded_chunks"] == LEN // CHUNK, d  # every whole chunk came from the shared cache
        q = prompt(502, LEN)  # and the other way round
        assert_same(second.generate([q])[0], reference(engines, q))
        assert second.flush()
        before = first.counters()
        assert_same(first.generate([q])[0], reference(engines, q))
        assert delta(first.counters(), before)["worker_loaded_chunks"] == LEN // CHUNK
    finally:
        first.close()
        second.close()


@pytest.fixture(params=["redis", pytest.param("mooncake", marks=pytest.mark.long)])  # (tests/remote: Mooncake's own)
def remote_server(request, tmp_path):
    server = RedisServer(tmp_path) if request.param == "redis" else MooncakeMaster(tmp_path)
    yield request.param, server
    server.kill()


def remote_section(kind: str, server) -> dict:
    if kind == "redis":
        return {"backend": "redis", "redis": {"url": server.url}, "timeout_s": 1.0, "retry_after_s": 1.0}
    return {"backend": "mooncake", "timeout_s": 1.0, "retry_after_s": 1.0,
            "mooncake": {"master": server.master, "metadata_server": server.metadata_server,
                         "segment_bytes": 128 << 20, "connect_timeout_s": 30}}  # fmt: skip


def test_history_from_node_a_is_a_hit_on_node_b_and_a_dead_remote_is_a_miss(
    engines, model_dir, logs, tmp_path, pools, remote_server
):
    kind, server = remote_server
    tiers = ["dram", "disk", "remote"]
    node = {
        n: start(model_dir, logs, f"{kind}-node-{n}",
                 extra_config(tmp_path / f"disk-{n}", pools, tiers=tiers, remote=remote_section(kind, server)))
        for n in ("a", "b")
    }  # fmt: skip
    a, b = node["a"], node["b"]
    try:
        p = prompt(601, LEN)
        assert_same(a.generate([p])[0], reference(engines, p))
        assert a.flush()
        before = b.counters()
        assert_same(b.generate([p])[0], reference(engines, p))
        assert delta(b.counters(), before)["worker_loaded_chunks"] == LEN // CHUNK
        assert store_counter(b, "promoted") >= LEN // CHUNK  # b's own tiers were empty: read from the remote

        server.kill()  # mid-run: requests keep completing, recomputed, with the same tokens
        q = prompt(602, LEN)
        assert_same(a.generate([q])[0], reference(engines, q))
        assert_same(b.generate([q])[0], reference(engines, q))  # b never had q: remote miss -> recompute

        server.start()  # back (empty): the engines reattach without a restart
        r = prompt(603, LEN)
        for _ in range(30):
            a.generate([r], 1)
            a.flush()
            before = b.counters()
            out = b.generate([r])[0]
            assert_same(out, reference(engines, r))
            if delta(b.counters(), before)["worker_loaded_chunks"] == LEN // CHUNK:
                break
            r = prompt(700 + _, LEN)
        else:
            pytest.fail("node b never hit the restarted remote")
    finally:
        a.close()
        b.close()
