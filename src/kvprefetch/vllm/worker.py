"""Worker-side half of the connector: copies between the shared DRAM pool and vLLM's paged KV.

Two parts, `Loader` (store -> engine) and `Saver` (engine -> store), report into one `Telemetry` record that
goes back to the scheduler with each step's output. Each worker is one tensor-parallel rank and copies its own
part of every chunk, under its rank's keys (``job.keys[rank]``).

* Synchronous loads (the chunks were in DRAM when the scheduler reached the request, or ``load_mode: sync``)
  run on a loader thread that starts with the step: it pins the chunks in the shared pool (``store.view``,
  zero-copy; chunks not in DRAM are read into a staging buffer first, which in sync mode is what the step
  waits for) and fills the engine's blocks one layer at a time straight from the pool; ``wait_for_layer_load``
  blocks only until *that* layer is in, so the copy of layer i+1 overlaps the attention of layer i.
* Asynchronous loads (chunks that had to come up from disk) run on their own thread and are reported through
  ``get_finished``; vLLM keeps scheduling other requests meanwhile. The job arrives as soon as the scheduler
  reaches the request; each chunk is copied into the engine the moment it reaches DRAM (the scheduler's
  process is reading it); once the scheduler reports its reads settled, whatever is still missing is read
  here on demand (joining a read in flight in another process rather than reading twice). A load the scheduler
  releases (its request waited past its deadline) is reported finished at once, whatever its thread is doing:
  what it had not copied yet goes to vLLM as load errors, and its thread copies nothing more.
* Saves run after the forward on a saver thread: copy the chunk's pages out of the blocks (the only moment the
  blocks are needed), then ``store.put`` (DRAM now, disk write-back asynchronously).
* An engine with nothing to compute but loads in flight would spin through empty steps: the scheduler's half
  holds such a step until the next read lands (`SchedulerSide._wait_parked`: vLLM's engine core spins while it
  waits for a worker's reply, so only a wait there frees its core), and the worker waits a few ms at most for
  an async load to finish, so that the step reports it.
* A chunk that fails to load is a miss: its blocks go to ``get_block_ids_with_load_errors`` and vLLM
  recomputes them; a model with several KV cache groups (whose loads are all async) reports the request as a
  failed load instead (``failed_recving``: vLLM cannot map a block id back to its group), and vLLM computes its
  prompt. Each failure cause is logged once.
* A model with several KV cache groups has sliding-window groups whose blocks vLLM frees as the request moves
  past them, and reuses in the next step: a step starts only once the saves of the last one have copied their
  blocks out (`Saver.wait_all`), so a save never reads a block that another request's forward writes.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

import torch

from kvprefetch.episodes import EpisodeLog
from kvprefetch.io.affinity import pin_thread, pinned_initializer
from kvprefetch.vllm.layout import ChunkGeometry, PagedKV, chunk_tensor
from kvprefetch.vllm.metadata import KVPrefetchMetadata, KVPrefetchWorkerMeta, LoadJob, SaveJob
from kvprefetch.vllm.metrics import ConnectorCounters
from kvprefetch.vllm.store_api import ConnectorStore, WorkerStore
from kvprefetch.vllm.timeline import timeline

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


def _episode_warner() -> Callable[[str, str], None]:
    """A failure cause is logged once per episode (`kvprefetch.episodes`), not once per chunk."""
    episodes = EpisodeLog(log)

    def warn(cause: str, msg: str) -> None:
        episodes.warn(cause, "kvprefetch: %s (one line per episode: %s)", msg, cause)

    return warn


class Telemetry:
    """What this worker did since its last report, in one record: the rates the scheduler's cost model learns
    (copy into the engine, reads below DRAM, forward passes), finished saves, and this rank's counts."""

    def __init__(self, rank: int):
        self.rank = rank
        self._lock = threading.Lock()
        self._meta = KVPrefetchWorkerMeta()

    def _rank(self, name: str, n: int) -> None:
        counts = self._meta.ranks.setdefault(self.rank, {})
        counts[name] = counts.get(name, 0) + n

    def loaded(self, chunks: int, nbytes: int, copy_seconds: float) -> None:
        with self._lock:
            self._meta.load_bytes += nbytes
            self._meta.load_seconds += copy_seconds
            if chunks:
                self._rank("loaded_chunks", chunks)
                self._rank("loaded_bytes", nbytes)

    def read_below_dram(self, nbytes: int, seconds: float) -> None:
        with self._lock:
            self._meta.disk_bytes += nbytes
            self._meta.disk_seconds += seconds

    def forward(self, tokens: int, seconds: float) -> None:
        with self._lock:
            self._meta.step_tokens += tokens
            self._meta.forward_seconds += seconds

    def save_done(self, job_id: int) -> None:
        with self._lock:
            self._meta.saves_done[job_id] = 1

    def saved(self, chunks: int, nbytes: int) -> None:
        with self._lock:
            self._rank("saved_chunks", chunks)
            self._rank("saved_bytes", nbytes)

    def drain(self) -> KVPrefetchWorkerMeta | None:
        with self._lock:
            meta, self._meta = self._meta, KVPrefetchWorkerMeta()
        return None if meta.is_empty() else meta


