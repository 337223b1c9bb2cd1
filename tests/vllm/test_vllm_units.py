"""The connector's vLLM-independent parts: page layout conversion, cost model, settings, metrics, scheduler."""

from __future__ import annotations

import itertools
import time
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
    # The copy-free paths: gather straight into chunk rows, scatter one chunk from a read-only byte view.
    buf2 = torch.empty_like(buf)
    src.gather_into(chunks, buf2, geo)
    assert torch.equal(buf, buf2)
    from kvprefetch.vllm.layout import chunk_tensor

    ro = memoryview(buf2[1].numpy()).toreadonly()
    dst2 = PagedKV([torch.zeros_like(t) for t in src_layers], B, N)
    for li in range(L):
        dst2.scatter_chunk_layer(li, chunk_tensor(ro), [-1, 5], geo)
        assert torch.equal(dst2.layers[li][5], src.layers[li][9]) and not dst2.layers[li][0].any()


_SIDE_THREAD_COPIES = """
import os, threading, torch
from kvprefetch.vllm.layout import PagedKV, chunk_tensor
torch.set_num_threads(2)
layers = [torch.randn(64, 2, 16, 256).to(torch.bfloat16) for _ in range(4)]  # big enough for torch to go parallel
kv = PagedKV(layers, 64, 16)
geo = kv.geometry(256)
torch.ones(1 << 20).add_(1)  # the model's thread has its OpenMP team
before = len(os.listdir("/proc/self/task"))
copied, done = threading.Event(), threading.Event()
def save_and_load():  # a connector thread: it lives on after its copies, as the loader and saver pools do
    buf = torch.empty((2, geo.chunk_bytes), dtype=torch.uint8)
    kv.gather_into([list(range(16)), list(range(16, 32))], buf, geo)
    for li in range(4):
        kv.scatter_chunk_layer(li, chunk_tensor(buf[1].numpy()), list(range(32, 48)), geo)
        kv.scatter_layer(li, buf, [list(range(48, 64)), [-1] * 16], geo)
    copied.set()
    done.wait()
t = threading.Thread(target=save_and_load)
t.start()
copied.wait()
during = len(os.listdir("/proc/self/task"))  # the side thread, and any OpenMP team its copies started
done.set()
t.join()
assert torch.equal(layers[3][40], layers[3][24]) and torch.equal(layers[2][50], layers[2][2])
print(during - before - 1)
"""


