"""Worker-side half of the connector: copies between the shared DRAM pool and vLLM's paged KV.

* Synchronous loads (the chunks were in DRAM when the scheduler reached the request, or ``load_mode: sync``)
  run on a loader thread that starts with the step: it pins the chunks in the shared pool (``store.view``,
  zero-copy; chunks not in DRAM are read into a staging buffer first, which in sync mode is what the step
  waits for) and fills the engine's blocks one layer at a time straight from the pool; ``wait_for_layer_load``
  blocks only until *that* layer is in, so the copy of layer i+1 overlaps the attention of layer i.
* Asynchronous loads (chunks that had to come up from disk) run on their own thread and are reported through
  ``get_finished``; vLLM keeps scheduling other requests meanwhile. The job arrives as soon as the scheduler
  reaches the request; each chunk is copied into the engine the moment it reaches DRAM (the scheduler's
  process is reading it); once the scheduler reports its reads settled, whatever is still missing is read
  here on demand (joining a read in flight in another process rather than reading twice).
* Saves run after the forward on a saver thread: copy the chunk's pages out of the blocks (the only moment the
  blocks are needed), then ``store.put`` (DRAM now, disk write-back asynchronously).
* An engine with nothing to compute but loads in flight would spin through empty steps; an empty step waits
  (a few ms at most) for an async load to finish instead, which frees the CPU for the reads.
* A chunk that fails to load is a miss: its blocks go to ``get_block_ids_with_load_errors`` and vLLM
  recomputes them. Each failure cause is logged once.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import torch

from kvprefetch.vllm.layout import ChunkGeometry, PagedKV, chunk_tensor
from kvprefetch.vllm.metadata import KVPrefetchMetadata, KVPrefetchWorkerMeta, LoadJob, SaveJob
from kvprefetch.vllm.metrics import ConnectorCounters

log = logging.getLogger("kvprefetch.vllm")
IDLE_WAIT_S = 0.005  # longest an empty engine step waits for an async load to finish
POLL_S = 0.002  # how often an async load looks for a chunk the scheduler's process is still reading


class _Staging:
    """A grow-only host buffer of chunk images (reused: fresh allocations page-fault on every copy)."""

    def __init__(self, chunk_bytes: int, pin: bool):
        self.chunk_bytes = chunk_bytes
        self.pin = pin
        self.buf = torch.empty((0, chunk_bytes), dtype=torch.uint8)

    def get(self, n: int) -> torch.Tensor:
        if self.buf.shape[0] < n:
            self.buf = torch.empty(
                (max(n, 2 * self.buf.shape[0]), self.chunk_bytes), dtype=torch.uint8, pin_memory=self.pin
            )
        return self.buf[:n]


class _LayerwiseLoad:
    """One step's synchronous loads: stage every chunk, then scatter layer by layer, signalling each layer."""

    def __init__(self, side: WorkerSide, jobs: list[LoadJob]):
        self.side = side
        self.jobs = jobs
        self.events = [threading.Event() for _ in range(side.geo.num_layers)]
        self.error_blocks: set[int] = set()
        self.exc: BaseException | None = None
        self.nbytes = 0
        self.seconds = 0.0
        self.copy_seconds = 0.0
        self.disk_bytes = 0
        self.disk_seconds = 0.0
        self.thread = threading.Thread(target=self._run, name="kvprefetch-load", daemon=True)

    def start(self, background: bool) -> None:
        if background:
            self.thread.start()
        else:
            self._run()

    def _run(self) -> None:
        t0 = time.perf_counter()
        try:
            side = self.side
            geo = side.geo
            with contextlib.ExitStack() as stack:
                work = []  # (chunk sources, block ids) per job
                stage = side._load_stage.get(sum(len(j.keys) for j in self.jobs))  # rows touched only if used
                row = 0
                for job in self.jobs:
                    srcs = side._sources(job, stack, self, stage[row : row + len(job.keys)])
                    row += len(job.keys)
                    self.error_blocks |= side._failed_blocks(job, len(srcs))
                    work.append((srcs, job.block_ids[: len(srcs)]))
                t_copy = time.perf_counter()
                for li in range(geo.num_layers):
                    for srcs, ids in work:
                        for src, chunk_ids in zip(srcs, ids, strict=True):
                            side.kv.scatter_chunk_layer(li, src, chunk_ids, geo)
                    self.events[li].set()
                self.copy_seconds = time.perf_counter() - t_copy
            self.nbytes = sum(len(srcs) for srcs, _ in work) * geo.chunk_bytes
        except BaseException as e:  # never leave the forward pass waiting
            self.exc = e
            for job in self.jobs:
                self.error_blocks |= {b for ids in job.block_ids for b in ids if b >= 0}
        finally:
            for ev in self.events:
                ev.set()
            self.seconds = time.perf_counter() - t0

    def wait_layer(self, li: int) -> None:
        self.events[li].wait()

    def join(self) -> None:
        for ev in self.events:
            ev.wait()
        if self.thread.is_alive():
            self.thread.join()