@dataclass
class _AsyncLoad:
    """An async load on this worker: its job, the chunks copied so far, and whether it was released (reported
    finished before its thread was done with it: the thread then copies nothing more and reports nothing)."""

    job: LoadJob
    copied: int = 0
    released: bool = False


class _LayerwiseLoad:
    """One step's synchronous loads: stage every chunk, then scatter layer by layer, signalling each layer."""

    def __init__(self, loader: Loader, jobs: list[LoadJob]):
        self.loader = loader
        self.jobs = jobs
        self.events = [threading.Event() for _ in range(loader.geo.num_layers)]
        self.error_blocks: set[int] = set()
        self.exc: BaseException | None = None
        self.chunks = 0
        self.copy_seconds = 0.0
        self.thread = threading.Thread(target=self._pinned_run, name="kvprefetch-load", daemon=True)

    def _pinned_run(self) -> None:
        pin_thread(self.loader.store.config.io.cpus)
        self._run()

    def start(self, background: bool) -> None:
        if background:
            self.thread.start()
        else:
            self._run()

    def _run(self) -> None:
        loader = self.loader
        geo = loader.geo
        try:
            with contextlib.ExitStack() as stack:
                work = []  # (chunk sources, block ids) per job
                stage = loader.load_stage.get(sum(j.num_chunks for j in self.jobs))  # rows touched only if used
                row = 0
                for job in self.jobs:
                    srcs = loader.sources(job, stack, stage[row : row + job.num_chunks])
                    row += job.num_chunks
                    self.error_blocks |= failed_blocks(job, len(srcs))
                    work.append((srcs, job.block_ids[: len(srcs)]))
                t_copy = time.perf_counter()
                for li in range(geo.num_layers):
                    for srcs, ids in work:
                        for src, chunk_ids in zip(srcs, ids, strict=True):
                            loader.kv.scatter_chunk_layer(li, src, chunk_ids, geo)
                    self.events[li].set()
                self.copy_seconds = time.perf_counter() - t_copy
            self.chunks = sum(len(srcs) for srcs, _ in work)
        except BaseException as e:  # never leave the forward pass waiting
            self.exc = e
            for job in self.jobs:
                self.error_blocks |= failed_blocks(job, 0)
        finally:
            for ev in self.events:
                ev.set()

    def wait_layer(self, li: int) -> None:
        self.events[li].wait()

    def join(self) -> None:
        for ev in self.events:
            ev.wait()
        if self.thread.is_alive():
            self.thread.join()


def failed_blocks(job: LoadJob, n_ok: int) -> set[int]:
    """The blocks of the job's chunks from n_ok on (vLLM recomputes them)."""
    return {b for ids in job.block_ids[n_ok:] for b in ids if b >= 0}


