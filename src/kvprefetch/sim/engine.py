"""The discrete-event model: arrivals, a continuous-batching engine with chunked prefill, tiered KV.

Events are kept in a heap (arrivals) and a few time-stamped states (loads in flight); the engine advances
one step at a time, or many decode-only steps at once (vectorized) when nothing else can change.
"""

from __future__ import annotations

import heapq
import itertools
from collections import deque
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from enum import StrEnum

import numpy as np

from kvprefetch.config import IOConfig
from kvprefetch.loadplan import best_prefix, finish_in_step
from kvprefetch.modes import LoadMode
from kvprefetch.sim.block_pool import BlockPool
from kvprefetch.sim.costs import Deployment
from kvprefetch.sim.policy import Policy
from kvprefetch.sim.result import SimResult
from kvprefetch.sim.tiers import BlockCache, Pipe, TierSpec, Transfer
from kvprefetch.workload.request import Request


class StepLoads(StrEnum):
    """How a step shares its time with the in-step loads it waits for (`SimConfig.sync_loads_in_step`)."""

    OVERLAPPED = "overlapped"
    """The copies run beside the compute, layer by layer (DMA engines beside a GPU): the step takes the longer."""
    SERIAL = "serial"
    """The step takes both: the compute waits for the copies. Our CPU engine: the bench's calibration derives
    its load rate so (`calibration._load_bandwidth`: the reload's time less the front end less the compute), and
    its steps bear it out (`kvprefetch bench --step-log`, dram at c=32: a prefill step of four 8 MiB loads took
    88 ms median; its compute is priced at 45 ms and the copies at the calibrated rate at 40 ms). The copies of
    a parked request's load, beside the steps, take the model's time too (the worker copies on its own
    process's interpreter): ondemand's decode-only steps at c=32 took 1.42x their price, prefetch's 0.96x."""


