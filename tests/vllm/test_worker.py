"""`worker.py`: the worker side's loads and saves, on a real store (tmp dir, own DRAM pool) and real CPU KV tensors.

vLLM's side is played by the tests, in vLLM's order for a step: bind the metadata (`on_bind`), `start_load_kv`,
`wait_for_layer_load` per layer (the forward), `wait_for_save`, then `get_finished` and
`get_block_ids_with_load_errors` for the step's output.
"""

from __future__ import annotations

import contextlib
import threading
import time
import uuid
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
import torch

from kvprefetch.config import StoreConfig
from kvprefetch.keys import ChunkKeyer, KVNamespace
from kvprefetch.store import TieredStore
from kvprefetch.vllm.layout import PagedKV
from kvprefetch.vllm.metadata import KVPrefetchMetadata, LoadJob, SaveJob
from kvprefetch.vllm.metrics import ConnectorCounters
from kvprefetch.vllm.worker import WorkerSide

LAYERS, NUM_BLOCKS, BLOCK, HEADS, DIM = 2, 16, 4, 1, 8  # a page: 1 head x 4 tokens x 8 float32 = 128 B
CHUNK_TOKENS = 2 * BLOCK  # two blocks a chunk
CHUNK_BYTES = LAYERS * 2 * HEADS * BLOCK * DIM * 4  # 512 B
KEYS = ChunkKeyer(KVNamespace(model="m", num_layers=LAYERS, num_kv_heads=HEADS, head_dim=DIM, dtype="float32"),
                  CHUNK_TOKENS).keys(list(range(10 * CHUNK_TOKENS)))  # fmt: skip


def until(done: Callable[[], object], timeout: float = 10.0) -> object:
    deadline = time.monotonic() + timeout
    while not (value := done()):
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.005)
    return value


@pytest.fixture
def stores(tmp_path):
    """Opens real stores over one disk directory: each with a DRAM pool of its own unless it names one (a worker
    and the scheduler's process share the node's pool; a fresh pool is a process that finds the chunks on disk
    only). Closes them and removes their pools at the end."""
    opened: list[TieredStore] = []

    def open_(pool: str | None = None) -> TieredStore:
        config = StoreConfig.from_dict({
            "dram": {"capacity_bytes": 64 * 4096, "pool_name": pool or f"kvpt-{uuid.uuid4().hex[:8]}"},
            "disk": {"path": str(tmp_path / "disk"), "fsync": False},
            "io": {"threads": 2},
        })  # fmt: skip
        store = TieredStore(config, CHUNK_BYTES)
        opened.append(store)
        return store

    yield open_
    for store in opened:
        with contextlib.suppress(Exception):  # a test closed it already
            store.close()
        for f in Path("/dev/shm").glob(f"*{store.config.dram.pool_name}*"):
            f.unlink(missing_ok=True)


@pytest.fixture
def workers():
    """Builds workers over given stores, in vLLM's order (the side, then its KV caches); shuts them down."""
    built: list[WorkerSide] = []

    def make(store: TieredStore, layerwise: bool = True, layer_groups: list[int] | None = None
             ) -> tuple[WorkerSide, list[torch.Tensor]]:  # fmt: skip
        layers = {f"model.layers.{i}.attn": torch.randn(NUM_BLOCKS, HEADS, BLOCK, DIM) for i in range(LAYERS)}
        worker = WorkerSide(0, list(layers), NUM_BLOCKS, BLOCK, CHUNK_TOKENS, lambda _chunk_bytes: store,
                            ConnectorCounters("worker"), layerwise=layerwise, layer_groups=layer_groups)  # fmt: skip
        worker.register_kv_caches(layers)
        built.append(worker)
        return worker, list(layers.values())

    yield make
    for worker in built:
        worker.shutdown()


def step(worker: WorkerSide, meta: KVPrefetchMetadata) -> tuple[set[str] | None, set[str] | None]:
    """One engine step as vLLM drives the worker; (finished sending, finished receiving)."""
    worker.on_bind(meta)
    worker.start_load_kv(meta)
    for name in worker.layer_names:  # the forward, layer by layer
        worker.wait_for_layer_load(name)
    worker.wait_for_save(meta)
    return worker.get_finished(set())


