"""Scheduler-side half of the connector: lookup, prefetch on arrival, the load plan, save bookkeeping.

Runs in vLLM's scheduler (engine-core) process, where requests arrive. Every tensor-parallel rank holds its own
part of a chunk (its KV heads) under keys of its own (`ChunkKeyer.rank_keyers`): the scheduler keys, looks up,
prefetches and holds every rank's chunks, and a chunk is a hit only if every rank has it. (MLA's KV is the same on
every rank: one part, rank 0's, serves them all, ``replicated``.) A chunk holds every KV cache group of a hybrid
model; which of a group's blocks a load writes and a save takes is `kvprefetch.vllm.groups`'.

The life of a request is a small state machine (`Phase`)::

    ARRIVED ──disk hits, prefetch on──> PREFETCHING          (on_new_request: reads start while it queues)
       │                                     │
       └──────── the scheduler reaches it ───┘               (get_num_new_matched_tokens -> `_decide`: a plan)
                         │
                  vLLM admits it                             (update_state_after_alloc -> `_commit`: the plan
                         │                                    takes effect)
            nothing worth loading ──> RECOMPUTED             (miss, or the load-or-recompute rule says so)
                         │
                      LOADING                                (the job goes to the workers)
                         │
          sync: the step ran / async: the workers report it finished
                         │                                   (or past its bound, released: `_release_late_loads`)
                       DONE

    any phase ──request finished──> FINISHED   (prefetch reads cancelled, an async load told to stop)

Reaching a request only decides (`_Plan`); nothing changes until vLLM admits the request on that plan. vLLM may
ask again first (it skips a request whose blocks do not fit, and asks again next step), and a request preempted
and back is asked again from DONE or RECOMPUTED: each ask decides afresh, and only the plan vLLM admits the
request on takes effect (its phase, its load, the reads it drops, the counts). While a request is ARRIVED,
PREFETCHING or LOADING its chunks that are in DRAM are *held* there (`DramHolds`: one pin per chunk and request,
one budget: half the DRAM tier), so that the requests ahead of it and their saves do not evict them before it is
served; leaving those phases releases them.

What happens when the scheduler reaches a request whose chunks are not all in DRAM (its prefetch is late, was
evicted, or never ran) is decided in one place: `SchedulerSide.serve_late`. A step with nothing to run while
requests are parked waits for their next read to land, and a step whose in-step loads join reads still in flight
waits for those reads before the workers start it (`SchedulerSide._wait_for_reads`): vLLM's engine core spins
while the workers run a step, on the core the reads need.

Saves are orthogonal to the phases: ``build_connector_meta`` saves every whole chunk a step completes (prompt
and generated tokens) of a request whose saves are admitted (``save_policy``, `kvprefetch.vllm.admission`: each
request's leading chunk is counted in a frequency sketch as it arrives, and its verdict is decided once, the first
time it has a whole chunk to save), and ``request_finished`` holds the blocks (True) only while a save may still
read them.

A cache layer must never stop an engine (issue 59). A request is parked (answered "asynchronous") at most once per
admission: vLLM asks again about a parked request only when its load failed, and it then keeps the request among
its in-flight prefills, whose reservation counts the request's own blocks: parking it again would need room for
them twice (`_unpark_cause`). And no request waits for KV longer than its bound (`_wait_bound_s`: twice what
computing the prefix would take, within a few seconds): a parked load still unfinished then is released to the
engine to compute (`_release_late_loads`), and a request answered "wait" that vLLM does not admit while it runs
nothing else is answered again without parking; both are counted (``stalls_released``) and logged once per episode.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from enum import StrEnum
from typing import TYPE_CHECKING, Any

from kvprefetch.episodes import EpisodeLog
from kvprefetch.keys import ChunkKeyer
from kvprefetch.tiers.chunk_format import image_bytes
from kvprefetch.vllm.admission import SeenSketch, dram_only, save_verdict, save_wish
from kvprefetch.vllm.costmodel import CostModel, TierMeter
from kvprefetch.vllm.groups import KVGroups
from kvprefetch.vllm.identity import UNTIERED_REASONS, Identity, Untiered, request_identity
from kvprefetch.vllm.leases import Lease, Leases
from kvprefetch.vllm.metadata import KVPrefetchMetadata, KVPrefetchWorkerMeta, LoadJob, SaveJob
from kvprefetch.vllm.metrics import (
    ConnectorCounters,
    RankCounters,
    hit_counter,
    saves_skipped_counter,
    untiered_counter,
)
from kvprefetch.vllm.settings import ConnectorSettings, LoadMode
from kvprefetch.vllm.store_api import ReadHandle, SchedulerStore
from kvprefetch.vllm.timeline import timeline

if TYPE_CHECKING:
    from kvprefetch.vllm.events import TierEvents

log = logging.getLogger("kvprefetch.vllm")
_DRAM = "dram"  # `Tier.DRAM`'s value (a StrEnum: equal to it), without importing the store here
PROBE_CHUNKS = 4  # chunks a disk probe reads: the disk meter's sample (`TierMeter.sample_ops`)
JOIN_WAIT_PRIOR_S = 0.5  # the longest wait for a save in flight until the prefill rate is measured
# Longest an empty step waits, blocked, for a parked request's next read to land (`SchedulerSide._wait_parked`):
# a request that arrives meanwhile is scheduled at most this much later.
PARKED_WAIT_S = 0.05
# The bound on a request's wait for KV (`SchedulerSide._wait_bound_s`): STALL_FACTOR times what computing the prefix
# it waits for would take at the measured prefill rate, never less than STALL_MIN_S (a load that is only slow on a
# busy host is not cut short: releasing it costs a recompute and vLLM's recovery) nor more than STALL_MAX_S.
STALL_FACTOR = 2.0
STALL_MIN_S = 2.0
STALL_MAX_S = 5.0


class Phase(StrEnum):
    ARRIVED = "arrived"  # keyed; nothing of it is being read
    PREFETCHING = "prefetching"  # its hits below DRAM are being read into DRAM while it waits in the queue
    LOADING = "loading"  # the load job went to the workers (sync: this step; async: until they report it)
    DONE = "done"  # loaded; computes the rest itself
    RECOMPUTED = "recomputed"  # nothing (more) to load: computes its whole prompt
    FINISHED = "finished"  # vLLM finished it; forgotten


_HOLDING = frozenset({Phase.ARRIVED, Phase.PREFETCHING, Phase.LOADING})


@dataclass(frozen=True)
class _Rule:
    """The load-or-recompute rule's answer for one request (`SchedulerSide._weigh`)."""

    load_chunks: int  # the leading chunks worth loading
    skipped_slower: int = 0  # chunks after them recomputed because reading them is slower
    weighed: bool = False  # False: load_policy always loads the whole hit without weighing it


