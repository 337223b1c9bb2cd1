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
import hashlib
import logging
import weakref
from typing import TYPE_CHECKING, Any

from kvprefetch.keys import ChunkKeyer, KVNamespace
from kvprefetch.vllm.compat import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    block_ids_of,
    check_version,
    num_blocks_of,
    single_attention_group,
)
from kvprefetch.vllm.layout import effective_chunk_tokens, geometry_from_spec
from kvprefetch.vllm.metadata import KVPrefetchMetadata
from kvprefetch.vllm.metrics import ConnectorCounters, Reporter
from kvprefetch.vllm.scheduler import SchedulerSide
from kvprefetch.vllm.settings import ConnectorSettings, parse_extra_config
from kvprefetch.vllm.worker import WorkerSide

if TYPE_CHECKING:
    import torch

log = logging.getLogger("kvprefetch.vllm")
_INSTANCES: weakref.WeakSet[KVPrefetchConnector] = weakref.WeakSet()


def live_connectors() -> list[KVPrefetchConnector]:
    """Connectors alive in this process (an in-process engine has a scheduler and a worker one)."""
    return list(_INSTANCES)


def _dtype_name(dtype: Any) -> str:
    return str(dtype).removeprefix("torch.")


def namespace_for(vllm_config: Any, spec: Any, num_layers: int, settings: ConnectorSettings) -> KVNamespace:
    """Everything that changes a chunk's bytes: model, layer geometry, dtype, TP size, page layout."""
    mc = vllm_config.model_config
    model_id = settings.model_id or f"{mc.model}@{getattr(mc, 'revision', None) or 'main'}"
    from vllm.platforms import current_platform

    page_bytes = int(getattr(spec, "real_page_size_bytes", None) or spec.page_size_bytes)
    layout = f"vllm-page:{current_platform.device_type}:bs{spec.block_size}:page{page_bytes}"
    cache_dtype = vllm_config.cache_config.cache_dtype
    dtype = _dtype_name(spec.dtype) if cache_dtype in (None, "auto") else str(cache_dtype)
    return KVNamespace(
        model=model_id,
        num_layers=num_layers,
        num_kv_heads=spec.num_kv_heads,
        head_dim=spec.head_size,
        dtype=dtype,
        tp_rank=0,
        tp_size=vllm_config.parallel_config.tensor_parallel_size,
        layout=layout,
        tenant=settings.tenant,
    )


def _rank_keys(keys: list[bytes], rank: int) -> list[bytes]:
    """Keys of tensor-parallel rank > 0 (each rank holds other heads, so other bytes, under its own keys)."""
    if rank == 0:
        return keys
    tag = rank.to_bytes(4, "little")
    return [hashlib.blake2b(k + tag, digest_size=len(k)).digest() for k in keys]


def open_store(settings: ConnectorSettings, chunk_bytes: int):
    from kvprefetch.store import TieredStore

    config = settings.store
    if config.dram.pool_name == "default":
        # One pool per chunk geometry: slots are fixed-size, and another model on this node may differ.
        dram = config.dram.model_copy(update={"pool_name": f"kvp-vllm-{chunk_bytes}"})
        config = config.model_copy(update={"dram": dram})
    return TieredStore(config, chunk_bytes=chunk_bytes)


