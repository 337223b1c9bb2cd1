"""Scheduler-side half of the connector: lookup, prefetch on arrival, the load plan, save bookkeeping.

Runs in vLLM's scheduler (engine-core) process, where requests arrive. Life of a request:

1. ``on_new_request``: key its whole chunks, look them up and, with prefetch on, start reading its disk hits
   into the shared DRAM pool at once, in arrival order, while it waits behind other requests.
2. ``get_num_new_matched_tokens`` (when the scheduler reaches it): the hit beyond the engine's own prefix
   cache, trimmed by the cost model to what loads faster than it recomputes (measured prefill speed against
   measured disk throughput and the reads queued ahead). All of it in DRAM: a synchronous, layer-wise load in
   this step's forward. Some still below DRAM: ``load_mode: async`` (default) makes it an asynchronous load:
   the request waits (``WAITING_FOR_REMOTE_KVS``) without blocking the others, its reads start now if prefetch
   is off, and the worker copies each chunk into the engine as it reaches DRAM; ``load_mode: sync`` makes it
   a synchronous load whose disk reads the worker does inside the step (the step waits).
3. ``build_connector_meta`` each step: the loads, which async loads' reads have settled, and the saves of
   every whole chunk that the step completes (prompt and generated tokens).
4. ``request_finished``: hold the blocks (True) only while a save from them may still be reading them.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from kvprefetch.keys import ChunkKeyer
from kvprefetch.vllm.costmodel import CostModel, TierMeter
from kvprefetch.vllm.metadata import KVPrefetchMetadata, KVPrefetchWorkerMeta, LoadJob, SaveJob
from kvprefetch.vllm.metrics import ConnectorCounters
from kvprefetch.vllm.settings import ConnectorSettings


def _is_dram(tier: Any) -> bool:
    return str(getattr(tier, "value", tier)).lower() == "dram"


@dataclass
class _Req:
    req_id: str
    request: Any
    keys: list[bytes] = field(default_factory=list)
    keyed_tokens: int = 0
    prefetch: Any = None  # PrefetchHandle from arrival (or from reaching the request, prefetch off)
    prefetch_chunks: int = 0
    arrival_seq: int = 0
    arrival_in_dram: int = 0
    planned: tuple[int, int, bool] | None = None  # (first chunk, chunks to load, async) from the last query
    pending_load: LoadJob | None = None  # async load handed to the worker, waiting for its chunks/copy
    settled_sent: bool = False
    skipped_slower: int = 0
    held: list[bytes] = field(default_factory=list)  # prefetched chunks pinned in DRAM until the load is done
    released: bool = False
    pinned: list[bytes] = field(default_factory=list)
    saved_chunks: int = 0  # leading chunks known to be in the store (loaded, present or saved)
    saves_inflight: set[int] = field(default_factory=set)
    reached: bool = False


class SchedulerSide:
    def __init__(
        self,
        settings: ConnectorSettings,
        keyer: ChunkKeyer,
        store: Any,
        block_size: int,
        blocks_per_chunk: int,
        chunk_bytes: int,
        world_size: int,
        counters: ConnectorCounters,
        get_block_ids: Callable[[str], list[int]] | None = None,
        clock: Callable[[], float] = time.monotonic,
    ):
        self.s = settings
        self.keyer = keyer
        self.store = store
        self.block_size = block_size
        self.bpc = blocks_per_chunk
        self.C = keyer.chunk_tokens
        self.chunk_bytes = chunk_bytes
        self.world_size = world_size
        self.counters = counters
        self.get_block_ids = get_block_ids
        self.clock = clock
        self.cost = CostModel(
            chunk_bytes,
            self.C,
            disk_bps=settings.disk_bps_prior or float(settings.store.io.read_rate_limit_bps or 1e9),
            prefill_tps=settings.prefill_tps_prior,
            margin=settings.load_margin,
        )
        self.reqs: dict[str, _Req] = {}
        self._sync_loads: list[LoadJob] = []
        self._unpin_next: list[_Req] = []
        self._await_saves: list[str] = []
        self._save_owner: dict[int, tuple[str, int]] = {}  # job id -> (req id, workers done)
        self._next_job = 1
        self._seq = 0
        self._cancel_loads: list[str] = []
        self._last_step_tokens = 0
        self._last_step_reqs = 0  # requests the last step ran (those a synchronous read would stall)
        # Throughput of the reads this process drives (prefetches); the workers report their own demand reads.
        self.disk_meter = TierMeter(self.cost.observe_disk, clock=clock)
        # Prefetched chunks stay pinned in DRAM until their request is served, so later arrivals and saves do
        # not evict them first; at most half the DRAM tier is held that way.
        self._pin_lock = threading.Lock()
        self._held = 0
        image = max(chunk_bytes, 1)
        self._hold_budget = int(settings.store.dram.capacity_bytes) // image // 2

    # ---- keys -----------------------------------------------------------------------------------------------
    def _keys(self, st: _Req, num_tokens: int) -> list[bytes]:
        n = num_tokens // self.C
        if len(st.keys) < n:
            tokens = list(st.request.all_token_ids[: n * self.C])
            st.keys = self.keyer.keys(tokens)
        return st.keys[:n]

    def _state(self, request: Any) -> _Req:
        st = self.reqs.get(request.request_id)
        if st is None:
            st = self.reqs[request.request_id] = _Req(request.request_id, request)
        return st

    # ---- arrival --------------------------------------------------------------------------------------------
    def on_new_request(self, request: Any) -> None:
        st = self._state(request)
        self._seq += 1
        st.arrival_seq = self._seq
        if not self.s.prefetch or self.s.load_policy == "never":
            return
        keys = self._keys(st, len(request.prompt_token_ids or ()))
        if not keys:
            return
        hit = self.store.lookup(keys)
        st.arrival_in_dram = sum(1 for t in hit.tiers if _is_dram(t))
        # What is in DRAM already is held there too, or the requests ahead of it may evict it before it is served.
        self._hold_keys(st, [k for k, t in zip(keys, hit.tiers, strict=False) if _is_dram(t)])
        if hit.num_hit_chunks > st.arrival_in_dram:
            self._start_prefetch(st, keys[: hit.num_hit_chunks], hit.num_hit_chunks - st.arrival_in_dram)

    def _start_prefetch(self, st: _Req, keys: list[bytes], disk_chunks: int) -> None:
        st.prefetch = self.store.prefetch(keys)
        tickets = getattr(st.prefetch, "tickets", None) or {}
        st.prefetch_chunks = len(tickets) or disk_chunks
        self.disk_meter.track([getattr(t, "future", None) for t in tickets.values()], self.chunk_bytes)
        self.counters.inc("prefetched_chunks", st.prefetch_chunks)
        for key, ticket in tickets.items():
            fut = getattr(ticket, "future", None)
            if fut is not None:
                fut.add_done_callback(lambda f, key=key, st=st: self._hold(st, key, f))

    def _hold(self, st: _Req, key: bytes, fut: Any) -> None:
        """(I/O thread) A prefetched chunk reached DRAM: pin it there until its request has been served."""
        if fut.cancelled() or fut.exception() is not None or not fut.result():
            return
        self._hold_keys(st, [key])

    def _hold_keys(self, st: _Req, keys: list[bytes]) -> None:
        with self._pin_lock:
            if st.released:
                return
            keys = keys[: max(0, self._hold_budget - self._held)]
            if not keys:
                return
            for key, ok in zip(keys, self.store.pin(keys), strict=True):
                if ok:
                    st.held.append(key)
                    self._held += 1

    def _release_held(self, st: _Req) -> None:
        with self._pin_lock:
            st.released = True
            keys, st.held = st.held, []
            self._held -= len(keys)
        if keys:
            self.store.unpin(keys)

    def _queued_disk_bytes(self, st: _Req) -> int:
        """Reads queued in front of this request's: other requests' unfinished reads that arrived earlier
        (prefetch is served in arrival order); with no read of its own in flight, every outstanding read."""
        if st.prefetch is None or not st.prefetch_chunks or st.prefetch.done():
            return self.disk_meter.outstanding * self.chunk_bytes
        n = 0
        for other in self.reqs.values():
            h = other.prefetch
            if other is st or h is None or not other.prefetch_chunks or other.arrival_seq > st.arrival_seq:
                continue
            tickets = getattr(h, "tickets", None)
            if tickets:
                n += sum(1 for t in tickets.values() if not t.done())
            elif not h.done():
                n += other.prefetch_chunks
        return n * self.chunk_bytes

    # ---- reaching the request -------------------------------------------------------------------------------
    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int) -> tuple[int, bool]:
        st = self._state(request)
        st.planned = None
        if self.s.load_policy == "never":
            return 0, False
        # At least one token must be computed to produce logits: never hit the whole sequence.
        keys = self._keys(st, max(request.num_tokens - 1, 0))
        if not keys:
            return 0, False
        hit = self.store.lookup(keys)
        n_hit = hit.num_hit_chunks
        first = num_computed_tokens // self.C  # chunks fully on the engine already
        on_disk = [not _is_dram(t) for t in hit.tiers]
        if not st.reached:
            st.reached = True
            if st.prefetch is not None and st.prefetch_chunks:
                if st.prefetch.done():
                    self.counters.inc("prefetch_in_time")
                    if any(on_disk):  # DRAM too small for what is queued: the reads were wasted
                        self.counters.inc("prefetch_evicted")
                else:
                    self.counters.inc("prefetch_late")
        if n_hit * self.C <= num_computed_tokens:
            self._release_held(st)
            return 0, False
        if self.s.load_policy == "always":
            k = n_hit
        else:
            async_s = self.cost.expected_step_s(self._last_step_tokens) if self.s.load_mode != "sync" else None
            plan = self.cost.plan(on_disk, first, self._queued_disk_bytes(st), async_s)
            k = plan.load_chunks
            # (vLLM asks again each step while the request waits for blocks: count each chunk once)
            if plan.skipped_slower > st.skipped_slower:
                self.counters.inc("recomputed_slower_chunks", plan.skipped_slower - st.skipped_slower)
                st.skipped_slower = plan.skipped_slower
            if k < n_hit and st.prefetch is not None and getattr(st.prefetch, "tickets", None):
                # Reads of chunks it will recompute are wasted: drop those not started yet.
                for key in keys[k:n_hit]:
                    ticket = st.prefetch.tickets.get(key)
                    if ticket is not None and ticket.cancel():
                        self.counters.inc("prefetch_cancelled_chunks")
        if k * self.C <= num_computed_tokens:
            self._release_held(st)
            return 0, False
        disk = sum(on_disk[first:k])
        is_async = bool(disk) and self._park(st, disk)
        st.planned = (first, k, is_async, disk)
        return k * self.C - num_computed_tokens, is_async

    def _park(self, st: _Req, disk_chunks: int) -> bool:
        """What happens to a request reached with ``disk_chunks`` of its load still below DRAM: parked, waiting
        asynchronously for its reads (True), or read inside this step (False). ``load_mode`` decides; ``auto``
        asks the cost model which costs the batch less (the queue ahead of its reads included)."""
        if self.s.load_mode != "auto":
            return self.s.load_mode == "async"
        remaining = disk_chunks * self.chunk_bytes + self._queued_disk_bytes(st)
        step_s = self.cost.expected_step_s(self._last_step_tokens)
        if self.cost.finish_in_step(remaining, self._last_step_reqs, step_s):
            self.counters.inc("finished_in_step")
            return False
        return True

    def update_state_after_alloc(self, request: Any, block_ids: Sequence[int], num_external_tokens: int) -> None:
        st = self._state(request)
        planned, st.planned = st.planned, None
        if num_external_tokens <= 0 or planned is None:
            return
        _, k, is_async, disk = planned
        start_tok = k * self.C - num_external_tokens  # the engine's own (block-aligned) prefix hit ends here
        first = start_tok // self.C
        keys = st.keys[first:k]
        per_chunk: list[list[int]] = []
        for c in range(first, k):
            ids = []
            for j in range(self.bpc):
                b = c * self.bpc + j
                ids.append(int(block_ids[b]) if b * self.block_size >= start_tok else -1)
            per_chunk.append(ids)
        job = LoadJob(request.request_id, keys, per_chunk, is_async, on_disk=disk)
        pinned = self.store.pin(keys)
        st.pinned = [key for key, ok in zip(keys, pinned, strict=True) if ok]
        st.saved_chunks = max(st.saved_chunks, k)
        self.counters.inc("loaded_chunks", len(keys))
        if disk and (st.prefetch is None or not st.prefetch_chunks):
            self.counters.inc("demand_reads", 1)
            if is_async:  # prefetch off (or nothing in flight): the reads start now that the scheduler is here
                self._start_prefetch(st, keys, disk)
        # (sync mode: the worker reads what is still below DRAM inside the step, joining reads in flight)
        if is_async:
            job.awaits_prefetch = st.prefetch is not None and bool(st.prefetch_chunks)
            st.pending_load = job
            st.settled_sent = not job.awaits_prefetch
        self._sync_loads.append(job)

    # ---- each step ------------------------------------------------------------------------------------------
    def build_connector_meta(self, scheduler_output: Any) -> KVPrefetchMetadata:
        # Last step's synchronous loads have run: their DRAM pins can go.
        for st in self._unpin_next:
            self._unpin(st)
        self._unpin_next = []
        meta = KVPrefetchMetadata(loads=self._sync_loads)
        self._sync_loads = []
        for job in meta.loads:
            st = self.reqs.get(job.req_id)
            if st is not None and not job.is_async:
                self._unpin_next.append(st)
        # Async loads whose reads (here) have all finished: the worker stops waiting for their chunks.
        for st in self.reqs.values():
            if st.pending_load is not None and not st.settled_sent and (st.prefetch is None or st.prefetch.done()):
                st.settled_sent = True
                meta.settled.append(st.req_id)
        meta.cancel_loads, self._cancel_loads = self._cancel_loads, []
        if self.s.save:
            self._plan_saves(scheduler_output, meta)
        meta.await_saves, self._await_saves = self._await_saves, []
        # Preempted requests lose their blocks at once: the worker must finish reading them before the step
        # reuses them. (preempted_req_ids is only filled for some model runners: check the status too.)
        pre = set(getattr(scheduler_output, "preempted_req_ids", None) or ())
        meta.preempted = [
            rid
            for rid, st in self.reqs.items()
            if st.saves_inflight and (rid in pre or "PREEMPTED" in str(getattr(st.request, "status", "")))
        ]
        meta.step_tokens = int(getattr(scheduler_output, "total_num_scheduled_tokens", 0))
        self._last_step_tokens = meta.step_tokens
        self._last_step_reqs = len(getattr(scheduler_output, "num_scheduled_tokens", None) or ())
        return meta

    def _plan_saves(self, so: Any, meta: KVPrefetchMetadata) -> None:
        progress: list[tuple[str, int]] = []
        for nr in so.scheduled_new_reqs:
            progress.append((nr.req_id, nr.num_computed_tokens + so.num_scheduled_tokens.get(nr.req_id, 0)))
        cached = so.scheduled_cached_reqs
        for i, rid in enumerate(cached.req_ids):
            progress.append((rid, cached.num_computed_tokens[i] + so.num_scheduled_tokens.get(rid, 0)))
        for rid, done_tokens in progress:
            st = self.reqs.get(rid)
            if st is None:
                continue
            full = min(done_tokens, st.request.num_tokens) // self.C
            if full <= st.saved_chunks:
                continue
            keys = self._keys(st, full * self.C)[st.saved_chunks : full]
            # Chunks already in DRAM are skipped. Chunks only on disk that the engine computed anyway (recomputed
            # because the disk was too slow, or served by vLLM's own prefix cache) are put again: into DRAM, where
            # the next hit is cheap; the store does not write them to disk twice.
            present = 0
            for tier in self.store.lookup(keys).tiers:
                if not _is_dram(tier):
                    break
                present += 1
            first = st.saved_chunks + present
            st.saved_chunks = full
            if first >= full or self.get_block_ids is None:
                continue
            blocks = self.get_block_ids(rid)
            if len(blocks) < full * self.bpc:
                continue
            job = SaveJob(
                self._next_job,
                rid,
                keys[present:],
                [[int(b) for b in blocks[c * self.bpc : (c + 1) * self.bpc]] for c in range(first, full)],
            )
            self._next_job += 1
            st.saves_inflight.add(job.job_id)
            self._save_owner[job.job_id] = (rid, 0)
            meta.saves.append(job)
            self.counters.inc("saved_chunks", len(job.keys))

    def update_connector_output(self, output: Any) -> None:
        wm = getattr(output, "kv_connector_worker_meta", None)
        if isinstance(wm, KVPrefetchWorkerMeta):
            for job_id, n in wm.saves_done.items():
                owner = self._save_owner.get(job_id)
                if owner is None:
                    continue
                rid, done = owner[0], owner[1] + n
                if done >= self.world_size:
                    del self._save_owner[job_id]
                    st = self.reqs.get(rid)
                    if st is not None:
                        st.saves_inflight.discard(job_id)
                else:
                    self._save_owner[job_id] = (rid, done)
            if wm.load_bytes and wm.load_seconds:
                self.cost.observe_copy(wm.load_bytes, wm.load_seconds)
            if wm.step_tokens and wm.forward_seconds:
                self.cost.observe_prefill(wm.step_tokens, wm.forward_seconds)
            if wm.disk_bytes and wm.disk_seconds:
                self.cost.observe_disk(wm.disk_bytes, wm.disk_seconds)
        for rid in getattr(output, "finished_recving", None) or ():
            st = self.reqs.get(rid)
            if st is not None:
                st.pending_load = None
                self._unpin(st)

    def cost_snapshot(self) -> dict[str, Any]:
        return self.cost.snapshot() | {"disk_outstanding": self.disk_meter.outstanding}

    def _unpin(self, st: _Req) -> None:
        self._release_held(st)
        if st.pinned:
            self.store.unpin(st.pinned)
            st.pinned = []

    # ---- the end --------------------------------------------------------------------------------------------
    def request_finished(self, request: Any) -> bool:
        st = self.reqs.pop(request.request_id, None)
        if st is None:
            return False
        self._release_held(st)
        if st.prefetch is not None and not st.prefetch.done() and hasattr(st.prefetch, "cancel"):
            n = st.prefetch.cancel()
            if n:
                self.counters.inc("prefetch_cancelled_chunks", n)
        if st.pending_load is not None:
            # The worker has the job; vLLM frees the blocks once the worker reports it finished: tell it to
            # stop copying (its pins are released with the job).
            self._cancel_loads.append(st.req_id)
            st.pending_load = None
            self._unpin(st)
            return False
        self._unpin(st)
        if st.saves_inflight:
            self._await_saves.append(st.req_id)
            return True
        return False
