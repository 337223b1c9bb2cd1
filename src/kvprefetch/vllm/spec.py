"""How a connector is built from vLLM's config, as vLLM's ``OffloadingSpecFactory`` builds an offloading spec.

`connector_spec` reads, once, everything the two halves must agree on (a chunk's geometry and its keys) and
refuses what the connector does not support; `build_scheduler` and `build_worker` assemble each half from that
spec. `KVPrefetchConnector.__init__` is only their caller, so what a half is made of is read here in one place,
and each step can be tested without an engine (``tests/vllm/test_spec.py``).
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, NamedTuple

from kvprefetch.keys import ChunkKeyer, KVNamespace
from kvprefetch.vllm.compat import KVConnectorRole, check_version, kv_cache_groups, num_blocks_of
from kvprefetch.vllm.events import TierEvents
from kvprefetch.vllm.groups import KVGroups, served_group
from kvprefetch.vllm.layout import ChunkGeometry, geometry_from_spec
from kvprefetch.vllm.metrics import ConnectorCounters, Reporter
from kvprefetch.vllm.scheduler import SchedulerSide
from kvprefetch.vllm.settings import ConnectorSettings, parse_extra_config
from kvprefetch.vllm.warm_api import WarmServer, engine_handler, socket_name
from kvprefetch.vllm.worker import WorkerSide

if TYPE_CHECKING:
    from kvprefetch.store import TieredStore
    from kvprefetch.vllm.store_api import ConnectorStore

log = logging.getLogger("kvprefetch.vllm")


@dataclass(frozen=True)
class ConnectorSpec:
    """What both halves derive from vLLM's config, and must agree on to read each other's chunks."""

    settings: ConnectorSettings
    is_scheduler: bool
    groups: KVGroups  # the model's KV cache groups: a chunk holds every group's layers (`groups`)
    geo: ChunkGeometry  # one rank's part of a chunk
    rank: int  # this process's tensor-parallel rank (the scheduler keys as rank 0 and derives the others)
    namespace: KVNamespace
    keyer: ChunkKeyer
    engine_id: str | None  # vLLM's engine id: names the warm-up API's socket
    # Every rank holds the same KV (MLA at TP > 1, `KVGroups.replicated`): one copy of a chunk, under rank 0's keys,
    # serves every rank: each loads it, rank 0 alone saves it.
    replicated: bool = False
    kv_events: bool = False  # vLLM publishes KV events (--kv-events-config) and the tiers' go with them (`events`)
    hash_algo: str = "sha256"  # vLLM's prefix-caching hash function (the KV events' hash space)

    @property
    def layer_names(self) -> tuple[str, ...]:
        """Every layer a chunk holds, in its order (group after group)."""
        return self.groups.layer_names

    @property
    def block_size(self) -> int:
        return self.geo.block_size

    @property
    def chunk_tokens(self) -> int:
        return self.geo.chunk_tokens


def connector_spec(vllm_config: Any, role: KVConnectorRole, kv_cache_config: Any) -> ConnectorSpec:
    """The spec of this process's connector; raises on what the connector does not support (a vLLM outside
    the tested range is only warned about)."""
    check_version()
    check_parallelism(vllm_config.parallel_config)
    transfer = vllm_config.kv_transfer_config
    settings = parse_extra_config(transfer.kv_connector_extra_config)
    attention, groups = model_groups(kv_cache_config)
    chunk_tokens = whole_blocks(settings.chunk_tokens, attention.block_size, vllm_config.model_config.max_model_len)
    geo = geometry_from_spec(attention, len(groups.layer_names), chunk_tokens)
    is_scheduler = role == KVConnectorRole.SCHEDULER
    tp_size = int(vllm_config.parallel_config.tensor_parallel_size)
    rank = 0 if is_scheduler or tp_size == 1 else _tp_rank()
    replicated = tp_size > 1 and groups.replicated
    key_rank = 0 if replicated else rank
    namespace = namespace_for(vllm_config, attention, len(groups.layer_names), settings, key_rank, groups)
    keyer = ChunkKeyer(namespace, chunk_tokens)
    events = getattr(vllm_config, "kv_events_config", None)
    return ConnectorSpec(settings, is_scheduler, groups, geo, rank, namespace, keyer,
                         getattr(transfer, "engine_id", None), replicated,
                         bool(events and events.enable_kv_cache_events and settings.tier_events),
                         str(getattr(vllm_config.cache_config, "prefix_caching_hash_algo", "sha256")))  # fmt: skip


def model_groups(kv_cache_config: Any) -> tuple[Any, KVGroups]:
    """(the first group's spec, every group) of the model's KV cache; raises, naming what, for a group the
    connector cannot serve (`groups.served_group`) or groups whose pages differ (a chunk is whole blocks of one
    size, and every layer of it one page shape: vLLM's hybrid manager makes groups' pages equal)."""
    raw = kv_cache_groups(kv_cache_config)
    hybrid = len(raw) > 1
    served = tuple(served_group(i, kind, spec, names, hybrid) for i, (spec, kind, names) in enumerate(raw))
    first = raw[0][0]
    for i, (spec, kind, _names) in enumerate(raw[1:], start=1):
        if spec.block_size != first.block_size or _page_bytes(spec) != _page_bytes(first):
            raise NotImplementedError(
                f"KVPrefetchConnector needs every KV cache group in one block size and page size; group {i} "
                f"({kind}) has {spec.block_size}-token blocks of {_page_bytes(spec)} B, group 0 "
                f"{first.block_size}-token blocks of {_page_bytes(first)} B"
            )
    return first, KVGroups(served, int(first.block_size))


def _page_bytes(spec: Any) -> int:
    return int(getattr(spec, "real_page_size_bytes", None) or spec.page_size_bytes)


def use_load_failure_policy(kv_transfer_config: Any, settings: ConnectorSettings) -> None:
    """Failure = miss: vLLM's default policy fails the request on a load error; ours recomputes the blocks.
    (vLLM's scheduler reads the policy after it has built its connector, so setting it here takes effect.)"""
    if kv_transfer_config.kv_load_failure_policy != settings.on_load_failure:
        object.__setattr__(kv_transfer_config, "kv_load_failure_policy", settings.on_load_failure)


class SchedulerHalf(NamedTuple):
    """The scheduler process's connector: its side, the store it opened, its metrics and its warm-up API."""

    side: SchedulerSide
    store: ConnectorStore
    reporter: Reporter
    warm_server: WarmServer | None
    events: TierEvents | None  # the tiers' KV events (`events`), when vLLM publishes them


def build_scheduler(
    spec: ConnectorSpec, counters: ConnectorCounters, get_block_ids: Callable[[str], tuple[list[int], ...]]
) -> SchedulerHalf:
    settings, geo = spec.settings, spec.geo
    store = open_store(settings, geo.chunk_bytes)
    events = _tier_events(spec, store) if spec.kv_events else None
    side = SchedulerSide(settings, spec.keyer, store, block_size=geo.block_size,
                         blocks_per_chunk=geo.blocks_per_chunk, chunk_bytes=geo.chunk_bytes, counters=counters,
                         get_block_ids=get_block_ids, events=events, groups=spec.groups,
                         replicated=spec.replicated)  # fmt: skip
    reporter = Reporter(
        counters, store.stats, interval_s=settings.log_interval_s,
        metrics_dir=settings.metrics_dir, metrics_port=settings.metrics_port, serve=True,
    )  # fmt: skip
    warm_server = start_warm_server(spec.engine_id, side)
    log.info(
        "kvprefetch: scheduler side up (chunk_tokens %d%s = %d B per rank x %d ranks%s, prefetch %s, "
        "load_mode %s, namespace %s)",
        spec.chunk_tokens, _configured(spec), geo.chunk_bytes, spec.namespace.tp_size,
        " (one copy: every rank holds the same KV)" if spec.replicated else "",
        "on" if settings.prefetch else "off", settings.load_mode, spec.namespace.short_id,
    )  # fmt: skip
    return SchedulerHalf(side, store, reporter, warm_server, events)


def _configured(spec: ConnectorSpec) -> str:
    """What the start-up line adds when the chunk is not the size configured (`whole_blocks` rounded it)."""
    asked = spec.settings.chunk_tokens
    return "" if asked == spec.chunk_tokens else f" (configured {asked}, as whole {spec.block_size}-token blocks)"


def _tier_events(spec: ConnectorSpec, store: ConnectorStore) -> TierEvents:
    """The tiers' KV events, started; their node catalog beside the disk tier's chunks (a dot directory, which
    the disk tier leaves alone)."""
    config = spec.settings.store
    catalog = config.disk.path / ".events" if config.disk_enabled else None
    return TierEvents(store, spec.block_size, spec.geo.blocks_per_chunk, spec.groups.kinds(), catalog_dir=catalog,
                      hash_algo=spec.hash_algo).start()  # fmt: skip


def build_worker(spec: ConnectorSpec, counters: ConnectorCounters, kv_cache_config: Any) -> WorkerSide:
    """A worker's side; its store opens with the KV caches (`WorkerSide.register_kv_caches`), once their page
    layout gives the chunk size, which must be the one the scheduler keyed and sized for."""
    expected = spec.geo.chunk_bytes

    def open_checked(chunk_bytes: int) -> ConnectorStore:
        if chunk_bytes != expected:
            raise RuntimeError(
                f"kvprefetch: worker chunk size {chunk_bytes} B != scheduler's {expected} B (unexpected KV page layout)"
            )
        return open_store(spec.settings, chunk_bytes)

    return WorkerSide(spec.rank, spec.layer_names, num_blocks_of(kv_cache_config), spec.block_size, spec.chunk_tokens,
                      open_checked, counters, layerwise=spec.settings.layerwise,
                      layer_groups=spec.groups.layer_groups, replicated=spec.replicated)  # fmt: skip


def whole_blocks(chunk_tokens: int, block_size: int, max_model_len: int | None) -> int:
    """The chunk size the connector uses: the configured `chunk_tokens` as whole KV blocks of the engine. The one
    place it is rounded; everything downstream (both halves' geometry, the keys, the cost model, the tiers' KV
    events, the testbed's report) reads the result from the spec.

    A chunk is copied block by block, so it must be whole blocks. A value that is not is rounded up to the least
    common multiple of the two, as it has been since the first release (the chunk stays a whole number of the
    configured chunks, and configs written against that rule keep their keys), and said once in the log.
    (vLLM's own offloading connector refuses a ``block_size`` that is not a multiple of the GPU block size,
    naming the rounded-up value to use; rounding keeps a config written for one block size working on an
    engine with another.) Refused, with the reason, at the connector's construction: a chunk longer than
    ``max_model_len``, which no request could ever fill (nothing would be saved or loaded)."""
    whole = chunk_tokens if chunk_tokens % block_size == 0 else math.lcm(chunk_tokens, block_size)
    if max_model_len is not None and whole > max_model_len:
        rounded = f" (chunk_tokens {chunk_tokens} as whole {block_size}-token blocks)" if whole != chunk_tokens else ""
        raise ValueError(
            f"kvprefetch: a chunk of {whole} tokens{rounded} is longer than max_model_len {max_model_len}: no "
            f"request could fill one, so nothing would be cached; set chunk_tokens to a multiple of {block_size} "
            f"from {block_size} to {max_model_len}"
        )
    if whole != chunk_tokens:
        log.warning(
            "kvprefetch: chunk_tokens %d is not a multiple of vLLM's KV block size %d; using %d (their least "
            "common multiple; set chunk_tokens to a multiple of %d to choose it)",
            chunk_tokens, block_size, whole, block_size,
        )  # fmt: skip
    return whole


def _dtype_name(dtype: Any) -> str:
    return str(dtype).removeprefix("torch.")


def namespace_for(
    vllm_config: Any, spec: Any, num_layers: int, settings: ConnectorSettings, tp_rank: int = 0,
    groups: KVGroups | None = None,
) -> KVNamespace:
    """Everything that changes a chunk's bytes: model, layer geometry, dtype, TP size and rank, page layout, and
    for a hybrid model its groups (which layers a chunk holds in which order, which pages are valid: a chunk saved
    with the hybrid manager on lacks the pages outside a window that an engine with it off reads, so the two never
    share keys; a one-group model's tag is unchanged, and so are its keys).
    (``spec.num_kv_heads`` is one rank's heads; `KVNamespace.for_rank` gives the other ranks'.)"""
    mc = vllm_config.model_config
    model_id = settings.model_id or f"{mc.model}@{getattr(mc, 'revision', None) or 'main'}"
    from vllm.platforms import current_platform

    page_bytes = int(getattr(spec, "real_page_size_bytes", None) or spec.page_size_bytes)
    layout = f"vllm-page:{current_platform.device_type}:bs{spec.block_size}:page{page_bytes}"
    if groups is not None and groups.hybrid:
        layout += f":groups={groups.describe()}"
    cache_dtype = vllm_config.cache_config.cache_dtype
    dtype = _dtype_name(spec.dtype) if cache_dtype in (None, "auto") else str(cache_dtype)
    return KVNamespace(
        model=model_id,
        num_layers=num_layers,
        num_kv_heads=spec.num_kv_heads,
        head_dim=spec.head_size,
        dtype=dtype,
        tp_rank=tp_rank,
        tp_size=vllm_config.parallel_config.tensor_parallel_size,
        layout=layout,
        tenant=settings.tenant,
    )


def check_parallelism(parallel_config: Any) -> None:
    """Tensor parallelism is supported (every rank's chunks are keyed, prefetched and loaded); pipeline
    parallelism is not (a rank would hold only some layers of a chunk): refuse it by name at start-up."""
    pp = int(getattr(parallel_config, "pipeline_parallel_size", 1) or 1)
    if pp > 1:
        raise NotImplementedError(
            f"KVPrefetchConnector does not support pipeline parallelism (pipeline_parallel_size={pp}); "
            "use tensor parallelism (tensor_parallel_size) only"
        )


def open_store(settings: ConnectorSettings, chunk_bytes: int) -> TieredStore:
    from kvprefetch.store import TieredStore

    config = settings.store
    if config.dram.pool_name == "default":
        # One pool per chunk geometry: slots are fixed-size, and another model on this node may differ.
        dram = config.dram.model_copy(update={"pool_name": f"kvp-vllm-{chunk_bytes}"})
        config = config.model_copy(update={"dram": dram})
    return TieredStore(config, chunk_bytes=chunk_bytes)


def start_warm_server(engine_id: str | None, sched: SchedulerSide) -> WarmServer | None:
    """The warm-up API's engine side (`warm_api`), on a unix socket named after vLLM's engine id."""
    if not engine_id:
        return None
    try:
        return WarmServer(socket_name(engine_id), engine_handler(sched), sched.leases.expire)
    except OSError as err:  # another engine with this id on the node (DP ranks share one id): no warm-up here
        log.warning("kvprefetch: warm-up API not served by this engine (%s)", err)
        return None


def _tp_rank() -> int:
    from vllm.distributed import get_tensor_model_parallel_rank

    return int(get_tensor_model_parallel_rank())