class KVPrefetchConnector(KVConnectorBase_V1):
    """Tiered KV cache with prefetch on arrival, layer-wise loads, async saves and a load-or-recompute rule."""

    def __init__(self, vllm_config: Any, role: KVConnectorRole, kv_cache_config: Any = None):
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        check_version()
        _INSTANCES.add(self)
        self.settings = parse_extra_config(self._kv_transfer_config.kv_connector_extra_config)
        # Failure = miss: vLLM's default policy fails the request on a load error; ours recomputes the blocks.
        # (The scheduler reads the policy after building its connector.)
        if self._kv_transfer_config.kv_load_failure_policy != self.settings.on_load_failure:
            object.__setattr__(self._kv_transfer_config, "kv_load_failure_policy", self.settings.on_load_failure)
        spec, layer_names = single_attention_group(kv_cache_config)
        self.block_size = spec.block_size
        chunk_tokens = effective_chunk_tokens(self.settings.store.chunk_tokens, spec.block_size)
        if chunk_tokens != self.settings.store.chunk_tokens:
            log.warning(
                "kvprefetch: chunk_tokens %d is not a multiple of vLLM's block size %d; using %d",
                self.settings.store.chunk_tokens, spec.block_size, chunk_tokens,
            )
        self.geo = geometry_from_spec(spec, len(layer_names), chunk_tokens)
        self.namespace = namespace_for(vllm_config, spec, len(layer_names), self.settings)
        self.keyer = ChunkKeyer(self.namespace, chunk_tokens)
        pc = vllm_config.parallel_config
        self.counters = ConnectorCounters("scheduler" if role == KVConnectorRole.SCHEDULER else "worker")
        self._sched: SchedulerSide | None = None
        self._worker: WorkerSide | None = None
        self._reporter: Reporter | None = None
        if role == KVConnectorRole.SCHEDULER:
            store = open_store(self.settings, self.geo.chunk_bytes)
            self._sched = SchedulerSide(
                self.settings,
                self.keyer,
                store,
                block_size=self.block_size,
                blocks_per_chunk=self.geo.blocks_per_chunk,
                chunk_bytes=self.geo.chunk_bytes,
                world_size=pc.world_size,
                counters=self.counters,
                get_block_ids=self._block_ids,
            )
            self._reporter = Reporter(
                self.counters, store.stats, interval_s=self.settings.log_interval_s,
                metrics_dir=self.settings.metrics_dir, metrics_port=self.settings.metrics_port, serve=True,
            )
            log.info(
                "kvprefetch: scheduler side up (chunk %d tokens = %d B, prefetch %s, load_mode %s, namespace %s)",
                chunk_tokens, self.geo.chunk_bytes, "on" if self.settings.prefetch else "off",
                self.settings.load_mode, self.namespace.short_id,
            )
        else:
            rank = _tp_rank()
            expected = self.geo.chunk_bytes

            def _open(chunk_bytes: int):
                if chunk_bytes != expected:
                    raise RuntimeError(
                        f"kvprefetch: worker chunk size {chunk_bytes} B != scheduler's {expected} B "
                        "(unexpected KV page layout)"
                    )
                return _RankStore(open_store(self.settings, chunk_bytes), rank)

            self._worker = WorkerSide(
                layer_names, num_blocks_of(kv_cache_config), self.block_size, chunk_tokens, _open,
                self.counters, layerwise=self.settings.layerwise,
            )

    # ---- helpers --------------------------------------------------------------------------------------------
    def _block_ids(self, req_id: str) -> list[int]:
        mgr = self._kv_cache_manager
        if mgr is None:
            return []
        ids = mgr.get_block_ids(req_id)
        return list(ids[0]) if ids else []

    # ==== worker side ============================================================================================
    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        assert self._worker is not None
        self._worker.register_kv_caches(kv_caches)
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

    def get_block_ids_with_load_errors(self) -> set[int]:
        return self._worker.get_block_ids_with_load_errors() if self._worker is not None else set()

    def build_connector_worker_meta(self):
        return self._worker.build_worker_meta() if self._worker is not None else None

    def shutdown(self) -> None:
        if self._worker is not None:
            self._worker.shutdown()
        if self._reporter is not None:
            self._reporter.close()
        # Detach from the DRAM pool last (the reporter reads its stats): the last process to detach frees the
        # pool's RAM when dram.keep_idle_s says so.
        for side in (self._worker, self._sched):
            if side is not None and side.store is not None:
                with contextlib.suppress(Exception):
                    side.store.close()

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
        ids = block_ids_of(blocks) if num_external_tokens > 0 else []
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

    @property
    def store(self) -> Any:
        if self._sched is not None:
            return self._sched.store
        return self._worker.store if self._worker is not None else None

    def stats(self) -> dict[str, Any]:
        return self.counters.snapshot()

    def cost_snapshot(self) -> dict[str, Any] | None:
        """The scheduler side's load-or-recompute estimates (measured rates, priors until measured)."""
        return self._sched.cost_snapshot() if self._sched is not None else None


class _RankStore:
    """The store as one tensor-parallel rank sees it (rank > 0 keys its chunks apart)."""

    def __init__(self, store: Any, rank: int):
        self._s = store
        self._rank = rank

    def get_into(self, keys, buffers):
        return self._s.get_into(_rank_keys(list(keys), self._rank), buffers)

    def put(self, keys, buffers):
        return self._s.put(_rank_keys(list(keys), self._rank), buffers)

    def view(self, keys):
        return self._s.view(_rank_keys(list(keys), self._rank))

    def lookup(self, keys):
        return self._s.lookup(_rank_keys(list(keys), self._rank))

    def __getattr__(self, name: str):
        return getattr(self._s, name)


def _tp_rank() -> int:
    try:
        from vllm.distributed import get_tensor_model_parallel_rank

        return int(get_tensor_model_parallel_rank())
    except Exception:
        return 0