def chunks_of(layers: list[torch.Tensor], block_ids: list[list[int]]) -> list[np.ndarray]:
    """The chunk images the blocks hold ([layer][block in chunk][page]), as a save would put them."""
    kv = PagedKV(layers, NUM_BLOCKS, BLOCK)
    rows = torch.empty((len(block_ids), CHUNK_BYTES), dtype=torch.uint8)
    kv.gather_into(block_ids, rows, kv.geometry(CHUNK_TOKENS))
    return [rows[i].numpy().copy() for i in range(len(block_ids))]


def same_blocks(a: list[torch.Tensor], a_ids: list[int], b: list[torch.Tensor], b_ids: list[int]) -> bool:
    return all(torch.equal(x[i], y[j]) for x, y in zip(a, b, strict=True) for i, j in zip(a_ids, b_ids, strict=True))


def connector_threads() -> set[threading.Thread]:
    """The worker side's own threads: async loads, saves, a step's layer-wise load (the store's I/O threads are
    the store's, closed with it by the connector)."""
    names = ("kvprefetch-aload", "kvprefetch-save", "kvprefetch-load")
    return {t for t in threading.enumerate() if t.name.startswith(names) and t.is_alive()}


# ---- saves ---------------------------------------------------------------------------------------------------


def test_a_save_puts_whole_chunks_from_their_blocks_and_reports_them_done(stores, workers):
    store = stores()
    worker, layers = workers(store)
    save = SaveJob(7, "a", [KEYS[:2]], [[0, 1], [2, 3]])
    step(worker, KVPrefetchMetadata(saves=[save], step_tokens=16))
    assert worker.flush(10)
    assert store.lookup(KEYS[:3]).tiers == ["dram", "dram"]
    out = [np.empty(CHUNK_BYTES, np.uint8) for _ in range(2)]
    assert store.get_into(KEYS[:2], out) == 2
    assert all(np.array_equal(o, c) for o, c in zip(out, chunks_of(layers, [[0, 1], [2, 3]]), strict=True))
    report = until(worker.build_worker_meta)
    assert report.saves_done == {7: 1} and report.ranks[0]["saved_chunks"] == 2  # the scheduler frees the blocks
    assert report.step_tokens == 16 and report.forward_seconds > 0  # the forward was timed (prefill speed)


def test_a_finished_request_is_released_once_its_saves_have_copied_its_blocks(stores, workers):
    worker, _ = workers(stores())
    step(worker, KVPrefetchMetadata(saves=[SaveJob(1, "a", [KEYS[:1]], [[4, 5]])], step_tokens=8))
    sending = set()
    meta = KVPrefetchMetadata(await_saves=["a"])  # vLLM finished "a"; the scheduler holds its blocks
    sending |= step(worker, meta)[0] or set()
    until(lambda: sending.update(worker.get_finished(set())[0] or ()) or "a" in sending)
    assert sending == {"a"} and worker.get_finished(set()) == (None, None), "reported once"


def test_a_preempted_requests_saves_finish_before_the_step_may_reuse_its_blocks(stores, workers):
    worker, _ = workers(stores())
    gate = threading.Event()
    worker.saver._pool.submit(gate.wait)  # the saver's one thread is busy: p's save queues behind
    worker.wait_for_save(KVPrefetchMetadata(saves=[SaveJob(3, "p", [KEYS[:2]], [[0, 1], [2, 3]])]))
    waiter = threading.Thread(target=worker.handle_preemptions, args=(KVPrefetchMetadata(preempted=["p"]),))
    waiter.start()
    waiter.join(0.2)
    assert waiter.is_alive(), "vLLM may reuse p's blocks only once its save has copied them out"
    gate.set()
    waiter.join(10)
    assert not waiter.is_alive() and worker.build_worker_meta().saves_done == {3: 1}