def test_copies_on_the_connectors_threads_start_no_openmp_team():
    """The loader and saver threads copy host KV without torch ops: a torch op there starts an OpenMP team of
    its own whose threads spin beside the model's forward (the decode step doubled on a 2-core machine)."""
    import subprocess
    import sys

    run = subprocess.run([sys.executable, "-c", _SIDE_THREAD_COPIES], capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr[-2000:]
    assert run.stdout.split()[-1] == "0"  # the copies started no thread beside the connector's own


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
    # 10 ms to recompute a chunk, 1 ms to copy one, 15 ms to read one from disk.
    cm = CostModel(chunk_bytes=1 << 20, chunk_tokens=256, prefill_tps=256 / 0.01, copy_bps=(1 << 20) / 0.001,
                   disk_bps=(1 << 20) / 0.015)
    # One slow chunk followed by DRAM ones still pays as a whole prefix: all four are in after 18 ms < 40 ms.
    assert cm.plan([False, True, False, False]).load_chunks == 4
    # Disk chunks are served one after another (in after 16, 31, 46, 61 ms): no prefix beats recomputing it
    # (10, 20, 30, 40 ms): recompute all.
    assert cm.plan([True, True, True, True]).load_chunks == 0
    # Queued reads in front of the request push its chunks back: the DRAM head still pays, the disk tail not.
    p = cm.plan([False, False, True, True], queue_bytes=10 << 20)
    assert p.load_chunks == 2 and p.skipped_slower == 2
    # An async load waits at least one engine step: with 50 ms steps, reaching the fast disk chunk no longer pays.
    cm.disk_bps.value = 100e9
    assert cm.plan([False, False, True]).load_chunks == 3
    cm.observe_prefill(2, 0.05)  # a decode step: no prefill-speed sample, but a step time
    assert cm.prefill_tps.samples == 0 and cm.step_s.value == 0.05
    assert cm.plan([False, False, True], async_s=cm.expected_step_s(10_000)).load_chunks == 2
    assert cm.plan([False, False, True]).load_chunks == 3  # sync mode: no step to wait for
    assert cm.expected_step_s(0) == 0  # an idle engine: the async load is reported at once


def test_tier_meter_measures_busy_time_not_queueing():
    from concurrent.futures import Future

    from kvprefetch.vllm.costmodel import TierMeter

    now = [0.0]
    samples = []
    m = TierMeter(lambda b, s: samples.append(b / s), sample_ops=2, clock=lambda: now[0])
    futs = [Future() for _ in range(4)]
    m.track(futs, 100)
    assert m.outstanding == 4
    for i, f in enumerate(futs):
        now[0] = 0.1 * (i + 1)  # one read completes every 100 ms: 1000 B/s
        f.set_result(True)
    assert m.outstanding == 0 and samples == pytest.approx([1000, 1000])
    now[0] = 60.0  # idle for a minute: not counted
    f = Future()
    m.track([f], 100)
    now[0] = 60.05
    f.set_result(True)
    assert samples[-1] == pytest.approx(2000)
    g = Future()
    m.track([g], 100)
    g.cancel()  # a dropped read moves no bytes
    assert m.outstanding == 0 and len(samples) == 3


def test_settings_defaults_and_validation(tmp_path):
    s = parse_extra_config({})
    assert s.prefetch and s.load_policy == "auto" and s.layerwise and s.on_load_failure == "recompute"
    assert s.store.chunk_tokens == 256
    y = tmp_path / "kv.yaml"
    y.write_text(f"chunk_tokens: 512\nprefetch: false\ndisk:\n  path: {tmp_path / 'd'}\n")
    s = parse_extra_config({"config_path": str(y), "load_policy": "always", "io": {"threads": 2}})
    assert s.store.chunk_tokens == 512 and not s.prefetch and s.store.io.threads == 2
    assert s.load_policy == "always"
    assert s.load_mode == "async" and parse_extra_config({"load_mode": "sync"}).load_mode == "sync"
    with pytest.raises(ValueError):
        parse_extra_config({"load_mode": "eventually"})
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
    """`PrefetchHandle`'s API over reads that finish when the test says so."""

    def __init__(self, reads):
        self.reads = list(reads)
        self.finished = False
        self.landed: list[bytes] = []
        self.callbacks = []

    @property
    def num_reads(self):
        return len(self.reads)

    def pending(self):
        return 0 if self.finished else len(self.reads) - len(self.landed)

    def cancel(self, keys=None):
        return 0 if self.finished else len(self.reads if keys is None else [k for k in keys if k in self.reads])

    def on_ready(self, callback):
        self.callbacks.append(callback)

    def land(self, key):
        """One read finishes (as an I/O thread reports it)."""
        self.landed.append(key)
        for callback in self.callbacks:
            callback(key, True)

    def wait(self, timeout=None):
        return self.finished


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
        h = FakeHandle([k for k in keys if self.tiers.get(k) == "disk"])
        self.handles.append(h)
        return h

    def measure_reads(self, keys):
        return self.prefetch(keys)

    def pin(self, keys):
        self.pins += keys
        return [self.tiers.get(k) == "dram" for k in keys]

    def unpin(self, keys):
        for k in keys:
            self.pins.remove(k)

    def writing(self, key):
        return False

    def in_dram(self, keys):
        return [self.tiers.get(k) == "dram" for k in keys]


def make_scheduler(prefetch=True, **extra):
    from kvprefetch.keys import ChunkKeyer, KVNamespace
    from kvprefetch.vllm.scheduler import SchedulerSide

    settings = parse_extra_config({"prefetch": prefetch, **extra})
    ns = KVNamespace(model="m", num_layers=2, num_kv_heads=1, head_dim=8, dtype="float32")
    keyer = ChunkKeyer(ns, 256)
    store = FakeStore()
    blocks = {}
    side = SchedulerSide(
        settings, keyer, store, block_size=128, blocks_per_chunk=2, chunk_bytes=1000,
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
    assert len(store.handles) == 1 and store.handles[0].num_reads == 3  # read starts on arrival
    n, is_async = side.get_num_new_matched_tokens(r, 0)
    assert (n, is_async) == (768, True)
    assert side.counters.snapshot()["prefetch_late"] == 1
    side.update_state_after_alloc(r, list(range(100, 109)), 768)
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
    toks = list(range(1100))
    keys = keyer.keys(toks)
    for k in keys[:3]:
        store.tiers[k] = "disk"
    r = req(toks)
    side.on_new_request(r)
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
    r2 = req(toks)
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
    toks = list(range(1100))
    keys = keyer.keys(toks)
    for k in keys[:3]:
        store.tiers[k] = "disk"
    r = req(toks)
    side.on_new_request(r)  # the prefetch starts, and stays in flight until the test lands it
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
    assert len(store.handles) == 1 and store.handles[0].reads == keys[:3], "read in the background, to measure"
    assert side.counters.snapshot()["disk_probe_chunks"] == 3
    r2 = req(toks)
    side.on_new_request(r2)
    assert side.get_num_new_matched_tokens(r2, 0) == (0, False) and len(store.handles) == 1, "one probe at a time"
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
    assert side.get_num_new_matched_tokens(r4, 0) == (0, False) and len(store.handles) == 1, "a fresh estimate"
    never = side_with(0.0)
    r5 = req(toks)
    never.on_new_request(r5)
    assert never.get_num_new_matched_tokens(r5, 0) == (0, False) and len(store.handles) == 1, "0: never probes"


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


def test_auto_load_mode_reads_in_the_step_only_when_that_costs_the_batch_less():
    """`CostModel.finish_in_step`: reads inside the step stall every running request; parking the request
    costs it at least one step. (The cost model has no clock: its rates are what the test observes.)"""
    cm = CostModel(chunk_bytes=1 << 20, chunk_tokens=256, disk_bps=1e9, copy_bps=10e9)
    cm.observe_disk(100 << 20, 0.1)  # 1.05 GB/s: one chunk in ~1 ms
    one_chunk, many = 1 << 20, 64 << 20  # ~1 ms, ~64 ms of reads
    assert cm.finish_in_step(many, running=0, step_s=0.004)  # idle engine: nobody else waits, never park
    assert cm.finish_in_step(one_chunk, running=3, step_s=0.02)  # 4 x 1 ms < a 20 ms step: read it now
    assert not cm.finish_in_step(many, running=3, step_s=0.02)  # 4 x 64 ms > 64 ms alone: park
    assert not cm.finish_in_step(8 * one_chunk, running=3, step_s=0.0)  # 4 x 8 ms > the 5 ms floor of a step
    assert cm.finish_in_step(one_chunk, running=3, step_s=0.0)  # 4 x 1 ms within the floor


def test_load_mode_auto_is_a_valid_setting():
    assert parse_extra_config({"load_mode": "auto"}).load_mode == "auto"
    with pytest.raises(ValueError, match="load_mode"):
        parse_extra_config({"load_mode": "sometimes"})


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
    assert side.counters.snapshot()["finished_in_step"] == 1 and side.counters.snapshot()["prefetch_late"] == 1
    # a busy engine (4 running, 5 ms steps) and reads of 100 ms: parking costs this request less than stalling 5
    busy = SimpleNamespace(scheduled_new_reqs=[], scheduled_cached_reqs=SimpleNamespace(req_ids=[]),
                           num_scheduled_tokens={f"x{i}": 1 for i in range(4)}, total_num_scheduled_tokens=4)
    side.build_connector_meta(busy)
    store.handles[0].finished = True  # r's reads are over: no queue ahead of r2's
    side.cost.observe_disk(1000, 0.1)
    r2 = req(toks[:1000] + [7] * 100)
    side.on_new_request(r2)
    assert side.get_num_new_matched_tokens(r2, 0) == (768, True)
    assert side.counters.snapshot()["finished_in_step"] == 1

# ---- tensor parallelism --------------------------------------------------------------------------------------


def test_every_rank_has_keys_of_its_own():
    from kvprefetch.keys import ChunkKeyer, KVNamespace

    toks = list(range(1024))
    ns = KVNamespace(model="m", num_layers=2, num_kv_heads=1, head_dim=8, dtype="float32", tp_size=2)
    keyers = ChunkKeyer(ns, 256).rank_keyers()
    assert [k.namespace.tp_rank for k in keyers] == [0, 1]
    k0, k1 = (k.keys(toks) for k in keyers)
    tp1 = ChunkKeyer(ns.model_copy(update={"tp_size": 1}), 256).keys(toks)
    assert len(set(k0) | set(k1) | set(tp1)) == 12  # no two ranks, nor TP=1 and TP=2, share a key
    assert ChunkKeyer(ns.for_rank(1), 256).rank_keyers()[0].keys(toks) == k0  # any rank derives them all
    with pytest.raises(ValueError, match="tp_rank 2 is not below tp_size 2"):
        ns.for_rank(2)


def test_pipeline_parallelism_is_refused_by_name():
    from kvprefetch.vllm.connector import check_parallelism

    check_parallelism(SimpleNamespace(pipeline_parallel_size=1, tensor_parallel_size=8))
    with pytest.raises(NotImplementedError, match="pipeline_parallel_size=2"):
        check_parallelism(SimpleNamespace(pipeline_parallel_size=2, tensor_parallel_size=1))


def test_settings_errors_name_the_key_and_value():
    for bad, words in [
        ({"load_mode": "eventually"}, ["load_mode", "eventually"]),
        ({"load_margin": -1}, ["load_margin", "-1"]),
        ({"metrics_port": "http"}, ["metrics_port", "http"]),
        ({"no_such_key": 1}, ["no_such_key"]),
        ({"dram": {"capacity_bytes": "lots"}}, ["dram.capacity_bytes", "lots"]),
    ]:
        with pytest.raises(ValueError) as err:
            parse_extra_config(bad)
        assert all(w in str(err.value) for w in words), (bad, str(err.value))


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
        ranks = side.rank_counters.snapshot()
        for rank in (0, 1):
            assert ranks[rank]["prefetched_chunks"] == 2 and ranks[rank]["reached_in_dram_chunks"] == 2
        side.update_state_after_alloc(r, list(range(10, 19)), 512)
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