@dataclass(frozen=True)
class _Plan:
    """What reaching the request decided (`SchedulerSide._decide`), kept until vLLM admits the request
    (`update_state_after_alloc`). When it ``loads``, chunks [first, load) are loaded (chunks < first are on the
    engine already); else the request recomputes. The fields after ``tiers`` are what the decision implies
    beyond vLLM's answer, done once vLLM admits the request (`SchedulerSide._commit`)."""

    first: int
    load: int
    is_async: bool = False
    below_dram: int = 0  # chunks of [first, load) below DRAM on some rank
    tiers: tuple[str, ...] = ()  # each chunk of [0, load)'s tier when planned (vLLM's hit-source split)
    hit: _Hit | None = None  # the lookup it was decided on (None: nothing to look up)
    first_reach: bool = False  # the scheduler reached the request for the first time: count the reach
    weighed: bool = False  # the rule weighed the hit: chunks [load, hit) are recomputed, their reads dropped
    skipped_slower: int = 0  # ... this many of them because reading them is slower (a disk probe may follow)
    finished_in_step: bool = False  # load_mode auto finishes its reads inside the step
    unparked: str | None = None  # why it loads only what DRAM holds instead of parking (`_unpark_cause`)

    @property
    def loads(self) -> bool:
        return self.load > self.first


@dataclass(frozen=True)
class _Hit:
    """A lookup across every rank: chunk i is a hit only if every rank has it."""

    tiers: list[Sequence[str]]  # tiers[rank][i] for the leading hit chunks (same length on every rank)

    @property
    def num_chunks(self) -> int:
        return len(self.tiers[0])

    def in_dram(self, i: int) -> bool:
        return all(t[i] == _DRAM for t in self.tiers)

    def below_dram(self, first: int, end: int) -> int:
        return sum(1 for i in range(first, end) if not self.in_dram(i))

    def on_disk(self) -> list[bool]:
        return [not self.in_dram(i) for i in range(self.num_chunks)]

    def tier(self, i: int) -> str:
        """Where chunk i comes from: DRAM if every rank has it there, else the first other tier a rank names."""
        if self.in_dram(i):
            return _DRAM
        return next(str(getattr(t[i], "value", t[i])) for t in self.tiers if t[i] != _DRAM)


@dataclass
class _Req:
    req_id: str
    request: Any
    arrival_seq: int
    phase: Phase = Phase.ARRIVED
    keys: list[list[bytes]] = field(default_factory=list)  # keys[rank][i]
    prefetch: ReadHandle | None = None  # reads into DRAM (from arrival, or from reaching it, prefetch off)
    plan: _Plan | None = None  # reached: the plan vLLM was answered, until it admits the request on it
    load: LoadJob | None = None  # LOADING, async: the job the workers have
    load_settled: bool = False  # ... and whether they were told its reads are over
    holds: set[bytes] = field(default_factory=set)  # chunks pinned in DRAM for it (`DramHolds`)
    hit_tokens: dict[str, int] = field(default_factory=dict)  # the last load's tokens per tier
    skipped_slower: int = 0  # chunks counted as recomputed because reading them was slower (each once)
    step_reads: int = 0  # chunks its in-step (sync) load reads from below DRAM, none of them in flight already
    saved_chunks: int = 0  # leading chunks known to be in the store (loaded, present or saved), or skipped
    seen_before: bool = False  # its leading chunk had been seen (or warmed) before it arrived (`_sight`) ...
    lead_stored: bool = False  # ... or was in the store then (saved by another engine: the sketch is this process's)
    save_decided: bool = False  # whether its saves are admitted was decided (`_admit_saves`) ...
    save_skip: str | None = None  # ... and if not, why (`admission.SKIP_REASONS`)
    saves_inflight: set[int] = field(default_factory=set)
    join_until: float | None = None  # (clock) how long it waits for a save of its next chunk still in flight
    # What its KV depends on beyond its tokens (`identity`), established when it first has a whole chunk;
    # `Untiered`: served without the tiers (never keyed, looked up, loaded nor saved)
    identity: Identity | Untiered | None = None
    extras: list[bytes] = field(default_factory=list)  # per chunk keyed: its identity's digest (`ChunkKeyer.keys`)
    # The wait for KV (`_wait_bound_s`). Answered "wait" (parked) and not admitted since: from when (clock) ...
    wait_since: float | None = None
    parked_at: float | None = None  # ... admitted, its async load running: since when (clock)
    released: bool = False  # ... the load ran past its bound and the workers were told to give it up
    # vLLM's count of the request's preemptions when it admitted the request's last async load (None: none yet)
    parked_preemptions: int | None = None

    def chunk_keys(self, first: int, end: int) -> list[list[bytes]]:
        return [k[first:end] for k in self.keys]

    def flat_keys(self, first: int, end: int) -> list[bytes]:
        """Every rank's keys of chunks [first, end), chunk by chunk (so reads go in the request's order)."""
        return [k[i] for i in range(first, end) for k in self.keys]


class DramHolds:
    """The one way the scheduler keeps chunks in DRAM for a request until it is served, under one budget.

    A held chunk is pinned once per request (`SchedulerStore.pin`, released by `unpin`); at most ``budget`` chunks
    are held at once (half the DRAM tier: holding more would leave no room for the reads and saves themselves).
    Holds are taken as prefetched chunks land (on an I/O thread) and when a load is planned, only while the
    request is in a holding phase; `set_phase` leaves those phases and drops the holds atomically with respect
    to a landing chunk.
    """

    def __init__(self, store: SchedulerStore, budget: int):
        self.store = store
        self.budget = budget
        self.held = 0
        self._lock = threading.Lock()

    def hold(self, st: _Req, keys: Sequence[bytes]) -> None:
        with self._lock:
            if st.phase not in _HOLDING:
                return
            keys = [k for k in dict.fromkeys(keys) if k not in st.holds][: max(0, self.budget - self.held)]
            if not keys:
                return
            for key, ok in zip(keys, self.store.pin(keys), strict=True):
                if ok:
                    st.holds.add(key)
                    self.held += 1

    def set_phase(self, st: _Req, phase: Phase) -> None:
        with self._lock:
            st.phase = phase
            if phase in _HOLDING or not st.holds:
                return
            keys, st.holds = list(st.holds), set()
            self.held -= len(keys)
        self.store.unpin(keys)


