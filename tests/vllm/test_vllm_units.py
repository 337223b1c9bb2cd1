"""The connector's vLLM-independent parts: page layout conversion, cost model, settings, metrics, scheduler."""

from __future__ import annotations

import itertools
from types import SimpleNamespace

import pytest
import torch

from kvprefetch.vllm.costmodel import CostModel
from kvprefetch.vllm.layout import PagedKV, effective_chunk_tokens
from kvprefetch.vllm.metrics import ConnectorCounters, Reporter
from kvprefetch.vllm.settings import parse_extra_config

L, B, H, N, C = 3, 10, 2, 4, 6  # layers, blocks, heads, tokens per block, content


def make_layers(order: str, kernel_split: int = 1) -> list[torch.Tensor]:
    """Per-layer logical [B, H, N, C] views of one backing tensor in the given physical order."""
    nb = B * kernel_split
    n = N // kernel_split
    phys = {"LBHNC": (L, nb, H, n, C), "LBNHC": (L, nb, n, H, C), "LHBNC": (L, H, nb, n, C), "BLHNC": (nb, L, H, n, C)}
    back = torch.randn(phys[order])
    perm = {"LBHNC": (0, 1, 2, 3, 4), "LBNHC": (0, 1, 3, 2, 4), "LHBNC": (0, 2, 1, 3, 4), "BLHNC": (1, 0, 2, 3, 4)}
    logical = back.permute(*perm[order])  # [L, B, H, N, C] view over the physical order
    return [logical[i] for i in range(L)]


@pytest.mark.parametrize("order,split", [("LBHNC", 1), ("LBNHC", 1), ("LHBNC", 1), ("BLHNC", 1), ("LBHNC", 2)])
def test_gather_scatter_round_trip(order, split):
    src_layers = make_layers(order, split)
    dst_layers = [torch.zeros_like(t) for t in src_layers]
    src, dst = PagedKV(src_layers, B, N), PagedKV(dst_layers, B, N)
    geo = src.geometry(2 * N)  # two blocks per chunk
    assert geo.blocks_per_chunk == 2 and geo.chunk_bytes == L * 2 * src.page_bytes
    chunks = [[7, 2], [0, 9]]
    buf = torch.empty((2, geo.chunk_bytes), dtype=torch.uint8)
    src.gather(chunks, buf, geo)
    # The buffer is [layer][block in chunk][page]: layer li of chunk 0 block 1 is block 2's page.
    view = src.chunk_view(buf, geo)
    assert torch.equal(view[0, 1, 1], src.layers[1][2])
    # Load into other blocks, skipping one that is "already there" (-1).
    targets = [[3, 4], [-1, 6]]
    for li in range(L):
        dst.scatter_layer(li, buf, targets, geo)
    for li in range(L):
        assert torch.equal(dst.layers[li][3], src.layers[li][7])
        assert torch.equal(dst.layers[li][4], src.layers[li][2])
        assert torch.equal(dst.layers[li][6], src.layers[li][9])
        assert not dst.layers[li][0].any()  # the skipped block was not written
    # Untouched blocks stay zero.
    for b in set(range(B)) - {3, 4, 6}:
        assert not dst.layers[0][b].any()


def test_chunk_is_whole_blocks():
    assert effective_chunk_tokens(256, 128) == 256
    assert effective_chunk_tokens(256, 16) == 256
    assert effective_chunk_tokens(64, 128) == 128
    assert effective_chunk_tokens(96, 64) == 192


def test_cost_model_loads_only_what_pays():
    cm = CostModel(chunk_bytes=100 << 20, chunk_tokens=256, disk_bps=1e9, copy_bps=10e9)
    # Nothing measured yet: load everything.
    assert cm.plan([True, True, False]).load_chunks == 3
    cm.observe_prefill(256, 0.05)  # 5120 tok/s: recomputing a chunk takes 50 ms
    # DRAM chunk: 10 ms to copy -> load. Disk chunk: 110 ms -> recompute.
    p = cm.plan([False, False, True, True])
    assert p.load_chunks == 2 and p.skipped_slower == 2
    # A fast disk makes the disk chunks pay.
    for _ in range(20):
        cm.observe_disk(100 << 20, 0.02)
    assert cm.plan([False, True, True]).load_chunks == 3
    # A long queue in front of the disk makes them not pay again.
    assert cm.plan([False, True, True], queue_bytes=10 << 30).load_chunks == 1
    # Chunks the engine already holds are never counted.
    assert cm.plan([True, True], first=2).load_chunks == 2


def test_cost_model_prefix_rule_can_load_past_one_slow_chunk():
    cm = CostModel(chunk_bytes=1 << 20, chunk_tokens=256, prefill_tps=256 / 0.01)  # 10 ms per chunk
    cm.chunk_load_s = lambda on_disk: 0.015 if on_disk else 0.001  # type: ignore[method-assign]
    # One slow chunk followed by fast ones still pays as a whole prefix (gain 9 - 5 + 9 + 9 > 9).
    assert cm.plan([False, True, False, False]).load_chunks == 4