@dataclass(frozen=True)
class SimConfig:
    """Everything one run needs besides the requests.

    `tiers[0]` is host DRAM (read straight over the host link); the others are storage, read into DRAM
    first. `concurrency`: closed loop with that many sessions in flight; None: open loop at `arrival_s`.
    `preload` puts block ids in a tier before the run (the "cold reads" of a warm store).
    `load_vs_recompute`: the connector's rule, applied when the scheduler reaches a request (`_maybe_recompute`).
    `request_overhead_s`: the engine's own time to add one request (`_add`): requests are added one at a time
    between steps, so a burst is queued only once all of it is added (a small engine's time to first token has a
    floor of its own: our bench runs vLLM in-process, where the front end's work is the engine's too).
    `hbm_cache_blocks` (default: the deployment's KV capacity): with `engine_block_pool`, the engine's whole KV
    in blocks; without, the size of its prefix cache beside the running requests (0: none).
    `engine_block_pool`: the engine's KV is vLLM's block pool (`BlockPool`): running requests share the blocks of
    a common prefix, so a shared system prompt counts once against the capacity, and the prefix cache is what
    the free blocks still hold, evicted oldest-freed first as requests take blocks; the scheduler looks it up
    when it admits a request. When the KV is small, as in our CPU bench, this decides both how many requests
    run at once and which earlier turns are still cached. Otherwise the engine's prefix cache is an LRU beside
    the running requests, whose KV is reserved whole against the deployment's capacity.
    `sync_loads_in_step`: how loads meet the steps. True: as our connector does, a request whose external hits
    are all in DRAM when the scheduler admits it is loaded inside the step that prefills it (the whole batch
    waits for those copies), and so is every request under `ondemand-sync` (its `load_mode: sync`: storage ->
    DRAM -> engine in the step); other loads run beside the steps (the request waits, and with
    `engine_block_pool` its blocks are cached only once they have arrived, as vLLM caches an asynchronous load's
    blocks). False: the whitepaper's baseline as `Policy.ONDEMAND_SYNC` describes it (loads serialised in
    admission), and every other load beside the steps.
    `step_loads`: whether a step's compute overlaps the in-step loads it waits for (`StepLoads`).
    `late_loads`: with `sync_loads_in_step`, what becomes of a request whose storage reads are still running when
    the scheduler admits it, as the connector's `load_mode` decides: "async" parks it (its load runs beside the
    steps), "auto" finishes the reads inside the step when that costs the batch less (`loadplan.finish_in_step`,
    on the reads' remaining time, the requests of the last step and that step's length), "sync" always does.
    `io_cpu_s_per_byte`: where the KV moves by CPU copies on the cores that also compute (our CPU bench), every
    byte moved (storage -> DRAM, DRAM -> engine, and each tier a saved block is written to) delays the next
    step by this long. 0 where DMA engines move it (GPUs): transfers then only take time on their pipes.
    `io_cpu_on_loads`: whether the DRAM -> engine copies pay it too; False where the host link's rate was measured
    as the whole load path, its CPU included (the bench replay's calibration: `calibration.load_path_measured`).
    `engine_block_tokens`: the engine's own KV block size where it is smaller than `block_tokens` (vLLM's, 128
    on CPU, 16 on GPU): turns of a session extend the previous turn's prompt, and the engine's prefix cache
    holds that prompt to its last whole engine block, not only to its last whole `block_tokens` block.
    `io_depth`: reads the I/O engine keeps in flight (kvprefetch's `io.threads`); a storage tier whose
    `parallelism` is higher serves them at `TierSpec.bandwidth(io_depth)`, below its full `read_bw`.
    """

    deployment: Deployment
    policy: Policy
    tiers: tuple[TierSpec, ...] = ()
    concurrency: int | None = None
    preload: dict[str, Iterable[int]] = field(default_factory=dict)
    load_vs_recompute: bool = True
    queue_aware_eviction: bool = False
    hbm_cache_blocks: int | None = None
    block_tokens: int = 512
    engine_block_pool: bool = False
    request_overhead_s: float = 0.0
    sync_loads_in_step: bool = False
    step_loads: StepLoads = StepLoads.OVERLAPPED
    late_loads: LoadMode = "async"
    io_cpu_s_per_byte: float = 0.0
    io_cpu_on_loads: bool = True
    engine_block_tokens: int | None = None
    io_depth: int = IOConfig.model_fields["threads"].default


@dataclass(slots=True, eq=False)
class _Req:
    req: Request
    submit: float
    prefix_blocks: list[tuple[int, str]] = field(default_factory=list)
    hbm_tokens: int = 0
    hbm_tail: int = 0  # of hbm_tokens, those past the last whole block (engine_block_tokens)
    ext_tokens: int = 0
    ext_bytes_by_tier: dict[str, float] = field(default_factory=dict)
    fetched_at: float | None = None  # when a read of its KV into DRAM was last issued (None: never)
    reads: list[tuple[str, Transfer, list[int]]] = field(default_factory=list)  # storage reads: tier, transfer, blocks
    recomputed_slower: int = 0  # hit tokens the rule recomputed, as the connector decided when it reached it
    kv_ready: float = 0.0
    offset: int = 0
    remaining: int = 0
    left_out: int = 0
    reserved: int = 0
    pool_held: tuple[list[int], int] = ([], 0)  # engine_block_pool: cached block ids held, other tokens held
    first_token: float = float("nan")
    done: float = float("nan")