class _RankPart:
    """What both parts of a worker work on: this rank's paged KV and view of the store, and where they report."""

    def __init__(self, rank: int, kv: PagedKV, geo: ChunkGeometry, store: WorkerStore, counters: ConnectorCounters,
                 telemetry: Telemetry, warn: Callable[[str, str], None], replicated: bool = False):  # fmt: skip
        self.rank, self.kv, self.geo, self.store = rank, kv, geo, store
        self.counters, self.telemetry, self.warn = counters, telemetry, warn
        self.replicated = replicated  # every rank holds the same KV (MLA): the job's one part is every rank's

    @property
    def key_rank(self) -> int:
        """Whose part of a job's chunks this rank copies (``job.keys[key_rank]``)."""
        return 0 if self.replicated else self.rank

    @property
    def saves(self) -> bool:
        """Whether this rank saves: each rank its own part, or rank 0 alone the part every rank shares."""
        return not self.replicated or self.rank == 0

    def shares(self) -> tuple:
        """The constructor's arguments: what another part of the same worker shares with this one."""
        return self.rank, self.kv, self.geo, self.store, self.counters, self.telemetry, self.warn, self.replicated


class Loader(_RankPart):
    """Store -> engine: this step's synchronous, layer-wise loads and the asynchronous loads between steps."""

    def __init__(self, part: _RankPart, layerwise: bool, pin: bool):
        super().__init__(*part.shares())
        self.layerwise = layerwise
        self.load_stage = _Staging(self.geo.chunk_bytes, pin)
        self._aload_stage = _Staging(self.geo.chunk_bytes, pin)
        self._sync: _LayerwiseLoad | None = None
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="kvprefetch-aload",
                                        initializer=pinned_initializer(self.store.config.io.cpus))
        self._lock = threading.Lock()
        self._cv = threading.Condition(self._lock)
        self._inflight = 0
        self._done_recv: list[tuple[str, set[int]]] = []
        self._errors: set[int] = set()
        self.fail_requests = self.kv.num_groups > 1  # report a failed async load as its request (module docstring)
        self._failed: set[str] = set()
        self._settled: set[str] = set()
        self._cancelled: set[str] = set()
        self._active: dict[str, _AsyncLoad] = {}  # requests with an async load on this worker
        # Held while a chunk is copied into an async load's blocks: a release waits for that copy, never for reads
        # (vLLM may reuse the blocks once the load is reported finished).
        self._copy_lock = threading.Lock()
        self._started: KVPrefetchMetadata | None = None
        self.timeline = timeline()

    # ---- reading chunks -------------------------------------------------------------------------------------
    def sources(self, job: LoadJob, stack: contextlib.ExitStack, stage: torch.Tensor) -> list[torch.Tensor]:
        """Flat uint8 sources for the job's leading loadable chunks: zero-copy pinned views of the DRAM pool
        where the chunks are there (held until ``stack`` exits), the staging buffer for the rest."""
        keys = job.keys[self.key_rank]
        n = len(keys)
        views: list = []
        try:
            views = stack.enter_context(self.store.view(keys))
        except Exception as e:  # the store (or its process) is gone: a miss, never a failed request
            self.warn(type(e).__name__, f"store read failed ({e}); recomputing")
            self.counters.inc("load_error_chunks", n)
            return []
        srcs = [chunk_tensor(v) for v in views]
        if len(srcs) < n:  # below DRAM (sync mode) or evicted since planning: read them now, inside the step
            t0 = time.perf_counter()
            got = self._get_into(keys[len(srcs) :], stage)
            if got and job.on_disk:
                self.telemetry.read_below_dram(got * self.geo.chunk_bytes, time.perf_counter() - t0)
            srcs += [stage[i] for i in range(got)]
        if len(srcs) < n:  # the store logged the cause (a failed read), if it was one; evicted since planning is not
            self.counters.inc("load_error_chunks", n - len(srcs))
        self.counters.inc("worker_loaded_chunks", len(srcs))
        return srcs

    def _get_into(self, keys: Sequence[bytes], stage: torch.Tensor) -> int:
        try:
            return int(self.store.get_into(keys, [stage[i].numpy() for i in range(len(keys))]))
        except Exception as e:
            self.warn(type(e).__name__, f"store read failed ({e}); recomputing")
            return 0

    def _scatter_all(self, src: torch.Tensor, block_ids: Sequence[int]) -> None:
        for li in range(self.geo.num_layers):
            self.kv.scatter_chunk_layer(li, src, block_ids, self.geo)

    # ---- per step -------------------------------------------------------------------------------------------
    def start_async(self, meta: KVPrefetchMetadata) -> None:
        """Start this step's async loads (once per step) and pass on which have settled or were cancelled."""
        if self._started is meta:
            return
        self._started = meta
        for job in meta.loads:
            if job.is_async or job.cancelled:
                load = _AsyncLoad(job)
                with self._lock:
                    self._inflight += 1
                    self._active[job.req_id] = load
                self._pool.submit(self._async_load, load)
                self.timeline.event("job_queued", job.req_id, chunks=job.num_chunks, awaits=job.awaits_prefetch)
        if meta.settled or meta.cancel_loads:
            with self._cv:
                self._settled.update(r for r in meta.settled if r in self._active)
                self._cancelled.update(r for r in meta.cancel_loads if r in self._active)
                self._cv.notify_all()
        for rid in meta.release_loads:
            self._release(rid)

    def _release(self, rid: str) -> None:
        """Report the request's async load finished now (`KVPrefetchMetadata.release_loads`), the chunks it has not
        copied yet as load errors: vLLM computes them. Its thread may be queued behind another load, or inside a
        read that does not return; it is not waited for. Only a chunk being copied into the blocks is (a few ms):
        once reported, vLLM may hand the blocks to another request."""
        with self._copy_lock, self._cv:
            load = self._active.get(rid)
            if load is None or load.released:
                return
            load.released = True
            errors = failed_blocks(load.job, load.copied)
            self._done_recv.append((rid, errors))
            self._cv.notify_all()
        self.counters.inc("load_error_chunks", load.job.num_chunks - load.copied)
        self.timeline.event("job_released", rid, copied=load.copied, errors=len(errors))

    def start_sync(self, meta: KVPrefetchMetadata) -> bool:
        """Start this step's synchronous loads (layer by layer, alongside the forward pass); True if any."""
        sync = [j for j in meta.loads if not j.is_async and not j.cancelled]
        if sync:
            self.counters.inc("sync_loads", len(sync))
            self._sync = _LayerwiseLoad(self, sync)
            self._sync.start(background=self.layerwise)
        return bool(sync)

    def wait_layer(self, li: int | None) -> None:
        sync = self._sync
        if sync is not None:
            self.counters.inc("layer_load_waits")
            if li is None:
                sync.join()
            else:
                sync.wait_layer(li)

    def finish_sync(self) -> bool:
        """After the forward: collect the step's synchronous load (True if there was one)."""
        sync, self._sync = self._sync, None
        if sync is None:
            return False
        sync.join()
        if sync.exc is not None:
            self.warn(type(sync.exc).__name__, f"load into the engine failed ({sync.exc}); recomputing")
        with self._lock:
            self._errors |= sync.error_blocks
        self.telemetry.loaded(sync.chunks, sync.chunks * self.geo.chunk_bytes, sync.copy_seconds)
        return True

    def idle_wait(self) -> None:
        """An empty step (nothing to compute): wait briefly for an async load to finish, so that the step reports
        it at once. (Short: vLLM's engine core spins while it waits for this reply; the scheduler's half does the
        long wait, `SchedulerSide._wait_parked`.)"""
        with self._cv:
            if self._inflight and not self._done_recv:
                self._cv.wait(IDLE_WAIT_S)

    def _async_load(self, load: _AsyncLoad) -> None:
        """Copy each chunk into the engine as soon as it is in DRAM, in order; report the job finished (unless it
        was released meanwhile: `_release` reported it)."""
        job = load.job
        errors: set[int] = set()
        rid = job.req_id
        self.timeline.event("job_start", rid)
        try:
            if not job.cancelled and not load.released:
                self.counters.inc("async_loads")
                n_ok, copy_s = self._copy_as_they_land(load)
                cancelled = rid in self._cancelled
                if n_ok < job.num_chunks and not cancelled and not load.released:  # (the store logged the cause)
                    self.counters.inc("load_error_chunks", job.num_chunks - n_ok)
                self.counters.inc("worker_loaded_chunks", n_ok)
                errors = set() if cancelled else failed_blocks(job, n_ok)  # (finished: nothing to recompute)
                self.telemetry.loaded(n_ok, n_ok * self.geo.chunk_bytes, copy_s)
        except BaseException as e:
            self.warn(type(e).__name__, f"async load failed ({e}); recomputing")
            errors = failed_blocks(job, 0)
        self.timeline.event("job_done", rid, errors=len(errors), released=load.released)
        with self._cv:
            if not load.released:
                self._done_recv.append((rid, errors))
            if self._active.get(rid) is load:
                del self._active[rid]
                self._settled.discard(rid)
                self._cancelled.discard(rid)
            self._inflight -= 1
            self._cv.notify_all()

    def _copy_as_they_land(self, load: _AsyncLoad) -> tuple[int, float]:
        """(chunks copied, copy seconds): in order, each once it is in DRAM; while the scheduler's process is
        still reading them (until it reports them settled) look again every POLL_S, after that read here. Stops
        at the first chunk after the load was cancelled or released."""
        job = load.job
        rid = job.req_id
        copy_s = 0.0
        for i, key in enumerate(job.keys[self.key_rank]):
            t_wait = time.perf_counter()
            while True:
                with self._lock:
                    if rid in self._cancelled or load.released:
                        return i, copy_s
                    settled = rid in self._settled
                with self.store.view([key]) as views:
                    if views:
                        t0 = time.perf_counter()
                        if not self._copy_in(load, i, chunk_tensor(views[0])):
                            return i, copy_s
                        copy_s += time.perf_counter() - t0
                        self.timeline.event("copied", rid, i=i, how="dram", waited=round(t0 - t_wait, 4))
                        break
                if job.awaits_prefetch and not settled:
                    with self._cv:  # the scheduler's process is reading it: look again soon
                        self._cv.wait(POLL_S)
                    continue
                stage = self._aload_stage.get(1)  # not coming (or evicted): read it here
                t_read = time.perf_counter()
                if not self._get_into([key], stage):
                    return i, copy_s
                t0 = time.perf_counter()
                if not self._copy_in(load, i, stage[0]):
                    return i, copy_s
                self.timeline.event("copied", rid, i=i, how="read", read_s=round(t0 - t_read, 4),
                              waited=round(t0 - t_wait, 4))  # fmt: skip
                copy_s += time.perf_counter() - t0
                break
        return job.num_chunks, copy_s

    def _copy_in(self, load: _AsyncLoad, i: int, src: torch.Tensor) -> bool:
        """Copy chunk i into the load's blocks, unless the load was released (False): its blocks are vLLM's again."""
        with self._copy_lock:
            if load.released:
                return False
            self._scatter_all(src, load.job.block_ids[i])
            load.copied = i + 1
        return True

    # ---- reporting ------------------------------------------------------------------------------------------
    def finished_recving(self) -> set[str]:
        with self._lock:
            recv = {rid for rid, _ in self._done_recv}
            for rid, errs in self._done_recv:
                if errs and self.fail_requests:
                    self._failed.add(rid)
                else:
                    self._errors |= errs
            self._done_recv = []
        return recv

    def take_failed(self) -> set[str]:
        """Requests whose async load failed, reported finished already (`fail_requests`)."""
        with self._lock:
            failed, self._failed = self._failed, set()
        return failed

    def take_errors(self) -> set[int]:
        with self._lock:
            errs, self._errors = self._errors, set()
        return errs

    def shutdown(self) -> None:
        """Stop the async loads first, then join their thread: a load parked on the scheduler's reads waits for
        the scheduler to report them settled or cancelled, which a scheduler that is shutting down never does
        (the join waited forever)."""
        with self._cv:
            self._cancelled |= set(self._active)
            self._cv.notify_all()
        self._pool.shutdown(wait=True)