def test_a_failed_save_is_counted_and_still_frees_its_blocks(stores, workers):
    worker, _ = workers(stores())
    bad = SaveJob(9, "a", [KEYS[:1]], [[NUM_BLOCKS + 5, 0]])  # no such block: the copy out fails
    sending = step(worker, KVPrefetchMetadata(saves=[bad], await_saves=["a"]))[0]  # (reported there, or later)
    until(lambda: worker.counters.snapshot().get("save_errors"))
    assert (sending or until(lambda: worker.get_finished(set())[0])) == {"a"}, "the scheduler stops holding them"
    assert worker.build_worker_meta().saves_done == {9: 1}
    assert worker.flush(10) and worker.store.lookup(KEYS[:1]).tiers == []  # nothing half-saved


# ---- synchronous loads ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("layerwise", [True, False])
def test_a_sync_load_fills_the_blocks_layer_by_layer_in_the_step(stores, workers, layerwise):
    store = stores()
    worker, layers = workers(store, layerwise=layerwise)
    source = [torch.randn_like(t) for t in layers]
    store.put(KEYS[:2], chunks_of(source, [[0, 1], [2, 3]])).result(timeout=10)
    before = [t.clone() for t in layers]
    job = LoadJob("r", [KEYS[:2]], [[-1, 9], [10, 11]], is_async=False)  # block 8 is the engine's own already
    assert step(worker, KVPrefetchMetadata(loads=[job], step_tokens=4)) == (None, None)
    assert same_blocks(layers, [9, 10, 11], source, [1, 2, 3]) and same_blocks(layers, [8], before, [8])
    assert worker.get_block_ids_with_load_errors() == set()
    assert worker.counters.snapshot()["worker_loaded_chunks"] == 2
    assert not any(t.name == "kvprefetch-load" for t in connector_threads()), "the step's loader thread joined"
    report = worker.build_worker_meta()
    assert report.ranks[0]["loaded_chunks"] == 2 and report.load_bytes == 2 * CHUNK_BYTES


def test_a_sync_load_reads_chunks_below_dram_inside_the_step(stores, workers):
    """Sync mode: chunks still on disk are read into the step's staging buffer, not left missing."""
    writer = stores()
    source = [torch.randn(NUM_BLOCKS, HEADS, BLOCK, DIM) for _ in range(LAYERS)]
    writer.put(KEYS[:2], chunks_of(source, [[4, 5], [6, 7]])).result(timeout=10)
    worker, layers = workers(stores())  # a fresh pool: the chunks are on disk only
    job = LoadJob("r", [KEYS[:2]], [[0, 1], [2, 3]], is_async=False, on_disk=2)
    step(worker, KVPrefetchMetadata(loads=[job]))
    assert same_blocks(layers, [0, 1, 2, 3], source, [4, 5, 6, 7]) and worker.get_block_ids_with_load_errors() == set()
    assert worker.build_worker_meta().disk_bytes == 2 * CHUNK_BYTES  # the disk rate the scheduler learns


def test_a_chunk_missing_at_load_time_is_a_miss_vllm_recomputes(stores, workers):
    store = stores()
    worker, layers = workers(store)
    source = [torch.randn_like(t) for t in layers]
    store.put(KEYS[:1], chunks_of(source, [[0, 1]])).result(timeout=10)  # chunk 1 was never saved (or evicted)
    job = LoadJob("r", [KEYS[:2]], [[2, 3], [4, 5]], is_async=False)
    step(worker, KVPrefetchMetadata(loads=[job]))
    assert same_blocks(layers, [2, 3], source, [0, 1]), "the leading chunk still loads"
    assert worker.get_block_ids_with_load_errors() == {4, 5} and worker.get_block_ids_with_load_errors() == set()
    assert worker.counters.snapshot()["load_error_chunks"] == 1


def test_a_store_gone_at_load_time_is_a_miss_not_a_failed_step(stores, workers):
    store = stores()
    worker, _ = workers(store)
    store.put(KEYS[:2], [np.zeros(CHUNK_BYTES, np.uint8)] * 2).result(timeout=10)
    store.close()  # its process went away under the worker
    step(worker, KVPrefetchMetadata(loads=[LoadJob("r", [KEYS[:2]], [[0, 1], [2, 3]], is_async=False)]))
    assert worker.get_block_ids_with_load_errors() == {0, 1, 2, 3}
    assert worker.counters.snapshot()["load_error_chunks"] == 2