class SchedulerSide:
    def __init__(
        self,
        settings: ConnectorSettings,
        keyer: ChunkKeyer,
        store: SchedulerStore,
        block_size: int,
        blocks_per_chunk: int,
        chunk_bytes: int,
        counters: ConnectorCounters,
        get_block_ids: Callable[[str], Sequence[int] | Sequence[Sequence[int]]] | None = None,
        clock: Callable[[], float] = time.monotonic,
        events: TierEvents | None = None,
        groups: KVGroups | None = None,
        replicated: bool = False,
    ):
        """``keyer``: any rank's keyer (every rank's is derived from it); ``chunk_bytes``: one rank's part of a
        chunk (what one key holds: every group's layers); ``events``: the KV events' notes of every chunk keyed
        (``--kv-events-config``); ``groups``: the model's KV cache groups (None: one full-attention group), whose
        block ids ``get_block_ids`` and vLLM's allocations give, one list per group; ``replicated``: every rank holds
        the same KV (MLA): one part per chunk, under ``keyer``'s (rank 0's) keys, for every rank."""
        self.settings = settings
        self.keyers = [keyer] if replicated else keyer.rank_keyers()
        self.tp_size = len(self.keyers)  # parts of a chunk (each under keys of its own), and savers reporting each
        self.store = store
        self.block_size = block_size
        self.blocks_per_chunk = blocks_per_chunk
        self.chunk_tokens = keyer.chunk_tokens
        self.chunk_bytes = chunk_bytes
        self.counters = counters
        self.rank_counters = RankCounters(keyer.namespace.tp_size)
        self.get_block_ids = get_block_ids
        self.groups = groups if groups is not None else KVGroups.single((), block_size)
        self.clock = clock
        # The rule weighs a whole chunk: every rank's part comes up through the same disk.
        self.cost = CostModel(
            chunk_bytes * self.tp_size,
            self.chunk_tokens,
            disk_bps=settings.disk_bps_prior or float(settings.store.io.read_rate_limit_bps or 1e9),
            prefill_tps=settings.prefill_tps_prior,
            margin=settings.load_margin,
            clock=clock,
        )
        self._next_probe = 0.0  # (clock) the earliest time of the next disk probe (`_probe_disk`)
        self.reqs: dict[str, _Req] = {}
        self._new_loads: list[LoadJob] = []
        self._sync_planned: list[_Req] = []  # sync loads planned for the step being scheduled
        self._sync_running: list[_Req] = []  # sync loads of the last step built (running, or run)
        self._await_saves: list[str] = []
        self._save_owner: dict[int, tuple[str, int]] = {}  # job id -> (req id, workers done)
        self._next_job = 1
        self._seq = 0
        self._cancel_loads: list[str] = []
        self._last_step_tokens = 0
        # Requests the last step ran and that have not finished since: those a read inside the next step would
        # stall (the last step's count alone would still include a request that just finished, on an engine that
        # is now idle)
        self._running: set[str] = set()
        # Throughput of the reads this process drives (prefetches); the workers report their own demand reads.
        self.disk_meter = TierMeter(self.cost.observe_disk, clock=clock)
        dram = int(settings.store.dram.capacity_bytes)
        self.holds = DramHolds(store, dram // max(chunk_bytes, 1) // 2)
        slots = dram // image_bytes(chunk_bytes)  # (a slot holds a chunk's image: its payload and header)
        self.leases = Leases(store, int(slots * settings.lease_budget_share), counters.inc, clock)
        self._saving: dict[bytes, float] = {}  # keys of save jobs in flight -> (clock) until when to wait for them
        self._save_keys: dict[int, list[bytes]] = {}  # save job id -> its keys (every rank's)
        self._landed = threading.Condition()  # notified as each read of `_start_reads` lands (`_wait_parked`)
        self._landings = 0
        self.timeline = timeline()
        self.events = events
        self._idle_since: float | None = None  # (clock) since when the steps built have computed nothing
        self._episodes = EpisodeLog(log)
        self.seen = SeenSketch()  # leading chunks seen lately (save_policy probation and seen; `_sight`, `warm`)

    # ---- keys and lookup ------------------------------------------------------------------------------------
    def _keys(self, st: _Req, num_tokens: int) -> int:
        """Key the request's whole chunks in num_tokens (for every rank, under its identity); return how many
        there are (0 for a request served without the tiers: it has no keys)."""
        n = num_tokens // self.chunk_tokens
        if not n or not self._identify(st):
            return 0
        if not st.keys or len(st.keys[0]) < n:
            tokens = list(st.request.all_token_ids[: n * self.chunk_tokens])
            assert isinstance(st.identity, Identity)
            if not st.identity.plain and len(st.extras) < n:
                st.extras += st.identity.chunk_extras(len(st.extras), n, self.chunk_tokens)
            extras = st.extras if st.extras else None
            st.keys = [k.keys(tokens, extras=extras) for k in self.keyers]
            if self.events is not None:
                self.events.note(st.request, st.keys, n)
        return n

    def _identify(self, st: _Req) -> bool:
        """Establish the request's identity (`identity.request_identity`) the first time it has a whole chunk;
        False if it is served without the tiers (counted, and logged once per episode of its reason)."""
        if st.identity is None:
            st.identity = request_identity(st.request, self.block_size)
            if isinstance(st.identity, Untiered):
                why = st.identity
                self.counters.inc(untiered_counter(why.reason))
                self._episodes.warn(
                    "untiered:" + why.reason, "kvprefetch: request %s served without the tiers: %s (%s); counted in "
                    "vllm:kvprefetch_untiered_requests_total{reason=%r} (one line per episode)",
                    st.req_id, UNTIERED_REASONS.get(why.reason, why.reason), why.detail, why.reason,
                )  # fmt: skip
                self.timeline.event("untiered", st.req_id, reason=st.identity.reason)
        return isinstance(st.identity, Identity)

    def _lookup(self, st: _Req, n: int) -> _Hit:
        return self._hit([keys[:n] for keys in st.keys])

    def _hit(self, keys: list[list[bytes]]) -> _Hit:
        """Look every rank's keys up: the leading chunks every rank has."""
        tiers = [self.store.lookup(rank_keys).tiers for rank_keys in keys]
        end = min(len(t) for t in tiers)
        return _Hit([t[:end] for t in tiers])

    def _state(self, request: Any) -> _Req:
        st = self.reqs.get(request.request_id)
        if st is None:
            self._seq += 1
            st = self.reqs[request.request_id] = _Req(request.request_id, request, self._seq)
        return st

    # ---- arrival --------------------------------------------------------------------------------------------
    def on_new_request(self, request: Any) -> None:
        st = self._state(request)
        self.leases.expire()
        self._sight(st)
        if not self.settings.prefetch or self.settings.load_policy == "never":
            return
        n = self._keys(st, request.num_prompt_tokens)
        if not n:
            return
        hit = self._lookup(st, n)
        self.timeline.event("arrived", st.req_id, hit=hit.num_chunks, below=hit.below_dram(0, hit.num_chunks))
        # What is in DRAM already is held there too, or the requests ahead of it may evict it before it is served.
        m = hit.num_chunks
        self.holds.hold(st, [st.keys[r][i] for r in range(self.tp_size) for i in range(m) if hit.tiers[r][i] == _DRAM])
        if hit.below_dram(0, m):
            for r, tiers in enumerate(hit.tiers):
                self.rank_counters.inc(r, "prefetched_chunks", sum(1 for t in tiers if t != _DRAM))
            self._start_reads(st, st.flat_keys(0, m))
            self.holds.set_phase(st, Phase.PREFETCHING)
        self.leases.release_within(set(st.flat_keys(0, m)))  # the turn a lease kept them for is here

    def _sight(self, st: _Req) -> None:
        """Count the arriving request's leading chunk in the sketch (save_policy probation and seen) and remember
        whether it had been seen before, or is stored: the first half of its save verdict (`_admit_saves`). Once
        per request, at arrival: vLLM asks about a request many times, but it arrives once."""
        if self.settings.save_policy == "all" or not self.settings.save:
            return
        if self._keys(st, st.request.num_prompt_tokens):
            lead = st.keys[0][0]
            st.seen_before = self.seen.record(lead) > 0
            st.lead_stored = bool(self.store.lookup([lead]).tiers)

    def _start_reads(self, st: _Req, keys: list[bytes]) -> None:
        """Read keys' chunks below DRAM into DRAM now; each is held for the request as it lands."""
        handle = st.prefetch = self.store.prefetch(keys)
        self.counters.inc("prefetched_chunks", handle.num_reads)
        self.disk_meter.started(handle.num_reads)
        self.timeline.event("reads", st.req_id, n=handle.num_reads, queued=self.disk_meter.outstanding)

        def landed(key: bytes, ok: bool) -> None:  # (I/O thread)
            self.disk_meter.completed(ok, self.chunk_bytes)
            self.timeline.event("landed", st.req_id, ok=ok, left=handle.pending())
            if ok:
                self.holds.hold(st, [key])
            with self._landed:
                self._landings += 1
                self._landed.notify_all()

        handle.on_ready(landed)

    def _reads_in_flight(self, st: _Req) -> bool:
        return st.prefetch is not None and st.prefetch.num_reads > 0

    def _queued_disk_bytes(self, st: _Req) -> int:
        """Reads queued in front of this request's: other requests' unfinished reads that arrived earlier
        (prefetch is served in arrival order); with no read of its own in flight, every outstanding read. Either
        way also the reads of the in-step loads already planned for the step being scheduled: the workers start
        them with the step, and this request's reads would queue behind them (without them, every request of a
        burst was weighed against an idle disk, and a sync engine loaded them all where recomputing was faster)."""
        in_step = sum(o.step_reads for o in self._sync_planned if o is not st) * self.cost.chunk_bytes
        if st.prefetch is None or not st.prefetch.pending():
            return self.disk_meter.outstanding * self.chunk_bytes + in_step
        n = sum(
            other.prefetch.pending()
            for other in self.reqs.values()
            if other is not st and other.prefetch is not None and other.arrival_seq < st.arrival_seq
        )
        return n * self.chunk_bytes + in_step

    # ---- reaching the request: decide (no effects), then commit once vLLM admits it --------------------------
    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int) -> tuple[int | None, bool]:
        """vLLM reached the waiting request: how many of its next tokens will be loaded, and whether
        asynchronously. The answer is a `_Plan` (`_decide`) and has no effect on the store or the counters:
        vLLM may ask again before it admits the request (it skips one whose blocks do not fit, or that waits
        for something else, and asks again next step), and it hands the decision back only once the blocks are
        allocated (`update_state_after_alloc`), which is where the plan is carried out (`_commit`).

        Two effects stay here, by necessity. Joining a save in flight (`_joins_save`): its answer, None, makes
        vLLM skip the request without calling back, so the wait's deadline (and its count) is set the first
        time vLLM asks; every later ask is measured against it. And the start of a wait to be admitted: a request
        answered "wait" (asynchronous) that vLLM does not admit is asked again every step, and the watchdog
        measures that wait from the first such answer (`_unpark_cause`).
        """
        st = self._state(request)
        st.plan = None
        if self.settings.load_policy == "never":
            return 0, False
        # At least one token must be computed to produce logits: never hit the whole sequence.
        n = self._keys(st, max(st.request.num_tokens - 1, 0))
        hit = self._lookup(st, n) if n else None
        if hit is not None and self._joins_save(st, hit, n):
            return None, False  # vLLM asks again next step
        plan = st.plan = self._decide(st, hit, num_computed_tokens)
        if plan.loads and plan.is_async:
            st.wait_since = self.clock() if st.wait_since is None else st.wait_since
        elif plan.unparked is None:  # (a request the watchdog unparked still waits until vLLM admits it)
            st.wait_since = None
        if self.timeline:
            self.timeline.event("reached", st.req_id, phase=str(st.phase), computed=num_computed_tokens,
                                plan=[plan.first, plan.load, plan.is_async, plan.below_dram] if plan.loads else None,
                                skipped=plan.skipped_slower, disk_bps=self.cost.disk_bps.value,
                                tps=self.cost.prefill_tps.value, outstanding=self.disk_meter.outstanding)  # fmt: skip
        if not plan.loads:
            return 0, False
        return plan.load * self.chunk_tokens - num_computed_tokens, plan.is_async

    def _joins_save(self, st: _Req, hit: _Hit, n: int) -> bool:
        """Turn N+1 never misses turn N's save: when the chunk right after the request's hit is still being
        saved (a save job of ours in flight, or a slot being written in the node's pool by any process), the
        request waits for that write instead of recomputing what is about to land. (A turn that follows its
        predecessor at once finds that turn's last chunks still in the workers' save queue: a plain lookup reads
        them as a miss.) Never longer than recomputing that chunk and the hit before it would take (`_join_wait_s`),
        so a save that never lands costs at most what recomputing costs anyway."""
        i = hit.num_chunks
        now = self.clock()
        if i >= n or not any(now < self._saving.get(k[i], -1.0) or self.store.writing(k[i]) for k in st.keys):
            st.join_until = None
            return False
        if st.join_until is None:
            st.join_until = now + self._join_wait_s(i + 1)
            self.counters.inc("joined_saves")
        return now < st.join_until

    def _join_wait_s(self, chunks: int) -> float:
        tps = self.cost.prefill_tps.value
        recompute_s = chunks * self.chunk_tokens / tps if tps else JOIN_WAIT_PRIOR_S
        return min(recompute_s, self.settings.store.io.join_timeout_s)

    def _decide(self, st: _Req, hit: _Hit | None, num_computed_tokens: int) -> _Plan:
        """What to load now that the scheduler reached the request (`_Plan.loads` False: it recomputes).
        Reads the store's state and the cost model; changes neither."""
        first = num_computed_tokens // self.chunk_tokens  # chunks fully on the engine already
        if hit is None:
            return _Plan(first, 0)
        first_reach = st.phase in (Phase.ARRIVED, Phase.PREFETCHING)
        if hit.num_chunks <= first:
            return _Plan(first, 0, hit=hit, first_reach=first_reach)
        unparked = None
        if hit.below_dram(first, hit.num_chunks):
            rule, is_async = self.serve_late(st, hit, first)
            unparked = self._unpark_cause(st, hit) if is_async else None
            if unparked is not None:  # what DRAM holds, in the step; the rest is computed, its reads dropped
                rule, is_async = _Rule(_in_dram_until(hit, first), weighed=True), False
        else:
            rule, is_async = self._weigh(st, hit, first, async_s=None), False
        if self.groups.hybrid:
            rule, is_async = self._between_steps(rule, unparked)
        k = rule.load_chunks
        below = hit.below_dram(first, k)
        in_step = self.settings.load_mode == "auto" and below > 0 and not is_async  # auto chose the step
        return _Plan(first, k, is_async, below, tuple(hit.tier(i) for i in range(k)), hit, first_reach,
                     rule.weighed, rule.skipped_slower, in_step, unparked)  # fmt: skip

    @staticmethod
    def _between_steps(rule: _Rule, unparked: str | None) -> tuple[_Rule, bool]:
        """A model with several KV cache groups loads only between steps (asynchronously), DRAM hits too: vLLM
        takes a failed load of such a model only as a failed request (``failed_recving``, which it recomputes), not
        as failed blocks inside a step (it cannot map a block id back to its group), so a load inside the step
        could not fail safely. One the watchdog would not park again (`_unpark_cause`) recomputes instead."""
        if unparked is not None:
            return _Rule(0, weighed=True), False
        return rule, rule.load_chunks > 0

    def _unpark_cause(self, st: _Req, hit: _Hit) -> str | None:
        """Why a request the rule would park must not be (None: it may be parked).

        ``reasked``: vLLM admitted the request's last async load and asks about it again without having preempted
        it since: that load failed at its first block (or was released, `_release_late_loads`), and vLLM keeps the
        request among its in-flight prefills, whose reservation (the blocks each still needs to finish) an async
        admission must leave free. Parked again, the request needs its own blocks twice over; where they do not
        fit (a prompt over half the free KV), vLLM skips it every step, and at the head of its queue of requests
        holding KV, nothing behind it runs either (issue 59: four sessions got no token for two minutes, vLLM
        logging "KV fetch: 2 waiting to start"). It also asks about a hit that just failed: the chunk the workers
        found damaged (and removed) may still be in this process's disk index, or read from a tier that failed
        again.

        ``stalled`` (the watchdog, for a cause not known here): answered "wait" and not admitted for longer than
        its bound (`_wait_bound_s`) while the engine computed nothing: vLLM is not merely short of blocks that a
        running request will free.
        """
        if st.parked_preemptions is not None and st.parked_preemptions == _preemptions(st.request):
            return "reasked"
        if st.wait_since is not None and self._idle_since is not None:
            waited = self.clock() - max(st.wait_since, self._idle_since)
            if waited > self._wait_bound_s(hit.num_chunks * self.chunk_tokens):
                return "stalled"
        return None

    def _wait_bound_s(self, tokens: int) -> float:
        """The longest a request waits for the KV of `tokens` tokens: `STALL_FACTOR` times what computing them
        would take at the prefill rate the load-or-recompute rule uses (the most, until it is measured), within
        [`STALL_MIN_S`, `STALL_MAX_S`]."""
        tps = self.cost.prefill_tps.value
        bound = STALL_FACTOR * tokens / tps if tps else STALL_MAX_S
        return min(max(bound, STALL_MIN_S), STALL_MAX_S)

    def _stall_released(self, st: _Req, cause: str, waited_s: float) -> None:
        """Count and log (once per episode of the cause) a request that stopped waiting for KV to compute."""
        self.counters.inc("stalls_released")
        self.timeline.event("stall_released", st.req_id, cause=cause, waited=round(waited_s, 3))
        self._episodes.warn(
            "stall:" + cause, "kvprefetch: a request waited %.1f s for its KV (%s); it computes its prefix instead "
            "(vllm:kvprefetch_stalls_released; one line per episode)", waited_s, cause,
        )  # fmt: skip

    def serve_late(self, st: _Req, hit: _Hit, first: int) -> tuple[_Rule, bool]:
        """What happens to a request whose hit is not all in DRAM when the scheduler reaches it: its prefetch is
        still in flight (late), its chunks were evicted again, or nothing read them yet (prefetch off).

        Returns (the rule's answer: the chunks to have after the load, parked?).
        The load-or-recompute rule first weighs the reads still to come (every rank's bytes, behind the reads
        queued ahead of this request's) against recomputing; reads of chunks it will recompute are dropped once
        vLLM admits the request (`_commit`). Then the request is either *parked* (asynchronous: vLLM's
        WAITING_FOR_REMOTE_KVS, the other requests run, the workers copy each chunk as it lands;
        `update_state_after_alloc` starts the reads if none are in flight) or its remaining reads are *finished
        inside this step* (synchronous: the workers read them, the whole batch waits). ``load_mode`` decides:
        ``async`` parks, ``sync`` finishes in the step, and ``auto`` asks the cost model which costs the batch
        less (`CostModel.finish_in_step`, the queue ahead of its reads included).
        """
        mode: LoadMode = self.settings.load_mode
        step_s = self.cost.expected_step_s(self._last_step_tokens)
        rule = self._weigh(st, hit, first, async_s=None if mode == "sync" else step_s)
        below = hit.below_dram(first, rule.load_chunks)
        if not below:
            return rule, False
        if mode != "auto":
            return rule, mode == "async"
        # (the queue as vLLM's ask finds it: this request's own drops and probe wait for it to be admitted)
        remaining = below * self.cost.chunk_bytes + self._queued_disk_bytes(st)  # (cost.chunk_bytes: every rank's)
        return rule, not self.cost.finish_in_step(remaining, len(self._running), step_s)

    def _weigh(self, st: _Req, hit: _Hit, first: int, async_s: float | None) -> _Rule:
        """The load-or-recompute rule (`CostModel.plan`): the leading chunks worth loading."""
        if self.settings.load_policy == "always":
            return _Rule(hit.num_chunks)
        plan = self.cost.plan(hit.on_disk(), first, self._queued_disk_bytes(st), async_s)
        return _Rule(plan.load_chunks, plan.skipped_slower, weighed=True)

    def _commit(self, st: _Req, plan: _Plan) -> None:
        """vLLM admitted the request on the plan: what deciding it implies, done once. The first reach is counted
        (was the prefetch late or in time?); the chunks the rule recomputes because the disk looked slower are
        counted (each chunk once, however often vLLM asked) and may start a disk probe (`_probe_disk`); reads of
        every chunk it recomputes are dropped; load_mode auto's choice of the step is counted."""
        hit = plan.hit
        if hit is None:
            return
        if plan.first_reach:
            self._count_reach(st, hit)
        if plan.weighed:
            if plan.skipped_slower > st.skipped_slower:
                self.counters.inc("recomputed_slower_chunks", plan.skipped_slower - st.skipped_slower)
                st.skipped_slower = plan.skipped_slower
            if plan.skipped_slower:
                self._probe_disk(st, hit, plan.load)
            if plan.load < hit.num_chunks and st.prefetch is not None:  # reads of chunks it recomputes are wasted
                dropped = st.prefetch.cancel(st.flat_keys(plan.load, hit.num_chunks))
                if dropped:
                    self.counters.inc("prefetch_cancelled_chunks", dropped)
        if plan.finished_in_step:
            self.counters.inc("finished_in_step")
        if plan.unparked == "reasked":
            self.counters.inc("reasked_unparked")
            self.timeline.event("unparked", st.req_id, cause=plan.unparked)
        elif plan.unparked == "stalled" and st.wait_since is not None:
            self._stall_released(st, "not admitted while the engine computed nothing", self.clock() - st.wait_since)

    def _probe_disk(self, st: _Req, hit: _Hit, k: int) -> None:
        """The rule recomputes chunks [k, ...) of this hit: if some are on disk and the disk rate is stale, read
        the first `PROBE_CHUNKS` of them in the background (`SchedulerStore.measure_reads`: into scratch memory, not
        DRAM, where they would keep this request's own saves of them out until the slow reads end), so the disk
        meter samples the disk again.

        Recomputing reads nothing, so without this a slow moment, or a pessimistic `disk_bps_prior`, would keep
        the rule recomputing forever after the disk became fast (measured: on-demand modes recomputed every hit
        in a bench regime sweep once the first, slowest regime had set the estimate). At most one probe per
        `disk_probe_interval_s`; the request itself does not wait for it.
        """
        interval = self.settings.disk_probe_interval_s
        now = self.clock()
        if interval <= 0 or now < self._next_probe or not self.cost.disk_rate_older_than(interval):
            return
        chunks = [c for c in range(k, hit.num_chunks) if not hit.in_dram(c)][:PROBE_CHUNKS]
        if not chunks:
            return
        self._next_probe = now + interval
        handle = self.store.measure_reads([key for c in chunks for key in st.flat_keys(c, c + 1)])
        self.counters.inc("disk_probe_chunks", len(chunks))
        self.disk_meter.started(handle.num_reads)
        handle.on_ready(lambda _key, ok: self.disk_meter.completed(ok, self.chunk_bytes))

    def _count_reach(self, st: _Req, hit: _Hit) -> None:
        for r, tiers in enumerate(hit.tiers):
            self.rank_counters.inc(r, "reached_hit_chunks", len(tiers))
            self.rank_counters.inc(r, "reached_in_dram_chunks", sum(1 for t in tiers if t == _DRAM))
        if not self._reads_in_flight(st):
            return
        assert st.prefetch is not None
        if st.prefetch.pending():
            self.counters.inc("prefetch_late")
            return
        self.counters.inc("prefetch_in_time")
        if hit.below_dram(0, hit.num_chunks):  # DRAM too small for what is queued: the reads were wasted
            self.counters.inc("prefetch_evicted")

    def update_state_after_alloc(
        self, request: Any, block_ids: Sequence[int] | Sequence[Sequence[int]], num_external_tokens: int
    ) -> None:
        """vLLM admitted the request: its blocks are allocated. Carry out the plan it was answered
        (`get_num_new_matched_tokens`): first what deciding it implies (`_commit`), then its load, which vLLM may
        have declined (``num_external_tokens`` 0: e.g. its own prefix cache covers as much); else it recomputes."""
        st = self._state(request)
        plan, st.plan = st.plan, None
        if plan is None:
            return  # not reached (load_policy never), or vLLM asks nothing of a request it resumes
        self._commit(st, plan)
        st.wait_since = None  # admitted
        if not plan.loads or num_external_tokens <= 0:
            self.holds.set_phase(st, Phase.RECOMPUTED)
            return
        self.holds.set_phase(st, Phase.LOADING)  # (a holding phase: its chunks are held from here on)
        k = plan.load
        start_tok = k * self.chunk_tokens - num_external_tokens  # the engine's own (block-aligned) prefix hit ends here
        first = start_tok // self.chunk_tokens
        st.hit_tokens = {}
        for c in range(first, k):  # the first chunk may be partly in the engine's own prefix cache already
            n = (c + 1) * self.chunk_tokens - max(c * self.chunk_tokens, start_tok)
            st.hit_tokens[plan.tiers[c]] = st.hit_tokens.get(plan.tiers[c], 0) + n
        for tier, n in st.hit_tokens.items():
            self.counters.inc(hit_counter(tier), n)
        tables, end = self.groups.tables(block_ids), k * self.chunk_tokens
        per_chunk = [self.groups.load_ids(tables, c, self.blocks_per_chunk, start_tok, end) for c in range(first, k)]
        job = LoadJob(request.request_id, st.chunk_keys(first, k), per_chunk, plan.is_async,
                      on_disk=plan.below_dram)  # fmt: skip
        self.holds.hold(st, st.flat_keys(first, k))
        self.leases.release_within(set(st.flat_keys(0, k)))
        st.saved_chunks = max(st.saved_chunks, k)
        self.counters.inc("loaded_chunks", k - first)
        if plan.below_dram and not self._reads_in_flight(st):
            self.counters.inc("demand_reads", 1)
            if plan.is_async:  # prefetch off (or nothing in flight): the reads start now that the scheduler is here
                for r in range(self.tp_size):
                    self.rank_counters.inc(r, "prefetched_chunks", plan.below_dram)
                self._start_reads(st, st.flat_keys(first, k))
        # (sync mode: the worker reads what is still below DRAM inside the step, joining reads in flight)
        self.timeline.event("alloc", st.req_id, ext=num_external_tokens, chunks=k - first,
                            in_flight=self._reads_in_flight(st))  # fmt: skip
        if plan.is_async:
            job.awaits_prefetch = self._reads_in_flight(st)
            st.load = job
            st.load_settled = not job.awaits_prefetch
            st.parked_at, st.released = self.clock(), False
            st.parked_preemptions = _preemptions(request)  # (`_unpark_cause`)
        else:
            st.step_reads = 0 if self._reads_in_flight(st) else plan.below_dram
            self._sync_planned.append(st)
        self._new_loads.append(job)

    # ---- each step ------------------------------------------------------------------------------------------
    def build_connector_meta(self, scheduler_output: Any) -> KVPrefetchMetadata:
        self._wait_for_reads(scheduler_output)
        # Last step's synchronous loads have run: their holds can go. Those planned since run in this step.
        for st in self._sync_running:
            if st.phase is Phase.LOADING:
                self.holds.set_phase(st, Phase.DONE)
        self._sync_running, self._sync_planned = self._sync_planned, []
        self.leases.expire()
        self._forget_stale_saves()
        meta = KVPrefetchMetadata(loads=self._new_loads)
        self._new_loads = []
        # Async loads whose reads (here) have all finished: the worker stops waiting for their chunks.
        for st in self.reqs.values():
            if st.load is not None and not st.load_settled and (st.prefetch is None or not st.prefetch.pending()):
                st.load_settled = True
                meta.settled.append(st.req_id)
                self.timeline.event("settled", st.req_id)
        meta.cancel_loads, self._cancel_loads = self._cancel_loads, []
        self._release_late_loads(meta)
        if self.settings.save:
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
        self._running = set(getattr(scheduler_output, "num_scheduled_tokens", None) or ())
        if meta.step_tokens:
            self._idle_since = None
        elif self._idle_since is None:
            self._idle_since = self.clock()
        return meta

    def _release_late_loads(self, meta: KVPrefetchMetadata) -> None:
        """The watchdog on parked loads: one the workers have not reported finished within its bound
        (`_wait_bound_s` of the chunks it loads) is released: the workers report it finished now, what they had not
        copied as load errors, and vLLM computes that (the request is then never parked again: `_unpark_cause`).
        Whatever held it up (a read that does not return, a job queued behind one, a read that never settles), it
        slows the request by its bound and never stops it. Its reads still queued here are dropped."""
        now = self.clock()
        for st in self.reqs.values():
            if st.load is None or st.released or st.parked_at is None:
                continue
            waited = now - st.parked_at
            if waited <= self._wait_bound_s(st.load.num_chunks * self.chunk_tokens):
                continue
            st.released = True
            meta.release_loads.append(st.req_id)
            if st.prefetch is not None and st.prefetch.pending():
                n = st.prefetch.cancel()
                if n:
                    self.counters.inc("prefetch_cancelled_chunks", n)
            self._stall_released(st, "parked, its load unfinished", waited)

    def _wait_for_reads(self, step: Any) -> None:
        """Wait here, blocked, for the reads the step about to go to the workers would wait for while vLLM's
        engine core spins (`_wait_parked` says why that spin stalls them): those of its in-step loads that joined
        reads in flight in this process (a late prefetch finished in the step), until they have landed (at most
        ``io.join_timeout_s``, as long as a worker waits for another process's read); else, on a step with nothing
        in it, the next read of a parked request (`_wait_parked`). The batch waits as long as it would have inside
        the step (the forward waits for every staged chunk before its first layer), but the engine core sleeps.
        """
        in_step = [st for st in self._sync_planned if self._reads_pending(st)]
        if in_step:
            with self._landed:
                self._landed.wait_for(lambda: not any(self._reads_pending(st) for st in in_step),
                                      timeout=self.settings.store.io.join_timeout_s)  # fmt: skip
            return
        self._wait_parked(step)

    def _wait_parked(self, step: Any) -> None:
        """A step with nothing in it while requests are parked on their reads: wait here, blocked, until the
        next read lands (at most `PARKED_WAIT_S`), rather than return an empty step at once.

        vLLM steps again at once after an empty step, and its engine core waits for the workers' reply to each
        step by spinning (`sched_yield`, for a second after the last reply), so with only parked requests it
        spun on its core until their reads were done. That is the host core the connector's reads run on: the
        spin took it from the kernel's worker that dispatches throttled reads (issue 48: reads stalled for
        tens of seconds, `workqueue lockup` with `blk_throtl_dispatch_work_fn` pending) and from the I/O
        threads. Blocked here, the engine core sleeps until what the parked requests wait for has moved.
        """
        if int(getattr(step, "total_num_scheduled_tokens", 0) or 0) > 0 or self._new_loads or self._cancel_loads \
                or self._await_saves:
            return  # the step has work for the workers
        parked = [st for st in self.reqs.values() if st.load is not None]
        if not parked or any(not st.load_settled and not self._reads_pending(st) for st in parked):
            return  # nothing parked, or a load to settle in this step
        # (a settled load with no read here left is the workers': their copies, or reads of their own, which
        # this process does not see land; the wait then ends at the cap, and the workers report it next step)
        with self._landed:
            seen = self._landings
            self._landed.wait_for(lambda: self._landings != seen, timeout=PARKED_WAIT_S)

    @staticmethod
    def _reads_pending(st: _Req) -> bool:
        return st.prefetch is not None and st.prefetch.pending() > 0

    def _plan_saves(self, step: Any, meta: KVPrefetchMetadata) -> None:
        progress: list[tuple[str, int]] = []
        for nr in step.scheduled_new_reqs:
            progress.append((nr.req_id, nr.num_computed_tokens + step.num_scheduled_tokens.get(nr.req_id, 0)))
        cached = step.scheduled_cached_reqs
        for i, rid in enumerate(cached.req_ids):
            progress.append((rid, cached.num_computed_tokens[i] + step.num_scheduled_tokens.get(rid, 0)))
        for rid, done_tokens in progress:
            st = self.reqs.get(rid)
            if st is None:
                continue
            full = min(done_tokens, st.request.num_tokens) // self.chunk_tokens
            if full <= st.saved_chunks or not self._identify(st) or not self._admit_saves(st, full):
                continue  # nothing new, served without the tiers, or not worth saving
            write_back = st.save_skip is None  # (else in DRAM only: a prefix seen once, on probation)
            if not self._keys(st, full * self.chunk_tokens):
                continue
            # Chunks already in DRAM (on every rank) are skipped. Chunks only on disk that the engine computed
            # anyway (recomputed because the disk was too slow, or served by vLLM's own prefix cache) are put
            # again: into DRAM, where the next hit is cheap; the store does not write them to disk twice.
            tiers = [self.store.lookup(k[st.saved_chunks : full]).tiers for k in st.keys]
            present = 0
            while all(present < len(t) and t[present] == _DRAM for t in tiers):
                present += 1
            first = st.saved_chunks + present
            st.saved_chunks = full
            if first >= full or self.get_block_ids is None:
                continue
            tables, per = self.groups.tables(self.get_block_ids(rid)), self.blocks_per_chunk
            if any(len(t) < full * per for t in tables):
                continue
            chunks = [(c, ids) for c in range(first, full) if (ids := self.groups.save_ids(tables, c, per)) is not None]
            if len(chunks) < full - first:  # a window's tail already freed (`groups`): a hit there would lack it
                self.counters.inc("window_unsaved_chunks", full - first - len(chunks))
            if not chunks:
                continue
            job = SaveJob(
                self._next_job,
                rid,
                [[k[c] for c, _ in chunks] for k in st.keys],
                [ids for _, ids in chunks],
                write_back,
            )
            self._next_job += 1
            st.saves_inflight.add(job.job_id)
            self._save_owner[job.job_id] = (rid, 0)
            self._save_keys[job.job_id] = keys = [k for rank in job.keys for k in rank]
            until = self.clock() + self.settings.store.io.join_timeout_s  # (a save never reported: forgotten then)
            for key in keys:
                self._saving[key] = until
            meta.saves.append(job)
            self.counters.inc("saved_chunks", len(chunks))

    def _admit_saves(self, st: _Req, full: int) -> bool:
        """Whether the request's chunks are saved (`admission.save_verdict`: its kv_transfer_params, then
        save_policy and the signs of reuse: seen before or warmed, a lease on finish, a hit), into DRAM only
        where the verdict skips them and the policy is probation (`admission.dram_only`). Decided once, the first
        time it has a whole chunk to save, and kept (a prefix saved from its middle on is never reached).
        Chunks [saved_chunks, full) of a request whose verdict skips them are counted as skipped (not saved, or
        not written back), each once."""
        if not st.save_decided:
            st.save_decided = True
            leased = keep_warm_s(st.request, self.settings.keep_warm_s) > 0
            wish = save_wish(getattr(st.request, "kv_transfer_params", None))
            hit = st.lead_stored or st.saved_chunks > 0  # (before any save is planned, only a load sets it)
            st.save_skip = save_verdict(self.settings.save_policy, wish, seen_before=st.seen_before, leased=leased,
                                        hit=hit)  # fmt: skip
        if st.save_skip is None:
            return True
        self.counters.inc(saves_skipped_counter(st.save_skip), full - st.saved_chunks)
        if dram_only(self.settings.save_policy, st.save_skip):
            return True
        st.saved_chunks = full
        return False

    def update_connector_output(self, output: Any) -> None:
        worker_meta = getattr(output, "kv_connector_worker_meta", None)
        if isinstance(worker_meta, KVPrefetchWorkerMeta):
            for job_id, n in worker_meta.saves_done.items():
                owner = self._save_owner.get(job_id)
                if owner is None:
                    continue
                rid, done = owner[0], owner[1] + n
                if done >= self.tp_size:
                    del self._save_owner[job_id]
                    self._save_landed(job_id)
                    st = self.reqs.get(rid)
                    if st is not None:
                        st.saves_inflight.discard(job_id)
                else:
                    self._save_owner[job_id] = (rid, done)
            if worker_meta.load_bytes and worker_meta.load_seconds:
                self.cost.observe_copy(worker_meta.load_bytes, worker_meta.load_seconds)
            if worker_meta.step_tokens and worker_meta.forward_seconds:
                self.cost.observe_prefill(worker_meta.step_tokens, worker_meta.forward_seconds)
            if worker_meta.disk_bytes and worker_meta.disk_seconds:
                self.cost.observe_disk(worker_meta.disk_bytes, worker_meta.disk_seconds)
            self.rank_counters.merge(worker_meta.ranks)
            if worker_meta.saves_done:
                self.leases.retry_pins()  # leases on finish wait for their request's last saves
        for rid in getattr(output, "finished_recving", None) or ():
            st = self.reqs.get(rid)
            self.timeline.event("recv_done", rid)
            if st is not None and st.phase is Phase.LOADING:
                st.load, st.parked_at, st.released = None, None, False
                self.holds.set_phase(st, Phase.DONE)

    def reset(self) -> int | None:
        """vLLM's reset of the connector's cache (``POST /reset_prefix_cache?reset_external=true``; the cascade after
        a weight update): every lease ended, then every chunk this node's DRAM pool and disk tier hold dropped
        (`drop_local`: the shared tier is left, other nodes read it); how many. None, nothing done, while a request
        is known here: its reads and saves would land in what was just cleared (vLLM resets only an idle engine
        too)."""
        if self.reqs:
            return None
        self.leases.close()
        return self.store.drop_local()

    def wait_for_reads(self, timeout: float) -> bool:
        """Wait until every known request's reads into DRAM have finished (tests hold the engine with it, so
        that whether a prefetch lands before its request is reached is never a race); False on timeout."""
        deadline = time.monotonic() + timeout
        for st in list(self.reqs.values()):
            if st.prefetch is not None and not st.prefetch.wait(max(0.0, deadline - time.monotonic())):
                return False
        return True

    def hit_tokens(self, req_id: str) -> dict[str, int]:
        """The request's last planned load, in tokens per tier that held them (vLLM's hit-source split)."""
        st = self.reqs.get(req_id)
        return dict(st.hit_tokens) if st is not None else {}

    def cost_snapshot(self) -> dict[str, Any]:
        return self.cost.snapshot() | {"disk_outstanding": self.disk_meter.outstanding}

    # ---- the end --------------------------------------------------------------------------------------------
    def request_finished(self, request: Any) -> bool:
        self._running.discard(request.request_id)
        self.timeline.event("finished", request.request_id)
        st = self.reqs.pop(request.request_id, None)
        if st is None:
            return False
        self._lease_on_finish(st)
        loading_async = st.load is not None
        st.load = None
        self.holds.set_phase(st, Phase.FINISHED)
        if st.prefetch is not None and st.prefetch.pending():
            n = st.prefetch.cancel()
            if n:
                self.counters.inc("prefetch_cancelled_chunks", n)
        if loading_async:
            # The worker has the job; vLLM frees the blocks once the worker reports it finished: tell it to
            # stop copying.
            self._cancel_loads.append(st.req_id)
            return False
        if st.saves_inflight:
            self._await_saves.append(st.req_id)
            return True
        return False

    def _lease_on_finish(self, st: _Req) -> None:
        """Keep the finished request's chunks (prompt + answer: its session's likely next head) in DRAM for
        keep_warm_s; the chunks its last saves still write are pinned as those land (`update_connector_output`)."""
        keep = keep_warm_s(st.request, self.settings.keep_warm_s)
        if keep > 0 and st.saved_chunks > 0 and st.save_skip is None:
            self.leases.grant(f"finish-{st.req_id}", "finish", st.flat_keys(0, st.saved_chunks), keep, self.tp_size)

    def _forget_stale_saves(self, limit: int = 4096) -> None:
        """Saves never reported done (their worker died) stop being waited for at their time; forget them once
        there are many, so the table stays small."""
        if len(self._saving) > limit:
            now = self.clock()
            self._saving = {k: t for k, t in self._saving.items() if t > now}

    def _save_landed(self, job_id: int) -> None:
        for key in self._save_keys.pop(job_id, ()):
            self._saving.pop(key, None)

    # ---- warm-up: a client names the next turn's head before it arrives ---------------------------------------
    def warm(
        self, token_ids: Sequence[int], ttl_s: float, lease_id: str, identity: Identity | None = None
    ) -> WarmCounts:
        """Start the reads of the whole chunks of token_ids that are below DRAM (prefetch priority: demand reads
        go first) and lease every chunk of the hit for ttl_s; answers at once, without waiting for the reads.
        ``identity``: what the completion that follows will be keyed under (its adapter, cache salt): only its own
        chunks are counted, read and leased. (Thread-safe: the warm server calls it from its own thread.)"""
        self.leases.expire()
        self.counters.inc("warm_calls")
        n = len(token_ids) // self.chunk_tokens
        extras = identity.chunk_extras(0, n, self.chunk_tokens) if identity is not None and not identity.plain else None
        keys = [k.keys(list(token_ids[: n * self.chunk_tokens]), extras=extras) for k in self.keyers]
        if n and self.settings.save_policy != "all":
            self.seen.record(keys[0][0])  # a sighting: the request it warms for is the second (`_sight`)
        hit = self._hit(keys)
        m = hit.num_chunks
        flat = [k[i] for i in range(m) for k in keys]
        lease = self.leases.grant(lease_id, "warm", flat, ttl_s, self.tp_size)
        lease.reads = self.store.prefetch(lease.keys)  # (reads only what is below DRAM)
        if lease.reads.num_reads:
            self.counters.inc("warm_read_chunks", lease.reads.num_reads)
            lease.reads.on_ready(lambda key, ok: ok and self.leases.pin_landed(lease, key))
        counts = dict.fromkeys(("dram", "disk", "remote"), 0)
        for i in range(m):
            counts[hit.tier(i)] += 1
        return WarmCounts(lease_id, n, counts["dram"], counts["disk"], counts["remote"], n - m, len(lease.keys),
                          ttl_s)  # fmt: skip

    def warm_status(self, lease_id: str) -> WarmCounts | None:
        """The lease's chunks now: how many have reached DRAM (None: no such lease, or it ended)."""
        self.leases.expire()
        lease = self.leases.get(lease_id)
        if lease is None:
            return None
        return lease_counts(lease, self.tp_size, self.store, self.clock())

    def end_lease(self, lease_id: str) -> bool:
        return self.leases.end(lease_id)