class Saver(_RankPart):
    """Engine -> store: after the forward, copy each whole chunk's pages out of its blocks (the only moment the
    blocks are needed), then `store.put` (DRAM now, disk write-back asynchronously)."""

    def __init__(self, part: _RankPart, pin: bool):
        super().__init__(*part.shares())
        self._stage = _Staging(self.geo.chunk_bytes, pin)
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="kvprefetch-save",
                                        initializer=pinned_initializer(self.store.config.io.cpus))
        self._lock = threading.Lock()
        self._by_req: dict[str, set[int]] = {}
        self._futs: dict[int, Future] = {}
        self._await: set[str] = set()

    def submit(self, meta: KVPrefetchMetadata) -> None:
        for job in meta.saves if self.saves else ():
            with self._lock:
                self._by_req.setdefault(job.req_id, set()).add(job.job_id)
                self._futs[job.job_id] = self._pool.submit(self._save, job)
        self._await.update(meta.await_saves)

    def wait_all(self) -> None:
        """Until every save submitted so far has copied its blocks out (their blocks may be reused now)."""
        with self._lock:
            futs = list(self._futs.values())
        for f in futs:
            f.result()

    def wait_for(self, rid: str) -> None:
        """Until the request's saves have copied its blocks out (it was preempted: they may be reused)."""
        with self._lock:
            futs = [self._futs[j] for j in self._by_req.get(rid, ()) if j in self._futs]
        for f in futs:
            f.result()

    def _save(self, job: SaveJob) -> None:
        keys = job.keys[self.key_rank]
        try:
            stage = self._stage.get(len(keys))
            self.kv.gather_into(job.block_ids, stage, self.geo)
            if stage.device.type != "cpu":
                stage = stage.cpu()
            self._blocks_free(job)  # the blocks are no longer needed once their pages are copied out
            fut = self.store.put(keys, [stage[i].numpy() for i in range(len(keys))], write_back=job.write_back)
            fut.add_done_callback(self._log_writeback)
            self.counters.inc("worker_saved_chunks", len(keys))
            self.telemetry.saved(len(keys), len(keys) * self.geo.chunk_bytes)
        except BaseException as e:
            self.counters.inc("save_errors")
            self.warn("save:" + type(e).__name__, f"save failed ({e}); those chunks stay uncached")
        finally:
            self._blocks_free(job)

    def _log_writeback(self, fut: Future) -> None:
        if not fut.cancelled() and fut.exception() is not None:
            e = fut.exception()
            self.warn("writeback:" + type(e).__name__, f"disk write-back failed ({e}); DRAM still serves")

    def _blocks_free(self, job: SaveJob) -> None:
        with self._lock:
            if job.job_id not in self._futs:
                return
            del self._futs[job.job_id]
            ids = self._by_req.get(job.req_id)
            if ids is not None:
                ids.discard(job.job_id)
                if not ids:
                    del self._by_req[job.req_id]
        self.telemetry.save_done(job.job_id)

    def finished_sending(self) -> set[str]:
        """Finished requests whose blocks the scheduler held for their saves, and that are done with them."""
        with self._lock:
            sending = {rid for rid in self._await if rid not in self._by_req}
            self._await -= sending
        return sending

    def drain(self, timeout: float) -> None:
        """Until every save submitted so far has handed its chunks to the store."""
        self._pool.submit(lambda: None).result(timeout)  # (one thread, first in first out)

    def shutdown(self) -> None:
        self._pool.shutdown(wait=True)