# ---- asynchronous loads --------------------------------------------------------------------------------------


def test_an_async_load_copies_each_chunk_as_the_schedulers_prefetch_lands(stores, workers):
    writer = stores()
    source = [torch.randn(NUM_BLOCKS, HEADS, BLOCK, DIM) for _ in range(LAYERS)]
    writer.put(KEYS[:3], chunks_of(source, [[0, 1], [2, 3], [4, 5]])).result(timeout=10)
    pool = f"kvpt-{uuid.uuid4().hex[:8]}"
    scheduler_store, worker_store = stores(pool), stores(pool)  # two processes on one node: one DRAM pool
    worker, layers = workers(worker_store)
    job = LoadJob("r", [KEYS[:3]], [[6, 7], [8, 9], [10, 11]], is_async=True, awaits_prefetch=True)
    assert step(worker, KVPrefetchMetadata(loads=[job])) == (None, None)  # parked: nothing in DRAM yet
    assert scheduler_store.prefetch(KEYS[:3]).wait(10)  # the scheduler's prefetch lands in the shared pool
    recv = until(lambda: step(worker, KVPrefetchMetadata())[1])
    assert recv == {"r"} and same_blocks(layers, list(range(6, 12)), source, list(range(6)))
    assert worker.get_block_ids_with_load_errors() == set()
    assert worker.counters.snapshot()["async_loads"] == 1


def test_an_async_load_whose_reads_settled_reads_what_is_missing_itself(stores, workers):
    writer = stores()
    source = [torch.randn(NUM_BLOCKS, HEADS, BLOCK, DIM) for _ in range(LAYERS)]
    writer.put(KEYS[:2], chunks_of(source, [[0, 1], [2, 3]])).result(timeout=10)
    worker, layers = workers(stores())  # the chunks are on disk only, and no prefetch brings them up
    job = LoadJob("r", [KEYS[:2]], [[4, 5], [6, 7]], is_async=True, awaits_prefetch=True)
    step(worker, KVPrefetchMetadata(loads=[job]))
    recv = until(lambda: step(worker, KVPrefetchMetadata(settled=["r"]))[1])  # the scheduler's reads are over
    assert recv == {"r"} and same_blocks(layers, [4, 5, 6, 7], source, [0, 1, 2, 3])


def test_an_async_load_of_chunks_gone_everywhere_finishes_with_their_blocks_as_errors(stores, workers):
    worker, _ = workers(stores())
    job = LoadJob("r", [KEYS[:2]], [[0, 1], [2, 3]], is_async=True)  # nothing to wait for: read at once
    worker.on_bind(KVPrefetchMetadata(loads=[job]))
    assert until(lambda: worker.get_finished(set())[1]) == {"r"}
    assert worker.get_block_ids_with_load_errors() == {0, 1, 2, 3}  # vLLM recomputes them


def test_several_kv_cache_groups_each_layer_its_groups_blocks_and_a_failed_load_is_its_request(stores, workers):
    """Two KV cache groups (layer 0 in one, layer 1 in the other): a chunk's ids are each group's blocks in turn.
    A save waits for nothing, but the next step starts only once it has copied its blocks out (vLLM may hand a
    sliding-window group's blocks on); a failed load is reported as its request (vLLM's ``failed_recving``), never
    as block ids, which vLLM cannot map back to a group."""
    store = stores()
    worker, layers = workers(store, layer_groups=[0, 1])
    step(worker, KVPrefetchMetadata(saves=[SaveJob(1, "a", [KEYS[:1]], [[0, 1, 8, 9]])], step_tokens=8))
    worker.on_bind(KVPrefetchMetadata())  # the next step: every save of the last one has copied its blocks out
    assert worker.saver is not None and not worker.saver._futs
    assert worker.flush(10)
    job = LoadJob("r", [KEYS[:1]], [[-1, 3, 10, 11]], is_async=True)
    worker.on_bind(KVPrefetchMetadata(loads=[job]))
    assert until(lambda: worker.get_finished(set())[1]) == {"r"}
    assert same_blocks(layers[:1], [1], layers[:1], [3]) and same_blocks(layers[1:], [8, 9], layers[1:], [10, 11])
    assert worker.get_block_ids_with_load_errors() == set() and worker.take_failed_loads() == set()
    gone = LoadJob("g", [KEYS[5:6]], [[4, 5, 12, 13]], is_async=True)  # never saved
    worker.on_bind(KVPrefetchMetadata(loads=[gone]))
    assert until(lambda: worker.get_finished(set())[1]) == {"g"}
    assert worker.take_failed_loads() == {"g"} and worker.get_block_ids_with_load_errors() == set()


