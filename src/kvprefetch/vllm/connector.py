"""`KVPrefetchConnector`: vLLM's KV connector API on top of kvprefetch's tiered store.

Enable it with::

    --kv-transfer-config '{"kv_connector": "KVPrefetchConnector", "kv_connector_module_path": "kvprefetch.vllm",
                           "kv_role": "kv_both", "kv_connector_extra_config": {}}'

vLLM builds one instance in the scheduler process (role SCHEDULER) and one per worker (role WORKER). Each opens
the same `TieredStore`: the DRAM tier is one named shared-memory pool per node and the disk tier a directory,
so both halves see one copy of every chunk. The scheduler half (`scheduler.py`) decides; the worker half
(`worker.py`) copies.
"""

from __future__ import annotations

import contextlib
import logging
import uuid
import weakref
from typing import TYPE_CHECKING, Any

from kvprefetch.vllm.compat import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    KVConnectorTransferResults,
    SupportsHMA,
    block_ids_of,
)
from kvprefetch.vllm.events import TierEvents
from kvprefetch.vllm.identity import Identity
from kvprefetch.vllm.metadata import KVPrefetchMetadata
from kvprefetch.vllm.metrics import ConnectorCounters, Reporter
from kvprefetch.vllm.scheduler import SchedulerSide, WarmCounts
from kvprefetch.vllm.spec import build_scheduler, build_worker, connector_spec, use_load_failure_policy
from kvprefetch.vllm.stats import KVPrefetchPromMetrics, KVPrefetchStats, StatsTracker, vllm_hit_sources
from kvprefetch.vllm.store_api import ConnectorStore
from kvprefetch.vllm.warm_api import WarmServer
from kvprefetch.vllm.worker import WorkerSide

if TYPE_CHECKING:
    import torch

log = logging.getLogger("kvprefetch.vllm")
_INSTANCES: weakref.WeakSet[KVPrefetchConnector] = weakref.WeakSet()


def live_connectors() -> list[KVPrefetchConnector]:
    """Connectors alive in this process (an in-process engine has a scheduler and a worker one)."""
    return list(_INSTANCES)