class WorkerSide:
    """One tensor-parallel rank's worker: a `Loader` and a `Saver` over this rank's view of the store."""

    def __init__(
        self,
        rank: int,
        layer_names: Sequence[str],
        num_blocks: int,
        block_size: int,
        chunk_tokens: int,
        open_store: Callable[[int], ConnectorStore],
        counters: ConnectorCounters,
        layerwise: bool = True,
        layer_groups: Sequence[int] | None = None,
        replicated: bool = False,
    ):
        """``layer_names`` in chunk order; ``layer_groups``: each layer's KV cache group position (None: one);
        ``replicated``: every rank holds the same KV (MLA), stored once under rank 0's keys (`ConnectorSpec`)."""
        self.replicated = replicated
        self.rank = rank
        self.layer_names = list(layer_names)
        self.group_of = dict(zip(self.layer_names, layer_groups or [0] * len(self.layer_names), strict=True))
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.chunk_tokens = chunk_tokens
        self.open_store = open_store
        self.counters = counters
        self.layerwise = layerwise
        self.telemetry = Telemetry(rank)
        self.store: ConnectorStore | None = None
        self.loader: Loader | None = None
        self.saver: Saver | None = None
        self.layer_index: dict[str, int] = {}
        self._t_bind = 0.0

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        names = [n for n in self.layer_names if n in kv_caches] or list(kv_caches)
        self.layer_index = {n: i for i, n in enumerate(names)}
        kv = PagedKV([kv_caches[n] for n in names], self.num_blocks, self.block_size,
                     [self.group_of.get(n, 0) for n in names])  # fmt: skip
        geo = kv.geometry(self.chunk_tokens)
        pin = kv.device.type == "cuda"
        self.store = self.open_store(geo.chunk_bytes)
        part = _RankPart(self.rank, kv, geo, self.store, self.counters, self.telemetry, _episode_warner(),
                         self.replicated)  # fmt: skip
        self.loader = Loader(part, self.layerwise, pin)
        self.saver = Saver(part, pin)

    # ---- per step -------------------------------------------------------------------------------------------
    def on_bind(self, meta: KVPrefetchMetadata) -> None:
        """Before the forward: start this step's async loads now, so they overlap the forward and can be
        reported finished at the end of this very step (vLLM itself would start them after the forward)."""
        self._t_bind = time.perf_counter()
        if self.loader is None:
            return
        # (several groups: a save's blocks may be reused by this step's forward, which may run before start_load_kv)
        if self.loader.kv.num_groups > 1 or meta.loads or meta.settled or meta.cancel_loads or meta.release_loads:
            self.handle_preemptions(meta)  # an async load may write blocks a preempted request's save still reads
            self.loader.start_async(meta)

    def handle_preemptions(self, meta: KVPrefetchMetadata) -> None:
        """Before anything of the step writes blocks: the saves that read blocks vLLM may have handed on have
        copied them out (a preempted request's; with several KV cache groups every save: the module docstring)."""
        if self.saver is None:
            return
        if self.loader is not None and self.loader.kv.num_groups > 1:
            self.saver.wait_all()
            return
        for rid in meta.preempted:
            self.saver.wait_for(rid)

    def start_load_kv(self, meta: KVPrefetchMetadata) -> None:
        if self.loader is None:
            return
        self.handle_preemptions(meta)
        self.loader.start_async(meta)  # no-op when on_bind started them
        self.loader.start_sync(meta)

    def wait_for_layer_load(self, layer_name: str) -> None:
        if self.loader is not None:
            self.loader.wait_layer(self.layer_index.get(layer_name))

    def wait_for_save(self, meta: KVPrefetchMetadata) -> None:
        if self.loader is None or self.saver is None:
            return
        had_sync = self.loader.finish_sync()
        if not had_sync and meta.step_tokens:
            self.telemetry.forward(meta.step_tokens, time.perf_counter() - self._t_bind)
        elif not meta.step_tokens and not had_sync and not meta.saves:
            self.loader.idle_wait()
        self.saver.submit(meta)

    # ---- reporting ------------------------------------------------------------------------------------------
    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        if self.loader is None or self.saver is None:
            return None, None
        recv = self.loader.finished_recving()
        sending = self.saver.finished_sending()
        return (sending or None), (recv or None)

    def take_failed_loads(self) -> set[str]:
        return self.loader.take_failed() if self.loader is not None else set()

    def get_block_ids_with_load_errors(self) -> set[int]:
        errs = self.loader.take_errors() if self.loader is not None else set()
        if errs:
            self.counters.inc("load_error_blocks", len(errs))
        return errs

    def build_worker_meta(self) -> KVPrefetchWorkerMeta | None:
        return self.telemetry.drain()

    def flush(self, timeout: float) -> bool:
        """Until every save submitted so far is in the store and written back."""
        if self.saver is not None:
            self.saver.drain(timeout)
        return self.store is None or self.store.flush(timeout)

    def shutdown(self) -> None:
        if self.loader is not None:
            self.loader.shutdown()
        if self.saver is not None:
            self.saver.shutdown()
        if self.store is not None:
            with contextlib.suppress(Exception):
                self.store.flush(timeout=30)
