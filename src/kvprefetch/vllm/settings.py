"""The connector's configuration: vLLM's ``kv_connector_extra_config``.

The extra config is the store's own config (see ``kvprefetch.config.StoreConfig``: ``chunk_tokens``, ``tiers``,
``prefetch``, ``dram``, ``disk``, ``io``), optionally based on a YAML file named by ``config_path``, plus the
connector's own keys below. An empty extra config works: a DRAM pool and a disk tier under the user's cache
directory with the store's default size caps.

How loads happen (``prefetch`` x ``load_mode``; the benchmark's modes in brackets):

=================  ==============  ==================================================================================
``prefetch``       ``load_mode``   behaviour
=================  ==============  ==================================================================================
true (default)     async (default) A request's disk hits start moving into DRAM when it *arrives*, while it waits
                                   behind others [``prefetch``]. Chunks already in DRAM when the scheduler reaches
                                   the request are loaded layer by layer inside that step's forward pass; chunks
                                   still on disk make the request wait (``WAITING_FOR_REMOTE_KVS``) without
                                   blocking the other requests.
false              async           Reads start only when the scheduler reaches the request; only that request
                                   waits for them [``ondemand``].
false              sync            Reads start when the scheduler reaches the request and run inside the engine
                                   step, which blocks until they are done (LMCache's in-process connector)
                                   [``ondemand-sync``].
true               sync            Prefetch on arrival, and whatever is still on disk when the request is reached
                                   is read inside the step.
either             auto            Per request, when the scheduler reaches it with chunks still below DRAM: read
                                   them inside the step if that costs the batch less than parking the request for
                                   a step (``CostModel.finish_in_step``), else wait asynchronously.
=================  ==============  ==================================================================================

In every mode ``load_policy: auto`` loads a hit only where the cost model (``costmodel.py``: measured prefill
speed against measured tier throughput and queue) says loading beats recomputing; ``load_margin`` > 1 makes it
more reluctant.

Connector keys (besides the store's):

* ``load_mode``: ``async`` (default), ``sync`` or ``auto``, see above.
* ``load_policy``: ``auto`` (default), ``always`` (load every hit), ``never`` (save only).
* ``load_margin``: load a prefix only if its load time * margin <= its recompute time (default 1.0).
* ``prefill_tps_prior`` / ``disk_bps_prior``: rates assumed until measured (default: none / the tier's
  ``io.read_rate_limit_bps`` or 1 GB/s).
* ``layerwise``: load layer by layer inside the forward pass (default true).
* ``save``: save new whole chunks (default true).
* ``on_load_failure``: ``recompute`` (default: a failed chunk is a miss) or ``fail`` (vLLM's own policy).
* ``model_id``, ``tenant``: chunk-key identity and tenant salt.
* ``metrics_port``, ``metrics_dir``, ``log_interval_s``: Prometheus export and the one-line log summary.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

from kvprefetch.config import StoreConfig

LoadPolicy = Literal["auto", "always", "never"]
LoadMode = Literal["async", "sync", "auto"]

_CONNECTOR_KEYS = {
    "model_id": "Model identity used in chunk keys (default: the model path/name and revision).",
    "tenant": "Salt isolating tenants that share a cache.",
    "load_policy": "auto (load only what beats recompute), always, never (save only).",
    "load_mode": "async (default: a request whose chunks are on disk waits alone), sync (the step waits) or auto "
    "(whichever costs the batch less, per request).",
    "layerwise": "Load layer by layer inside the forward pass (default true).",
    "save": "Save new whole chunks to the store (default true).",
    "metrics_port": "Serve Prometheus metrics on this port (scheduler process).",
    "metrics_dir": "prometheus_client multiprocess directory (PROMETHEUS_MULTIPROC_DIR).",
    "log_interval_s": "Seconds between one-line counter summaries in the log (0: never).",
    "disk_bps_prior": "Disk read bytes/s assumed until measured.",
    "prefill_tps_prior": "Prefill tokens/s assumed until measured (unset: loads pay until measured).",
    "on_load_failure": "recompute (default: a failed chunk is a miss) or fail (vLLM's own default policy).",
    "load_margin": "Load a chunk only if its load time * margin <= its recompute time (default 1.0).",
}


@dataclass
class ConnectorSettings:
    store: StoreConfig
    model_id: str | None = None
    tenant: str | None = None
    load_policy: LoadPolicy = "auto"
    load_mode: LoadMode = "async"
    layerwise: bool = True
    save: bool = True
    metrics_port: int | None = None
    metrics_dir: str | None = None
    log_interval_s: float = 60.0
    disk_bps_prior: float | None = None
    prefill_tps_prior: float | None = None
    load_margin: float = 1.0
    on_load_failure: Literal["recompute", "fail"] = "recompute"
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def prefetch(self) -> bool:
        return bool(self.store.prefetch)


def parse_extra_config(extra: dict[str, Any] | None) -> ConnectorSettings:
    """Split vLLM's extra config into connector keys and the store config; raise ValueError on bad values."""
    data = dict(extra or {})
    own = {k: data.pop(k) for k in list(data) if k in _CONNECTOR_KEYS}
    store = StoreConfig.from_dict(data)
    policy = own.get("load_policy", "auto")
    if policy not in ("auto", "always", "never"):
        raise ValueError(f"load_policy must be auto, always or never, got {policy!r}")
    s = ConnectorSettings(store=store, extra=dict(extra or {}))
    s.model_id = own.get("model_id")
    s.tenant = own.get("tenant")
    s.load_policy = policy
    s.load_mode = own.get("load_mode", "async")
    if s.load_mode not in ("async", "sync", "auto"):
        raise ValueError(f"load_mode must be async, sync or auto, got {s.load_mode!r}")
    s.layerwise = _bool(own.get("layerwise", True), "layerwise")
    s.save = _bool(own.get("save", True), "save")
    s.metrics_port = _opt_int(own.get("metrics_port"), "metrics_port")
    s.metrics_dir = own.get("metrics_dir")
    s.log_interval_s = float(own.get("log_interval_s", 60.0))
    s.disk_bps_prior = _opt_float(own.get("disk_bps_prior"), "disk_bps_prior")
    s.prefill_tps_prior = _opt_float(own.get("prefill_tps_prior"), "prefill_tps_prior")
    s.load_margin = float(own.get("load_margin", 1.0))
    s.on_load_failure = own.get("on_load_failure", "recompute")
    if s.on_load_failure not in ("recompute", "fail"):
        raise ValueError(f"on_load_failure must be recompute or fail, got {s.on_load_failure!r}")
    if s.load_margin <= 0:
        raise ValueError("load_margin must be positive")
    return s


def _bool(v: Any, name: str) -> bool:
    if isinstance(v, bool):
        return v
    if isinstance(v, str) and v.lower() in ("true", "false", "1", "0", "yes", "no"):
        return v.lower() in ("true", "1", "yes")
    raise ValueError(f"{name} must be a boolean, got {v!r}")


def _opt_int(v: Any, name: str) -> int | None:
    if v is None:
        return None
    try:
        return int(v)
    except (TypeError, ValueError):
        raise ValueError(f"{name} must be an integer, got {v!r}") from None


def _opt_float(v: Any, name: str) -> float | None:
    if v is None:
        return None
    try:
        f = float(v)
    except (TypeError, ValueError):
        raise ValueError(f"{name} must be a number, got {v!r}") from None
    if f <= 0:
        raise ValueError(f"{name} must be positive, got {v!r}")
    return f