class WorkerSide:
    def __init__(
        self,
        layer_names: Sequence[str],
        num_blocks: int,
        block_size: int,
        chunk_tokens: int,
        open_store: Callable[[int], Any],
        counters: ConnectorCounters,
        layerwise: bool = True,
    ):
        self.layer_names = list(layer_names)
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.chunk_tokens = chunk_tokens
        self.open_store = open_store
        self.counters = counters
        self.layerwise = layerwise
        self.kv: PagedKV | None = None
        self.geo: ChunkGeometry | None = None
        self.store: Any = None
        self.layer_index: dict[str, int] = {}
        self._lock = threading.Lock()
        self._sync: _LayerwiseLoad | None = None
        self._async_pool = ThreadPoolExecutor(1, thread_name_prefix="kvprefetch-aload")
        self._save_pool = ThreadPoolExecutor(1, thread_name_prefix="kvprefetch-save")
        self._done_recv: list[tuple[str, set[int]]] = []
        self._errors: set[int] = set()
        self._saves_by_req: dict[str, set[int]] = {}
        self._save_futs: dict[int, Future] = {}
        self._saves_done: dict[int, int] = {}
        self._await: set[str] = set()
        self._load_bytes = 0
        self._load_seconds = 0.0
        self._step_tokens = 0
        self._forward_s = 0.0
        self._disk_bytes = 0
        self._disk_s = 0.0
        self._t_bind = 0.0
        self._cv = threading.Condition(self._lock)
        self._async_inflight = 0
        self._settled: set[str] = set()
        self._cancelled: set[str] = set()
        self._active: set[str] = set()  # requests with an async load on this worker
        self._async_started: KVPrefetchMetadata | None = None
        self._warned: set[str] = set()

    # ---- setup ----------------------------------------------------------------------------------------------
    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        names = [n for n in self.layer_names if n in kv_caches] or list(kv_caches)
        self.layer_index = {n: i for i, n in enumerate(names)}
        self.kv = PagedKV([kv_caches[n] for n in names], self.num_blocks, self.block_size)
        self.geo = self.kv.geometry(self.chunk_tokens)
        pin = self.kv.device.type == "cuda"
        self._load_stage = _Staging(self.geo.chunk_bytes, pin)
        self._aload_stage = _Staging(self.geo.chunk_bytes, pin)
        self._save_stage = _Staging(self.geo.chunk_bytes, pin)
        self.store = self.open_store(self.geo.chunk_bytes)

    # ---- copies ---------------------------------------------------------------------------------------------
    def _sources(
        self, job: LoadJob, stack: contextlib.ExitStack, load: _LayerwiseLoad, stage: torch.Tensor
    ) -> list[torch.Tensor]:
        """Flat uint8 sources for the job's leading loadable chunks: zero-copy pinned views of the DRAM pool
        where the chunks are there (held until ``stack`` exits), the staging buffer for the rest."""
        n = len(job.keys)
        views: list = []
        try:
            views = stack.enter_context(self.store.view(job.keys))
        except Exception as e:  # the store (or its process) is gone: a miss, never a failed request
            self._warn_once(type(e).__name__, f"store read failed ({e}); recomputing")
            self.counters.inc("load_error_chunks", n)
            return []
        srcs = [chunk_tensor(v) for v in views]
        if len(srcs) < n:  # below DRAM (sync mode) or evicted since planning: read them now, inside the step
            rest = job.keys[len(srcs) :]
            t0 = time.perf_counter()
            got = self._get_into(rest, stage)
            if got and job.on_disk:
                load.disk_bytes += got * self.geo.chunk_bytes
                load.disk_seconds += time.perf_counter() - t0
            srcs += [stage[i] for i in range(got)]
        if len(srcs) < n:
            self._warn_once("short", "chunks missing or corrupt at load time; recomputing them")
            self.counters.inc("load_error_chunks", n - len(srcs))
        self.counters.inc("worker_loaded_chunks", len(srcs))
        return srcs

    def _get_into(self, keys: Sequence[bytes], stage: torch.Tensor) -> int:
        try:
            return int(self.store.get_into(keys, [stage[i].numpy() for i in range(len(keys))]))
        except Exception as e:
            self._warn_once(type(e).__name__, f"store read failed ({e}); recomputing")
            return 0

    @staticmethod
    def _failed_blocks(job: LoadJob, n_ok: int) -> set[int]:
        return {b for ids in job.block_ids[n_ok:] for b in ids if b >= 0}

    def _warn_once(self, cause: str, msg: str) -> None:
        if cause not in self._warned:
            self._warned.add(cause)
            log.warning("kvprefetch: %s (logged once per cause: %s)", msg, cause)

    # ---- per step -------------------------------------------------------------------------------------------
    def on_bind(self, meta: KVPrefetchMetadata) -> None:
        """Before the forward: start this step's async loads now, so they overlap the forward and can be
        reported finished at the end of this very step (vLLM itself would start them after the forward)."""
        self._t_bind = time.perf_counter()
        if meta.loads or meta.settled or meta.cancel_loads:
            self.handle_preemptions(meta)  # an async load may write blocks a preempted request's save still reads
            self._start_async(meta)

    def handle_preemptions(self, meta: KVPrefetchMetadata) -> None:
        for rid in meta.preempted:
            self._wait_saves(rid)

    def _wait_saves(self, rid: str) -> None:
        with self._lock:
            futs = [self._save_futs[j] for j in self._saves_by_req.get(rid, ()) if j in self._save_futs]
        for f in futs:
            f.result()

    def start_load_kv(self, meta: KVPrefetchMetadata) -> None:
        self.handle_preemptions(meta)
        self._start_async(meta)  # no-op when on_bind started them
        sync = [j for j in meta.loads if not j.is_async and not j.cancelled]
        if sync and self.kv is not None:
            self.counters.inc("sync_loads", len(sync))
            self._sync = _LayerwiseLoad(self, sync)
            self._sync.start(background=self.layerwise)

    def _start_async(self, meta: KVPrefetchMetadata) -> None:
        if self._async_started is meta:
            return
        self._async_started = meta
        for job in meta.loads:
            if job.is_async or job.cancelled:
                with self._lock:
                    self._async_inflight += 1
                    self._active.add(job.req_id)
                self._async_pool.submit(self._async_load, job)
        if meta.settled or meta.cancel_loads:
            with self._cv:
                self._settled.update(r for r in meta.settled if r in self._active)
                self._cancelled.update(r for r in meta.cancel_loads if r in self._active)
                self._cv.notify_all()

    def _async_load(self, job: LoadJob) -> None:
        """Copy each chunk into the engine as soon as it is in DRAM, in order; report the job finished."""
        errors: set[int] = set()
        n_ok = 0
        copy_s = 0.0
        rid = job.req_id
        try:
            if not job.cancelled and self.kv is not None:
                self.counters.inc("async_loads")
                waiting = job.awaits_prefetch
                for i, key in enumerate(job.keys):
                    src_ok = False
                    while True:
                        with self._lock:
                            if rid in self._cancelled:
                                break
                            settled = rid in self._settled
                        with self.store.view([key]) as views:
                            if views:
                                t0 = time.perf_counter()
                                self._scatter_all(chunk_tensor(views[0]), job.block_ids[i])
                                copy_s += time.perf_counter() - t0
                                src_ok = True
                                break
                        if waiting and not settled:
                            with self._cv:  # the scheduler's process is reading it: look again soon
                                self._cv.wait(POLL_S)
                            continue
                        stage = self._aload_stage.get(1)  # not coming (or evicted): read it here
                        if self._get_into([key], stage):
                            t0 = time.perf_counter()
                            self._scatter_all(stage[0], job.block_ids[i])
                            copy_s += time.perf_counter() - t0
                            src_ok = True
                        break
                    if not src_ok:
                        break
                    n_ok += 1
                cancelled = rid in self._cancelled
                if n_ok < len(job.keys) and not cancelled:
                    self._warn_once("short", "chunks missing or corrupt at load time; recomputing them")
                    self.counters.inc("load_error_chunks", len(job.keys) - n_ok)
                self.counters.inc("worker_loaded_chunks", n_ok)
                errors = set() if cancelled else self._failed_blocks(job, n_ok)  # (finished: nothing to recompute)
                with self._lock:
                    self._load_bytes += n_ok * self.geo.chunk_bytes
                    self._load_seconds += copy_s
        except BaseException as e:
            self._warn_once(type(e).__name__, f"async load failed ({e}); recomputing")
            errors = {b for ids in job.block_ids for b in ids if b >= 0}
        with self._cv:
            self._done_recv.append((rid, errors))
            self._settled.discard(rid)
            self._cancelled.discard(rid)
            self._active.discard(rid)
            self._async_inflight -= 1
            self._cv.notify_all()

    def _scatter_all(self, src: torch.Tensor, block_ids: Sequence[int]) -> None:
        assert self.kv is not None and self.geo is not None
        for li in range(self.geo.num_layers):
            self.kv.scatter_chunk_layer(li, src, block_ids, self.geo)

    def wait_for_layer_load(self, layer_name: str) -> None:
        sync = self._sync
        if sync is not None:
            self.counters.inc("layer_load_waits")
            li = self.layer_index.get(layer_name)
            if li is None:
                sync.join()
            else:
                sync.wait_layer(li)

    def wait_for_save(self, meta: KVPrefetchMetadata) -> None:
        sync, self._sync = self._sync, None
        had_sync = sync is not None
        if sync is not None:
            sync.join()
            if sync.exc is not None:
                self._warn_once(type(sync.exc).__name__, f"load into the engine failed ({sync.exc}); recomputing")
            with self._lock:
                self._errors |= sync.error_blocks
                self._load_bytes += sync.nbytes
                self._load_seconds += sync.copy_seconds
                self._disk_bytes += sync.disk_bytes
                self._disk_s += sync.disk_seconds
        if not had_sync and meta.step_tokens:
            with self._lock:
                self._step_tokens += meta.step_tokens
                self._forward_s += time.perf_counter() - self._t_bind
        elif not meta.step_tokens and not had_sync and not meta.saves:
            # An empty step (nothing to compute): rather than let the engine spin, wait briefly for an async
            # load to finish, so the reads get the CPU and the waiting request is reported at once.
            with self._cv:
                if self._async_inflight and not self._done_recv:
                    self._cv.wait(IDLE_WAIT_S)
        for job in meta.saves:
            with self._lock:
                self._saves_by_req.setdefault(job.req_id, set()).add(job.job_id)
                self._save_futs[job.job_id] = self._save_pool.submit(self._save, job)
        self._await.update(meta.await_saves)

    def _save(self, job: SaveJob) -> None:
        try:
            if self.kv is None:
                return
            stage = self._save_stage.get(len(job.keys))
            self.kv.gather_into(job.block_ids, stage, self.geo)
            if stage.device.type != "cpu":
                stage = stage.cpu()
            self._mark_saved(job)  # the blocks are no longer needed once their pages are copied out
            fut = self.store.put(job.keys, [stage[i].numpy() for i in range(len(job.keys))])
            fut.add_done_callback(self._log_writeback)
            self.counters.inc("worker_saved_chunks", len(job.keys))
        except BaseException as e:
            self.counters.inc("save_errors")
            self._warn_once("save:" + type(e).__name__, f"save failed ({e}); those chunks stay uncached")
        finally:
            self._mark_saved(job)

    def _log_writeback(self, fut: Future) -> None:
        if not fut.cancelled() and fut.exception() is not None:
            e = fut.exception()
            self._warn_once("writeback:" + type(e).__name__, f"disk write-back failed ({e}); DRAM still serves")

    def _mark_saved(self, job: SaveJob) -> None:
        with self._lock:
            if job.job_id in self._save_futs:
                del self._save_futs[job.job_id]
                self._saves_done[job.job_id] = 1
                ids = self._saves_by_req.get(job.req_id)
                if ids is not None:
                    ids.discard(job.job_id)
                    if not ids:
                        del self._saves_by_req[job.req_id]

    # ---- reporting ------------------------------------------------------------------------------------------
    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        with self._lock:
            recv = {rid for rid, _ in self._done_recv}
            for _, errs in self._done_recv:
                self._errors |= errs
            self._done_recv = []
            sending = {rid for rid in self._await if rid not in self._saves_by_req}
            self._await -= sending
        return (sending or None), (recv or None)

    def get_block_ids_with_load_errors(self) -> set[int]:
        with self._lock:
            errs, self._errors = self._errors, set()
        if errs:
            self.counters.inc("load_error_blocks", len(errs))
        return errs

    def build_worker_meta(self) -> KVPrefetchWorkerMeta | None:
        with self._lock:
            m = KVPrefetchWorkerMeta(
                self._saves_done, self._load_bytes, self._load_seconds, self._step_tokens, self._forward_s,
                self._disk_bytes, self._disk_s,
            )
            self._saves_done = {}
            self._load_bytes, self._load_seconds, self._step_tokens, self._forward_s = 0, 0.0, 0, 0.0
            self._disk_bytes, self._disk_s = 0, 0.0
        if not (m.saves_done or m.load_bytes or m.step_tokens or m.disk_bytes):
            return None
        return m

    def shutdown(self) -> None:
        self._async_pool.shutdown(wait=True)
        self._save_pool.shutdown(wait=True)
        if self.store is not None:
            with contextlib.suppress(Exception):
                self.store.flush(timeout=30)