class _Driver:
    """Decides when requests are submitted: open loop by `arrival_s`, or a closed loop of sessions."""

    def __init__(self, requests: Sequence[Request], concurrency: int | None):
        self.sessions: dict[int, list[Request]] = {}
        for r in sorted(requests, key=lambda r: (r.arrival_s, r.session_id, r.turn)):
            self.sessions.setdefault(r.session_id, []).append(r)
        for turns in self.sessions.values():
            turns.sort(key=lambda r: r.turn)
        self.order = deque(self.sessions)
        self.concurrency = concurrency

    def initial(self) -> list[tuple[float, Request]]:
        if self.concurrency is None:
            return [(turns[0].arrival_s, turns[0]) for turns in self.sessions.values()]
        first = [self.order.popleft() for _ in range(min(self.concurrency, len(self.order)))]
        return [(0.0, self.sessions[s][0]) for s in first]

    def after(self, req: Request, now: float) -> tuple[float, Request] | None:
        """The submission that follows `req` completing at `now`, if any."""
        turns = self.sessions[req.session_id]
        if req.turn + 1 < len(turns) and turns[req.turn + 1].turn == req.turn + 1:
            nxt = turns[req.turn + 1]
            base = nxt.arrival_s if self.concurrency is None else 0.0
            return max(base, now + nxt.think_s), nxt
        if self.concurrency is not None and self.order:
            return now, self.sessions[self.order.popleft()][0]
        return None