def test_a_cancelled_async_load_stops_and_reports_finished_with_nothing_to_recompute(stores, workers):
    """The request finished while its load waited for a prefetch that never lands: the worker stops waiting."""
    worker, layers = workers(stores())
    before = [t.clone() for t in layers]
    job = LoadJob("r", [KEYS[:2]], [[0, 1], [2, 3]], is_async=True, awaits_prefetch=True)
    assert step(worker, KVPrefetchMetadata(loads=[job])) == (None, None)
    recv = until(lambda: step(worker, KVPrefetchMetadata(cancel_loads=["r"]))[1])
    assert recv == {"r"} and worker.get_block_ids_with_load_errors() == set()
    assert same_blocks(layers, [0, 1, 2, 3], before, [0, 1, 2, 3]), "nothing copied"
    # a load the scheduler cancelled before handing it over is reported finished without touching the store
    worker.on_bind(KVPrefetchMetadata(loads=[LoadJob("s", [KEYS[:1]], [[4, 5]], is_async=True, cancelled=True)]))
    assert until(lambda: worker.get_finished(set())[1]) == {"s"} and worker.get_block_ids_with_load_errors() == set()


def test_a_released_async_load_is_reported_at_once_and_copies_nothing_more(stores, workers, monkeypatch):
    """Issue 59: the scheduler releases a load past its request's bound (here a read that does not return). The
    worker reports it finished at once, the chunks it had not copied as load errors (vLLM computes them), and a
    load queued behind it on the async-load thread too; the stuck thread, once its read returns, copies nothing
    into blocks vLLM may have handed to another request, and reports nothing more."""
    writer = stores()
    source = [torch.randn(NUM_BLOCKS, HEADS, BLOCK, DIM) for _ in range(LAYERS)]
    images = chunks_of(source, [[0, 1], [2, 3]])
    writer.put(KEYS[:2], images).result(timeout=10)  # on disk
    store = stores()  # the worker's pool: chunk 0 in DRAM, chunk 1 on disk only
    store.put(KEYS[:1], images[:1]).result(timeout=10)
    worker, layers = workers(store)
    before = [t.clone() for t in layers]
    gate = threading.Event()
    read = store.get_into

    def stuck(keys, buffers):
        gate.wait(10)
        return read(keys, buffers)

    monkeypatch.setattr(store, "get_into", stuck)
    job = LoadJob("r", [KEYS[:2]], [[4, 5], [6, 7]], is_async=True)  # nothing to wait for: reads chunk 1 at once
    queued = LoadJob("q", [KEYS[:1]], [[8, 9]], is_async=True)  # behind it on the one async-load thread
    step(worker, KVPrefetchMetadata(loads=[job, queued]))
    until(lambda: worker.loader._active["r"].copied == 1)  # chunk 0 is in, chunk 1's read hangs
    t0 = time.monotonic()
    assert step(worker, KVPrefetchMetadata(release_loads=["r", "q"]))[1] == {"r", "q"}
    assert time.monotonic() - t0 < 1.0, "not waiting for the read"
    assert worker.get_block_ids_with_load_errors() == {6, 7, 8, 9}, "what was not copied: vLLM computes it"
    assert same_blocks(layers, [4, 5], source, [0, 1])
    gate.set()
    until(lambda: worker.loader._inflight == 0)
    assert same_blocks(layers, [6, 7, 8, 9], before, [6, 7, 8, 9]), "nothing copied after the release"
    assert step(worker, KVPrefetchMetadata()) == (None, None), "reported once"
    assert worker.counters.snapshot()["load_error_chunks"] == 2