class KVPrefetchConnector(KVConnectorBase_V1, SupportsHMA):
    """Tiered KV cache with prefetch on arrival, layer-wise loads, async saves and a load-or-recompute rule.

    `SupportsHMA`: vLLM keeps its hybrid KV cache manager on with this connector, so a model with sliding-window
    layers keeps only their window's KV, and hands the connector every KV cache group's blocks (`groups`)."""

    # (Set by the half this process builds: the scheduler's are None in a worker, the worker's in the scheduler.)
    _sched: SchedulerSide | None = None
    _scheduler_store: ConnectorStore | None = None
    _warm_server: WarmServer | None = None
    _worker: WorkerSide | None = None
    _reporter: Reporter | None = None  # (the worker's starts with its store, in register_kv_caches)
    _events: TierEvents | None = None  # the tiers' KV events (scheduler side, with --kv-events-config)

    def __init__(self, vllm_config: Any, role: KVConnectorRole, kv_cache_config: Any = None):
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        self.spec = spec = connector_spec(vllm_config, role, kv_cache_config)
        _INSTANCES.add(self)
        use_load_failure_policy(self._kv_transfer_config, spec.settings)
        self.settings, self.geo, self.namespace, self.keyer = spec.settings, spec.geo, spec.namespace, spec.keyer
        self.block_size, self.rank = spec.block_size, spec.rank
        self.counters = ConnectorCounters("scheduler" if spec.is_scheduler else "worker")
        self._vllm_stats = StatsTracker(
            self.counters, lambda: self.store.io.stats.totals(), lambda: self.store.errors.totals()
        )
        self._closed_store = False
        if spec.is_scheduler:
            half = build_scheduler(spec, self.counters, self._block_ids)
            self._sched, self._scheduler_store, self._reporter, self._warm_server, self._events = half
        else:
            self._worker = build_worker(spec, self.counters, kv_cache_config)

    # ---- helpers --------------------------------------------------------------------------------------------
    def _block_ids(self, req_id: str) -> tuple[list[int], ...]:
        """The request's block ids, one list per KV cache group."""
        mgr = self._kv_cache_manager
        if mgr is None:
            return ()
        return tuple(list(ids) for ids in mgr.get_block_ids(req_id))

    # ==== worker side ============================================================================================
    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        assert self._worker is not None
        self._worker.register_kv_caches(kv_caches)
        assert self._worker.store is not None
        self._reporter = Reporter(
            self.counters, self._worker.store.stats, interval_s=self.settings.log_interval_s,
            metrics_dir=self.settings.metrics_dir, metrics_port=None, serve=False,
        )

    def bind_connector_metadata(self, connector_metadata: KVConnectorMetadata) -> None:
        super().bind_connector_metadata(connector_metadata)
        if self._worker is not None and isinstance(connector_metadata, KVPrefetchMetadata):
            self._worker.on_bind(connector_metadata)

    def handle_preemptions(self, kv_connector_metadata: KVConnectorMetadata) -> None:
        if self._worker is not None and isinstance(kv_connector_metadata, KVPrefetchMetadata):
            self._worker.handle_preemptions(kv_connector_metadata)

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        meta = self._get_connector_metadata()
        assert isinstance(meta, KVPrefetchMetadata) and self._worker is not None
        self._worker.start_load_kv(meta)

    def wait_for_layer_load(self, layer_name: str) -> None:
        if self._worker is not None:
            self._worker.wait_for_layer_load(layer_name)

    def save_kv_layer(self, layer_name: str, kv_layer: Any, attn_metadata: Any, **kwargs: Any) -> None:
        return  # whole chunks are saved after the forward (wait_for_save), off the critical path

    def wait_for_save(self) -> None:
        meta = self._get_connector_metadata()
        assert isinstance(meta, KVPrefetchMetadata) and self._worker is not None
        self._worker.wait_for_save(meta)
        if self._reporter is not None:
            self._reporter.tick()

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        if self._worker is None:
            return None, None
        return self._worker.get_finished(finished_req_ids)

    def get_transfer_results(self, finished_req_ids: set[str]) -> KVConnectorTransferResults:
        """`get_finished`, plus the async loads that failed as failed requests (`failed_recving`): how a model with
        several KV cache groups must report them (vLLM cannot map a failed block id back to its group); vLLM then
        computes the request's prompt itself."""
        sending, recving = self.get_finished(finished_req_ids)
        failed = self._worker.take_failed_loads() if self._worker is not None else set()
        return KVConnectorTransferResults(set(sending or ()), set(recving or ()), failed)

    def get_block_ids_with_load_errors(self) -> set[int]:
        return self._worker.get_block_ids_with_load_errors() if self._worker is not None else set()

    def build_connector_worker_meta(self):
        return self._worker.build_worker_meta() if self._worker is not None else None

    # ==== vLLM's own metrics (its /metrics and log line; see stats.py) ==========================================
    def get_kv_connector_stats(self) -> KVPrefetchStats | None:
        return self._vllm_stats.take() if self.store is not None and not self._closed_store else None

    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None) -> KVPrefetchStats:
        return KVPrefetchStats(data=dict(data or {}))

    @classmethod
    def build_prom_metrics(cls, vllm_config, metric_types, labelnames, per_engine_labelvalues) -> KVPrefetchPromMetrics:
        return KVPrefetchPromMetrics(vllm_config, metric_types, labelnames, per_engine_labelvalues)

    def take_events(self) -> list[Any]:
        """The tiers' KV events since the last step (`events`): vLLM publishes them with its own blocks'."""
        return self._events.take() if self._events is not None else []

    def get_external_cache_hit_sources(self, request: Any, num_external_tokens: int) -> dict:
        tokens = self._sched.hit_tokens(request.request_id) if self._sched is not None else {}
        return vllm_hit_sources(tokens, num_external_tokens)

    def shutdown(self) -> None:
        """vLLM's shutdown (also on SIGTERM): drain the write-back, then detach from the DRAM pool, which drops
        this process's pins there (otherwise only the next process to attach reaps them)."""
        if self._worker is not None:
            self._worker.shutdown()  # waits for its saves and the store's write-back
        if self._warm_server is not None:
            self._warm_server.close()
        if self._events is not None:
            self._events.close()
        if self._sched is not None:
            self._sched.leases.close()
        if self._reporter is not None:
            self._reporter.close()
        # Detach from the DRAM pool last (the reporter reads its stats): the last process to detach frees the
        # pool's RAM when dram.keep_idle_s says so; detaching drops this process's pins there.
        store, self._closed_store = (None if self._closed_store else self.store), True
        if store is not None:
            drained = store.flush(timeout=60)
            with contextlib.suppress(Exception):
                store.close()
            # (a warning when chunks were lost: vLLM's server shows kvprefetch's warnings, not its info lines)
            (log.info if drained else log.warning)(
                "kvprefetch: %s side shut down (write-back %s, DRAM pool detached)",
                self.counters.role, "drained" if drained else "NOT drained in 60 s: chunks only in DRAM",
            )  # fmt: skip

    @classmethod
    def requires_piecewise_for_cudagraph(cls, extra_config: dict[str, Any]) -> bool:
        return bool((extra_config or {}).get("layerwise", True))

    # ==== scheduler side =========================================================================================
    def on_new_request(self, request: Any) -> None:
        if self._sched is not None:
            self._sched.on_new_request(request)

    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int) -> tuple[int | None, bool]:
        assert self._sched is not None
        return self._sched.get_num_new_matched_tokens(request, num_computed_tokens)

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
        assert self._sched is not None
        ids = block_ids_of(blocks) if num_external_tokens > 0 else ()
        self._sched.update_state_after_alloc(request, ids, num_external_tokens)

    def build_connector_meta(self, scheduler_output: Any) -> KVConnectorMetadata:
        assert self._sched is not None
        meta = self._sched.build_connector_meta(scheduler_output)
        if self._reporter is not None:
            self._reporter.tick()
        return meta

    def update_connector_output(self, connector_output: Any) -> None:
        if self._sched is not None:
            self._sched.update_connector_output(connector_output)

    def request_finished(self, request: Any, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        assert self._sched is not None
        return self._sched.request_finished(request), None

    def request_finished_all_groups(
        self, request: Any, block_ids: tuple[list[int], ...]
    ) -> tuple[bool, dict[str, Any] | None]:
        """vLLM's call with `SupportsHMA` (every group's blocks): the same as `request_finished`; True holds every
        group's blocks until the request's saves have copied them out."""
        return self.request_finished(request, list(block_ids[0]) if block_ids else [])

    @property
    def is_scheduler(self) -> bool:
        return self._sched is not None

    @property
    def store(self) -> ConnectorStore | None:
        """The store this half opened (the worker's opens with its KV caches, `register_kv_caches`)."""
        return self._worker.store if self._worker is not None else self._scheduler_store

    def stats(self) -> dict[str, Any]:
        return self.counters.snapshot()

    def flush(self, timeout: float = 60) -> bool:
        """Until every save this half has started is in the store and written back (False on timeout)."""
        if self._worker is not None:
            return self._worker.flush(timeout)
        return self.store is None or self.store.flush(timeout)

    def cost_snapshot(self) -> dict[str, Any] | None:
        """The scheduler side's load-or-recompute estimates (measured rates, priors until measured)."""
        return self._sched.cost_snapshot() if self._sched is not None else None

    def rank_stats(self) -> dict[int, dict[str, int]] | None:
        """(Scheduler side) counters per tensor-parallel rank: prefetches and lookups here, the workers' loads
        and saves as they reported them with each step's output."""
        return self._sched.rank_counters.snapshot() if self._sched is not None else None

    def warm(
        self, token_ids: list[int], ttl_s: float = 30.0, lease_id: str | None = None, identity: Identity | None = None
    ) -> WarmCounts:
        """(Scheduler side) The warm-up API in-process: read the whole chunks of token_ids (keyed under `identity`:
        the adapter and cache salt of the completion to come) up into DRAM and lease them for ttl_s
        (`SchedulerSide.warm`); what `POST /v1/kvprefetch/warm` calls."""
        assert self._sched is not None, "warm-up runs on the scheduler side"
        return self._sched.warm(token_ids, ttl_s, lease_id or f"warm-{uuid.uuid4().hex[:16]}", identity)

    def warm_status(self, lease_id: str) -> WarmCounts | None:
        """(Scheduler side) A warm-up's chunks now (None: unknown, expired or ended)."""
        return self._sched.warm_status(lease_id) if self._sched is not None else None

    def lease_stats(self) -> dict[str, int]:
        """(Scheduler side) Leases now: how many, the keys they hold and will hold, the budget."""
        return self._sched.leases.snapshot() if self._sched is not None else {}

    def end_leases(self) -> int:
        """(Scheduler side) End every lease now (unpinning what they hold); how many there were."""
        return self._sched.leases.close() if self._sched is not None else 0

    def reset_cache(self) -> bool | None:
        """vLLM's connector-cache reset (``POST /reset_prefix_cache?reset_external=true`` on a server in dev mode,
        ``LLM.reset_prefix_cache(reset_connector=True)``, the cache-clearing cascade after a weight update): this
        node's DRAM pool and disk tier emptied, the shared tier left (`SchedulerSide.reset`). False while requests
        are in flight, as vLLM's own reset refuses then."""
        if self._sched is None:
            return None
        dropped = self._sched.reset()
        if dropped is None:
            log.warning("kvprefetch: cache reset refused: requests are in flight")
            return False
        log.info("kvprefetch: cache reset: %d chunks dropped from this node's DRAM pool and disk tier", dropped)
        return True

    def wait_for_prefetches(self, timeout: float) -> bool:
        """(Scheduler side) Wait until every known request's reads into DRAM have finished; False on timeout."""
        return self._sched.wait_for_reads(timeout) if self._sched is not None else True