class Simulator:
    """One engine instance fed by a workload under one policy. Call `run()` once."""

    def __init__(self, config: SimConfig, requests: Sequence[Request]):
        self.cfg = config
        self.dep = config.deployment
        self.kv_per_token = self.dep.model.kv_bytes_per_token
        self.block_bytes = config.block_tokens * self.kv_per_token  # one simulator block's KV
        self.tiers = config.tiers if config.policy.uses_external else ()
        self.caches = {t.name: BlockCache(t.capacity_blocks) for t in self.tiers}
        self.pipes = {t.name: Pipe(t.bandwidth(config.io_depth), t.latency_s) for t in self.tiers[1:]}
        self.host = Pipe(self.dep.accelerator.host_link_bw * self.dep.tp)
        hbm_blocks = config.hbm_cache_blocks
        if hbm_blocks is None:
            hbm_blocks = self.dep.kv_capacity_tokens // config.block_tokens
        self.pool = None
        if config.engine_block_pool:
            self.pool = BlockPool(hbm_blocks * config.block_tokens, config.block_tokens)
        self.hbm = self.pool if self.pool is not None else BlockCache(hbm_blocks)  # what lookups find in the engine
        for name, ids in config.preload.items():
            if name in self.caches:
                for b in ids:
                    self.caches[name].insert(b)
        self.driver = _Driver(requests, config.concurrency)
        self.n_requests = len(requests)
        self.arrivals: list = []
        self.seq = itertools.count()
        self.now = 0.0
        self.waiting: deque[_Req] = deque()
        self.loading: list[_Req] = []
        self.prefilling: list[_Req] = []
        self.decoding: list[_Req] = []
        self.decode_ctx = 0.0
        self.reserved = 0  # KV tokens of running requests (without engine_block_pool)
        self.finished: list[_Req] = []
        self.tokens_from: dict[str, int] = {"computed": 0, "hbm": 0} | {t.name: 0 for t in self.tiers}
        self.stall_s = 0.0
        self.recomputed_slower = 0  # tier hits the load-or-recompute rule recomputed (the connector's counter)
        self.steps = 0
        self._recompute_cost: dict[tuple[int, int], float] = {}
        self.step_floor = 0.0  # when the running step's in-step loads land (0: none)
        self.last_step = (0, 0.0)  # requests in the last step and its length ((0, 0): the engine idled since)
        self.copies_beside: list[tuple[float, float]] = []  # (done at, seconds) of copies beside the steps (SERIAL)
        self._early: dict[int, _Req] = {}
        self.saved_bytes = 0.0  # blocks written to the tiers after prefill
        self.session_prompt: dict[int, int] = {}  # each session's last prefilled prompt length
        self.io_charged = 0.0  # bytes moved whose CPU time the steps have already paid (io_cpu_s_per_byte)

    # ---- arrivals and the cache lookup ------------------------------------------------------------
    def _push(self, t: float, req: Request) -> None:
        """Submitted at t; the engine adds it on its next pass between steps (`_add`)."""
        heapq.heappush(self.arrivals, (t, next(self.seq), req))

    def _lookup(self, st: _Req) -> None:
        """Longest prefix of the prompt's blocks found in HBM or any tier, block by block. Whether the external
        hits are worth loading is decided later, when the scheduler reaches the request (`_reach`)."""
        size = self.cfg.block_tokens
        st.prefix_blocks.clear()
        for b in self._usable_blocks(st.req):
            if b in self.hbm:
                st.prefix_blocks.append((b, "hbm"))
                continue
            where = next((t.name for t in self.tiers if b in self.caches[t.name]), None)
            if where is None:
                break
            st.prefix_blocks.append((b, where))
        n_hbm = 0
        while n_hbm < len(st.prefix_blocks) and st.prefix_blocks[n_hbm][1] == "hbm":
            n_hbm += 1
        st.hbm_tokens = n_hbm * size
        st.ext_tokens = (len(st.prefix_blocks) - n_hbm) * size
        st.ext_bytes_by_tier = self._bytes_by_tier(st.prefix_blocks[n_hbm:])
        st.hbm_tail = self._cached_tail(st, n_hbm)
        st.hbm_tokens += st.hbm_tail

    def _cached_tail(self, st: _Req, n_hbm: int) -> int:
        """The engine caches a session's previous prompt to its own (smaller) block size: when every whole block
        of that prompt is an engine hit and nothing follows from the tiers, its tail past them is a hit too."""
        eb = self.cfg.engine_block_tokens
        prev = self.session_prompt.get(st.req.session_id)
        if not eb or not prev or not n_hbm or st.ext_tokens or n_hbm != prev // self.cfg.block_tokens:
            return 0
        return max(0, min((prev // eb) * eb, st.req.input_len - 1) - n_hbm * self.cfg.block_tokens)

    def _add(self, t: float, req: Request) -> None:
        """The engine adds a request submitted at t, one at a time between its steps (vLLM's engine core drains
        its input queue, then steps), which costs it `request_overhead_s` of its own time. The lookup and the
        prefetch start once the request is added. So a burst is reached only when all of it has been added, and
        by then the first requests' prefetches may have landed: they load inside the step and cache what the
        rest of the burst shares (a system prompt), as on the engine."""
        self.now = max(self.now, t) + self.cfg.request_overhead_s
        st = self._early.pop(id(req), None)  # session-aware: fetched since the previous turn ended
        if st is None:
            st = self._prepare(self.now, req)
        st.submit = t
        self.waiting.append(st)

    def _prepare(self, t: float, req: Request) -> _Req:
        st = _Req(req, submit=t)
        self._lookup(st)
        if self.cfg.queue_aware_eviction and self.tiers:
            self.caches[self.tiers[0].name].pin(b for b, _ in st.prefix_blocks)
        if self.cfg.policy.fetches_early and st.ext_tokens:
            self._fetch_to_dram(st, t, ahead=True)
        return st

    def _maybe_recompute(self, st: _Req) -> None:
        """The connector's load-or-recompute rule (`kvprefetch.loadplan.best_prefix`) when the scheduler reaches a
        request, on the simulator's own costs: the load takes until its KV is in DRAM (a prefetch in flight:
        what it has left; blocks still in storage: behind every read queued on their tier) plus the copy into
        HBM; recomputing is the prefill of the same tokens on an idle engine (the connector's measured prefill
        speed). The simulator weighs a request's external hit as one unit, loaded or recomputed whole, where the
        connector may split it at a chunk boundary."""
        ready = max(self.now, self._in_dram_at(st) or self.now)
        for name, nbytes in st.ext_bytes_by_tier.items():
            if name in self.pipes:
                ready = max(ready, self.pipes[name].estimate(self.now, nbytes))
        load = ready - self.now + sum(st.ext_bytes_by_tier.values()) / self.host.bw
        key = (st.ext_tokens, st.hbm_tokens)
        if key not in self._recompute_cost:
            self._recompute_cost[key] = self.dep.prefill_time(st.ext_tokens, st.hbm_tokens)
        if best_prefix([load], [self._recompute_cost[key]]) == 0:
            st.recomputed_slower = st.ext_tokens
            self._cancel_reads(st)
            st.ext_tokens, st.ext_bytes_by_tier = 0, {}
            st.prefix_blocks = [p for p in st.prefix_blocks if p[1] == "hbm"]

    def _fetch_to_dram(self, st: _Req, t: float, ahead: bool = False) -> None:
        """Read the request's storage hits into DRAM. A read `ahead` of admission (prefetch), under queue-aware
        eviction, takes only the blocks DRAM can hold without evicting the queue's KV: as in the store's DRAM
        pool, a read that finds no free slot is skipped, and the request reads the rest when it is admitted."""
        blocks = [(b, where) for b, where in st.prefix_blocks if where != "hbm"]
        dram = self.caches[self.tiers[0].name] if self.tiers else None
        if dram is not None and ahead and self.cfg.queue_aware_eviction:
            room, kept = dram.room(), []
            for b, where in blocks:  # a prefix of the request's KV: what comes after a block left out is no use
                if where != self.tiers[0].name:
                    if room <= 0:
                        break
                    room -= 1
                kept.append((b, where))
            blocks = kept
        for name in self.pipes:
            ids = [b for b, where in blocks if where == name]
            if ids:
                st.reads.append((name, self.pipes[name].reserve(t, len(ids) * self.block_bytes), ids))
        st.fetched_at = t
        if dram is not None:
            for b, _ in blocks:
                dram.insert(b)

    def _cancel_reads(self, st: _Req) -> None:
        """The connector recomputes the request: its reads not done yet stop, and what they would have brought
        into DRAM never arrives."""
        dram = self.caches[self.tiers[0].name]
        for name, t, ids in st.reads:
            kept = self.pipes[name].cancel(t, self.now)
            for b in ids[int(kept // self.block_bytes) :]:
                dram.discard(b)
        st.reads.clear()

    def _in_dram_at(self, st: _Req) -> float | None:
        """When the request's fetched KV is all in DRAM: its storage reads' ends, which move up when a read ahead
        of them is cancelled (None: never fetched)."""
        if st.fetched_at is None:
            return None
        return max([st.fetched_at, *(self.pipes[name].done_at(t) for name, t, _ in st.reads)])

    def _bytes_by_tier(self, blocks: Iterable[tuple[int, str]]) -> dict[str, float]:
        """KV bytes of (block, where) pairs, summed by where they are."""
        out: dict[str, float] = {}
        for _, where in blocks:
            out[where] = out.get(where, 0.0) + self.block_bytes
        return out

    # ---- admission and steps ----------------------------------------------------------------------
    def _reach(self, st: _Req) -> None:
        """The scheduler reaches the request: it looks the engine's cache up again, as vLLM does (engine hits
        evicted since its arrival now come from a tier or are computed, blocks cached since are hits), and the
        connector decides whether the external hits load or are recomputed (`load_vs_recompute`). Only what
        is not in DRAM yet (what prefetch has not already moved) is read from storage now."""
        self._lookup(st)
        st.recomputed_slower = 0
        if self.cfg.load_vs_recompute and st.ext_tokens:
            self._maybe_recompute(st)
        if st.fetched_at is not None and st.ext_tokens:
            self._fetch_to_dram(st, self.now)

    def _admit(self, st: _Req) -> None:
        req = st.req
        if self.cfg.queue_aware_eviction and self.tiers:
            self.caches[self.tiers[0].name].unpin(b for b, _ in st.prefix_blocks)
        self._reach(st)
        self.recomputed_slower += st.recomputed_slower
        if st.ext_tokens and st.fetched_at is None:
            self._fetch_to_dram(st, self.now)
        ext = sum(st.ext_bytes_by_tier.values())
        in_dram_at = self._in_dram_at(st)
        in_dram = in_dram_at is not None and in_dram_at <= self.now
        in_step = self.cfg.sync_loads_in_step and (
            self.cfg.policy is Policy.ONDEMAND_SYNC or in_dram or self._in_step(in_dram_at)
        )
        if in_step:
            landed = self.host.transfer(max(self.now, in_dram_at or 0.0), ext) if ext else self.now
            self.stall_s += max(0.0, landed - max(self.now, self.step_floor))
            self.step_floor = max(self.step_floor, landed)
            st.kv_ready = self.now  # computed in this very step, which waits for the load
        elif self.cfg.policy is Policy.ONDEMAND_SYNC:
            st.kv_ready = max(st.kv_ready, self.now)  # loaded while it held the queue head
        else:
            st.kv_ready = self.host.transfer(max(self.now, in_dram_at or 0.0), ext) if ext else self.now
            if ext and self.cfg.step_loads is StepLoads.SERIAL:
                self.copies_beside.append((st.kv_ready, ext / self.host.bw))
        st.offset = st.hbm_tokens + st.ext_tokens
        st.remaining = req.input_len - st.offset
        if self.pool is not None:
            hits = (st.hbm_tokens - st.hbm_tail) // self.cfg.block_tokens  # the leading blocks found in the engine
            loading = st.kv_ready > self.now  # its blocks are cached when its KV has arrived (`_plan`)
            st.pool_held = self.pool.take(list(self._full_blocks(req)), hits, self._footprint(req), not loading)
        else:
            st.reserved = req.input_len + req.output_len
            self.reserved += st.reserved
        self.tokens_from["computed"] += st.remaining
        self.tokens_from["hbm"] += st.hbm_tail
        for b, where in st.prefix_blocks:
            self.tokens_from[where] += self.cfg.block_tokens
            if where == "hbm" and self.pool is None:
                self.hbm.touch(b)

    def _in_step(self, in_dram_at: float | None) -> bool:
        """Whether a request whose reads land in DRAM at `in_dram_at` (still running) is served inside this step
        (`late_loads`)."""
        if self.cfg.late_loads != "auto":
            return self.cfg.late_loads == "sync"
        reads_s = max(0.0, (in_dram_at or self.now) - self.now)
        return finish_in_step(reads_s, *self.last_step)

    def _can_admit(self, st: _Req) -> bool:
        running = len(self.prefilling) + len(self.decoding) + len(self.loading)
        if running >= self.dep.max_seqs:
            return False
        if self.pool is not None:
            hits = st.req.hash_ids[: self.pool.cached_prefix(self._usable_blocks(st.req))]
            return self.pool.can_take(hits, self._footprint(st.req)) or running == 0
        need = st.req.input_len + st.req.output_len
        return self.reserved + need <= self.dep.kv_capacity_tokens or running == 0

    def _footprint(self, req: Request) -> int:
        """Engine KV tokens a request holds: prompt and answer, in whole engine blocks."""
        eb = self.cfg.engine_block_tokens or self.cfg.block_tokens
        return -(-(req.input_len + req.output_len) // eb) * eb

    def _full_blocks(self, req: Request) -> tuple[int, ...]:
        return req.hash_ids[: req.input_len // self.cfg.block_tokens]

    def _usable_blocks(self, req: Request) -> tuple[int, ...]:
        """The prompt's blocks a cache hit may cover: the last token is always computed (it gives the logits)."""
        return req.hash_ids[: (req.input_len - 1) // self.cfg.block_tokens]

    def _plan(self) -> list[tuple[_Req, int]]:
        budget = self.dep.token_budget - len(self.decoding)
        plan: list[tuple[_Req, int]] = []
        still = []
        for st in self.loading:
            if st.kv_ready <= self.now:
                self.prefilling.append(st)
                if self.pool is not None:
                    st.pool_held = self.pool.cache_prompt(st.pool_held, list(self._full_blocks(st.req)))
            else:
                still.append(st)
        self.loading = still
        for st in self.prefilling:
            if budget <= 0:
                break
            n = min(st.remaining, budget)
            plan.append((st, n))
            budget -= n
        while budget > 0 and self.waiting and self._can_admit(self.waiting[0]):
            head = self.waiting[0]
            serial_sync = self.cfg.policy is Policy.ONDEMAND_SYNC and not self.cfg.sync_loads_in_step
            if serial_sync and head.fetched_at is None:
                self._reach(head)
                if head.ext_tokens:
                    self._start_sync_load(head)  # the scheduler reaches it: its load starts now
            if serial_sync and head.kv_ready > self.now:
                break  # FCFS: nothing behind a loading head is admitted
            st = self.waiting.popleft()
            self._admit(st)
            if st.kv_ready > self.now:
                self.loading.append(st)
                continue
            self.prefilling.append(st)
            n = min(st.remaining, budget)
            plan.append((st, n))
            budget -= n
            if serial_sync and st.ext_tokens:
                break  # the next request is reached on the scheduler's next pass, after this step
        return plan

    def _start_sync_load(self, st: _Req) -> None:
        """On-demand load of the queue head: storage -> DRAM -> HBM, one request at a time."""
        self._fetch_to_dram(st, self.now)
        ext = sum(st.ext_bytes_by_tier.values())
        st.kv_ready = self.host.transfer(max(self.now, self._in_dram_at(st) or 0.0), ext)
        self.stall_s += st.kv_ready - self.now

    def _finish(self, st: _Req) -> None:
        st.done = self.now
        self.reserved -= st.reserved
        if self.pool is not None:
            self.pool.release(*st.pool_held)
        self.finished.append(st)
        nxt = self.driver.after(st.req, self.now)
        if nxt is not None:
            t, req = nxt
            if self.cfg.policy is Policy.SESSION and req.session_id == st.req.session_id:
                self._announce(req, t)
            else:
                self._push(t, req)

    def _announce(self, req: Request, t: float) -> None:
        """Session-aware prefetch: the next turn's KV starts moving now, the request itself arrives at t."""
        self._early[id(req)] = self._prepare(self.now, req)
        self._push(t, req)

    def _store(self, st: _Req) -> None:
        """After prefill the prompt's full blocks are in HBM and written through to every tier."""
        full = st.req.input_len // self.cfg.block_tokens
        self.session_prompt[st.req.session_id] = st.req.input_len
        for b in st.req.hash_ids[:full]:
            if self.pool is None:  # the pool cached them when it admitted the request
                self.hbm.insert(b)
            for cache in self.caches.values():
                if b not in cache:
                    self.saved_bytes += self.block_bytes
                cache.insert(b)

    def _bytes_moved(self) -> float:
        """Bytes moved so far whose CPU the steps pay (`io_cpu_s_per_byte`)."""
        loads = self.host.bytes_moved if self.cfg.io_cpu_on_loads else 0.0
        return loads + sum(p.bytes_moved for p in self.pipes.values()) + self.saved_bytes

    def _io_delay(self) -> float:
        """CPU time of the copies and I/O issued since the last step, which this step pays (io_cpu_s_per_byte)."""
        if not self.cfg.io_cpu_s_per_byte:
            return 0.0
        moved = self._bytes_moved()
        delay = (moved - self.io_charged) * self.cfg.io_cpu_s_per_byte
        self.io_charged = moved
        return delay

    def _copy_delay(self) -> float:
        """`StepLoads.SERIAL`: the copies into the engine of loads beside the steps (parked requests') take the
        model's time as in-step ones do; a step pays those that finished before it started."""
        done = [c for c in self.copies_beside if c[0] <= self.now]
        if not done:
            return 0.0
        self.copies_beside = [c for c in self.copies_beside if c[0] > self.now]
        return sum(seconds for _, seconds in done)

    def _step(self, plan: list[tuple[_Req, int]]) -> None:
        chunks = [(st.offset, n) for st, n in plan]
        step = self.dep.step_time(chunks, len(self.decoding), self.decode_ctx) + self._io_delay() + self._copy_delay()
        if self.cfg.step_loads is StepLoads.SERIAL:
            self.now += max(0.0, self.step_floor - self.now) + step
        else:
            self.now = max(self.now + step, self.step_floor)
        self.step_floor = 0.0
        self.last_step = (len(plan) + len(self.decoding), step)
        self.steps += 1
        self._advance_decodes(1)
        for st, n in plan:
            st.offset += n
            st.remaining -= n
            if st.remaining == 0:
                self.prefilling.remove(st)
                st.first_token = self.now
                self._store(st)
                st.left_out = st.req.output_len - 1
                if st.left_out <= 0:
                    self._finish(st)
                else:
                    self.decoding.append(st)
                    self.decode_ctx += st.req.input_len + 1

    def _advance_decodes(self, k: int) -> None:
        if not self.decoding:
            return
        self.decode_ctx += k * len(self.decoding)
        keep = []
        for st in self.decoding:
            st.left_out -= k
            if st.left_out <= 0:
                self.decode_ctx -= st.req.input_len + st.req.output_len
                self._finish(st)
            else:
                keep.append(st)
        self.decoding = keep

    def _next_event(self) -> float:
        times = [self.arrivals[0][0]] if self.arrivals else []
        times += [st.kv_ready for st in self.loading]
        if self.waiting and self.waiting[0].kv_ready > self.now:
            times.append(self.waiting[0].kv_ready)  # a sync load at the queue head lands
        return min(times, default=float("inf"))

    def _fast_forward(self) -> None:
        """Decode-only stretch: run up to the next completion or external event in one vectorized go."""
        n = len(self.decoding)
        k = min(st.left_out for st in self.decoding)
        times = np.cumsum(self.dep.decode_steps(n, self.decode_ctx, k))
        horizon = self._next_event() - self.now
        if np.isfinite(horizon):
            k = min(k, int(np.searchsorted(times, horizon)) + 1)
        self.now += float(times[k - 1]) + self._io_delay() + self._copy_delay()
        self.last_step = (n, float(times[k - 1] - (times[k - 2] if k > 1 else 0.0)))
        self.steps += k
        self._advance_decodes(k)

    def run(self) -> SimResult:
        for t, req in self.driver.initial():
            self._push(t, req)
        while len(self.finished) < self.n_requests:
            while self.arrivals and self.arrivals[0][0] <= self.now:
                t, _, req = heapq.heappop(self.arrivals)
                self._add(t, req)
            plan = self._plan()
            if plan:
                self._step(plan)
            elif self.decoding:
                self._fast_forward()
            else:
                nxt = self._next_event()
                if not np.isfinite(nxt):
                    raise RuntimeError("simulation stalled with requests left")
                self.io_charged = self._bytes_moved()  # the copies ran while the engine idled
                self.now = max(self.now, nxt)
                self.last_step = (0, 0.0)
        return self._result()

    def tier_contents(self) -> dict[str, list[int]]:
        """Each tier's blocks, least recently used first: a run preloaded with them starts where this one ended."""
        return {name: list(cache.blocks) for name, cache in self.caches.items()}

    def _result(self) -> SimResult:
        done = sorted(self.finished, key=lambda s: s.submit)
        bytes_read = {name: p.bytes_moved for name, p in self.pipes.items()} | {"host": self.host.bytes_moved}
        return SimResult(
            submit=np.array([s.submit for s in done]),
            first_token=np.array([s.first_token for s in done]),
            done=np.array([s.done for s in done]),
            input_len=np.array([s.req.input_len for s in done]),
            output_len=np.array([s.req.output_len for s in done]),
            tokens_from=dict(self.tokens_from),
            bytes_read=bytes_read,
            stall_s=self.stall_s,
            recomputed_slower_tokens=self.recomputed_slower,
            steps=self.steps,
        )


def simulate(config: SimConfig, requests: Sequence[Request]) -> SimResult:
    """Run one simulation."""
    return Simulator(config, requests).run()