def _in_dram_until(hit: _Hit, first: int) -> int:
    """The end of the run of chunks from `first` on that are in DRAM on every rank."""
    k = first
    while k < hit.num_chunks and hit.in_dram(k):
        k += 1
    return k


def _preemptions(request: Any) -> int:
    """How often vLLM has preempted the request (`Request.num_preemptions`)."""
    return int(getattr(request, "num_preemptions", 0) or 0)


@dataclass(frozen=True)
class WarmCounts:
    """A warm-up's answer, in chunks (a chunk counts in a tier when every rank's part is there)."""

    id: str
    chunks: int  # whole chunks in the named prefix
    in_dram: int
    on_disk: int
    remote: int
    missing: int  # chunks past the leading hit: nothing to warm
    leased_keys: int  # keys (chunks x ranks) the lease holds or will hold (cut to the lease budget)
    ttl_s: float

    def as_json(self) -> dict[str, Any]:
        return {"id": self.id, "chunks": self.chunks, "in_dram": self.in_dram, "on_disk": self.on_disk,
                "remote": self.remote, "missing": self.missing, "ttl_s": round(self.ttl_s, 3)}  # fmt: skip


def lease_counts(lease: Lease, tp_size: int, store: SchedulerStore, now: float) -> WarmCounts:
    """A lease's chunks where they are now (`warm_status`)."""
    keys = lease.keys
    chunks = len(keys) // max(tp_size, 1)
    in_dram = store.in_dram(keys)
    dram = sum(1 for c in range(chunks) if all(in_dram[c * tp_size : (c + 1) * tp_size]))
    return WarmCounts(lease.lease_id, chunks, dram, chunks - dram, 0, 0, len(keys), lease.remaining_s(now))


def keep_warm_s(request: Any, default: float) -> float:
    """The request's own keep_warm_s (``kv_transfer_params={"kvprefetch": {"keep_warm_s": N}}``), else the
    connector's; a value that is not a number >= 0 is ignored (a request is never failed for a hint)."""
    params = getattr(request, "kv_transfer_params", None) or {}
    own = params.get("kvprefetch") if isinstance(params, dict) else None
    value = own.get("keep_warm_s") if isinstance(own, dict) else None
    if isinstance(value, int | float) and not isinstance(value, bool) and 0 <= value <= 86400:
        return float(value)
    return default