def test_settings_defaults_and_validation(tmp_path):
    s = parse_extra_config({})
    assert s.prefetch and s.load_policy == "auto" and s.layerwise and s.on_load_failure == "recompute"
    assert s.store.chunk_tokens == 256
    y = tmp_path / "kv.yaml"
    y.write_text(f"chunk_tokens: 512\nprefetch: false\ndisk:\n  path: {tmp_path / 'd'}\n")
    s = parse_extra_config({"config_path": str(y), "load_policy": "always", "io": {"threads": 2}})
    assert s.store.chunk_tokens == 512 and not s.prefetch and s.store.io.threads == 2
    assert s.load_policy == "always"
    with pytest.raises(ValueError):
        parse_extra_config({"load_policy": "sometimes"})
    with pytest.raises(ValueError):
        parse_extra_config({"no_such_key": 1})
    with pytest.raises(ValueError):
        parse_extra_config({"metrics_port": "http"})


def test_counters_export_to_prometheus(tmp_path):
    from prometheus_client import generate_latest

    c = ConnectorCounters("scheduler")
    c.inc("prefetched_chunks", 3)
    c.inc("load_error_chunks")
    other = tmp_path / "kvprefetch-worker-1-abc.json"  # another process's snapshot
    other.write_text('{"counters": {"worker_loaded_chunks": 5}, "store": {}}')
    io = {"io": {"disk/prefetch": {"bytes": 10, "busy_seconds": 0.5, "queued": 1, "latency_p50_s": 0.1}}}
    r = Reporter(c, lambda: io, interval_s=0, metrics_dir=str(tmp_path), metrics_port=None, serve=True)
    text = generate_latest(r.registry).decode()
    assert "kvprefetch_prefetched_chunks_total" in text
    assert 'kvprefetch_store_io_bytes_total{cls="prefetch",tier="disk"} 10.0' in text
    agg = r.aggregate()
    assert agg["worker_loaded_chunks"] >= 5 and agg["prefetched_chunks"] >= 3
    r.close()
    assert any(p.name.startswith("kvprefetch-scheduler-") for p in tmp_path.iterdir())


# ---- scheduler-side state machine with a fake store ---------------------------------------------------------


class FakeHandle:
    def __init__(self):
        self.finished = False
        self.tickets = {}

    def done(self):
        return self.finished

    def cancel(self):
        return 0 if self.finished else 1


class FakeStore:
    def __init__(self):
        self.tiers: dict[bytes, str] = {}
        self.handles: list[FakeHandle] = []
        self.pins: list[bytes] = []

    def lookup(self, keys):
        out = []
        for k in keys:
            if k not in self.tiers:
                break
            out.append(self.tiers[k])
        return SimpleNamespace(tiers=out, num_hit_chunks=len(out))

    def prefetch(self, keys, to=None, deadline=None):
        h = FakeHandle()
        h.tickets = {k: None for k in keys if self.tiers.get(k) == "disk"}
        self.handles.append(h)
        return h

    def pin(self, keys):
        self.pins += keys
        return [self.tiers.get(k) == "dram" for k in keys]

    def unpin(self, keys):
        for k in keys:
            self.pins.remove(k)


def make_scheduler(prefetch=True):
    from kvprefetch.keys import ChunkKeyer, KVNamespace
    from kvprefetch.vllm.scheduler import SchedulerSide

    settings = parse_extra_config({"prefetch": prefetch})
    ns = KVNamespace(model="m", num_layers=2, num_kv_heads=1, head_dim=8, dtype="float32")
    keyer = ChunkKeyer(ns, 256)
    store = FakeStore()
    blocks = {}
    side = SchedulerSide(
        settings, keyer, store, block_size=128, blocks_per_chunk=2, chunk_bytes=1000, world_size=1,
        counters=ConnectorCounters("scheduler"), get_block_ids=lambda rid: blocks.get(rid, []),
    )
    return side, store, keyer, blocks


ids = itertools.count()


def req(tokens):
    return SimpleNamespace(
        request_id=f"r{next(ids)}", prompt_token_ids=tokens, all_token_ids=tokens, num_tokens=len(tokens)
    )


def test_scheduler_prefetches_on_arrival_and_loads_async_until_in_dram():
    side, store, keyer, _ = make_scheduler()
    toks = list(range(1100))
    keys = keyer.keys(toks)
    for k in keys[:3]:
        store.tiers[k] = "disk"
    r = req(toks)
    side.on_new_request(r)
    assert len(store.handles) == 1 and len(store.handles[0].tickets) == 3  # read starts on arrival
    n, is_async = side.get_num_new_matched_tokens(r, 0)
    assert (n, is_async) == (768, True)
    assert side.counters.snapshot()["prefetch_late"] == 1
    side.update_state_after_alloc(r, list(range(100, 109)), 768)
    so = SimpleNamespace(scheduled_new_reqs=[], scheduled_cached_reqs=SimpleNamespace(req_ids=[]),
                         num_scheduled_tokens={}, total_num_scheduled_tokens=0)
    assert side.build_connector_meta(so).loads == []  # still reading
    store.handles[0].finished = True
    meta = side.build_connector_meta(so)
    assert len(meta.loads) == 1 and meta.loads[0].is_async
    assert meta.loads[0].block_ids == [[100, 101], [102, 103], [104, 105]]


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