def test_an_empty_step_never_blocks_the_engine_on_a_parked_load(stores, workers):
    """An empty step waits a few ms at most for a parked load (vLLM's engine core spins meanwhile; the long wait
    is the scheduler's, `SchedulerSide._wait_parked`)."""
    worker, _ = workers(stores())
    step(worker, KVPrefetchMetadata(loads=[LoadJob("r", [KEYS[:1]], [[0, 1]], is_async=True, awaits_prefetch=True)]))
    t0 = time.monotonic()
    assert step(worker, KVPrefetchMetadata()) == (None, None)
    assert time.monotonic() - t0 < 0.5


# ---- shutdown ------------------------------------------------------------------------------------------------


def test_shutdown_drains_the_saves_and_joins_every_connector_thread(stores, workers):
    before = connector_threads()
    store = stores()
    worker, _ = workers(store)
    store.put(KEYS[:1], [np.zeros(CHUNK_BYTES, np.uint8)]).result(timeout=10)
    step(worker, KVPrefetchMetadata(loads=[LoadJob("r", [KEYS[:1]], [[0, 1]], is_async=True)],
                                    saves=[SaveJob(1, "s", [KEYS[2:4]], [[4, 5], [6, 7]])]))  # fmt: skip
    assert connector_threads() - before, "the worker runs its loads and saves on threads of its own"
    worker.shutdown()
    assert connector_threads() - before == set()
    assert store.lookup(KEYS[2:4]).tiers == ["dram", "dram"], "the saves went in before the threads ended"


def test_shutdown_does_not_wait_for_a_load_parked_on_a_prefetch_that_will_never_land(stores, workers):
    """An engine shut down while a request waits for its reads: those reads end with the scheduler's process,
    which reports nothing more; the parked load must not hold the worker's shutdown forever."""
    before = connector_threads()
    worker, _ = workers(stores())
    step(worker, KVPrefetchMetadata(loads=[LoadJob("r", [KEYS[:1]], [[0, 1]], is_async=True, awaits_prefetch=True)]))
    done = threading.Event()
    threading.Thread(target=lambda: (worker.shutdown(), done.set()), daemon=True).start()
    assert done.wait(10), "shutdown hung on the parked load"
    assert connector_threads() - before == set()


def test_a_rank_of_a_replicated_model_loads_the_one_copy_and_saves_nothing(stores, workers):
    """MLA at TP > 1 (`ConnectorSpec.replicated`): a job has one part, every rank's; rank 1 loads it and leaves the
    saving to rank 0 (it reports no save done: the scheduler counts rank 0's alone)."""
    store = stores()
    saver, layers = workers(store)  # rank 0 writes the copy
    step(saver, KVPrefetchMetadata(saves=[SaveJob(1, "a", [KEYS[:1]], [[0, 1]])], step_tokens=8))
    assert saver.flush(10)
    kv1 = {f"model.layers.{i}.attn": torch.zeros(NUM_BLOCKS, HEADS, BLOCK, DIM) for i in range(LAYERS)}
    rank1 = WorkerSide(1, list(kv1), NUM_BLOCKS, BLOCK, CHUNK_TOKENS, lambda _chunk_bytes: store,
                       ConnectorCounters("worker"), replicated=True)  # fmt: skip
    rank1.register_kv_caches(kv1)
    try:
        step(rank1, KVPrefetchMetadata(loads=[LoadJob("r", [KEYS[:1]], [[4, 5]], is_async=False)]))
        assert same_blocks(layers, [0, 1], list(kv1.values()), [4, 5])
        step(rank1, KVPrefetchMetadata(saves=[SaveJob(2, "r", [KEYS[1:2]], [[4, 5]])], step_tokens=8))
        assert rank1.flush(10) and store.lookup(KEYS[1:2]).num_hit_chunks == 0
        meta = rank1.build_worker_meta()
        assert meta is not None and not meta.saves_done and meta.ranks[1]["loaded_chunks"] == 1
    finally:
        rank1.shutdown()
