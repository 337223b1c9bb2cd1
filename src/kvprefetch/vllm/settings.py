"""The connector's configuration: vLLM's ``kv_connector_extra_config``.

The extra config is the store's own config (see ``kvprefetch.config.StoreConfig``: ``tiers``, ``prefetch``,
``dram``, ``disk``, ``io``), optionally based on a YAML file named by ``config_path``, plus the connector's own keys
below. An empty extra config works: a DRAM pool and a disk tier under the user's cache
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

* ``chunk_tokens``: tokens per chunk, the unit of caching (default 256). The connector owns it: the store only sees
  a chunk's bytes. A config file (``config_path``) or ``KVPREFETCH_CHUNK_TOKENS`` may still set it (the key in the
  extra config wins), as when the store's config carried it. The engine's chunk is whole KV blocks: a value that
  is not a multiple of vLLM's block size is rounded once, to their least common multiple, when the connector is
  built (`kvprefetch.vllm.spec.whole_blocks`, which logs it); the effective value is in the connector's start-up
  line, `ConnectorSpec.chunk_tokens` and the testbed's ``Geometry`` reply.
* ``load_mode``: ``async`` (default), ``sync`` or ``auto``, see above.
* ``load_policy``: ``auto`` (default), ``always`` (load every hit), ``never`` (save only).
* ``load_margin``: load a prefix only if its load time * margin <= its recompute time (default 1.0).
* ``prefill_tps_prior`` / ``disk_bps_prior``: rates assumed until measured (default: none / the tier's
  ``io.read_rate_limit_bps`` or 1 GB/s).
* ``disk_probe_interval_s``: when the rule recomputes disk hits because the disk looked slow and its rate was
  last measured longer ago than this, a few of them are read in the background to measure it again (default 2;
  0: never).
* ``keep_warm_s``: lease on finish: a finished request's chunks stay in DRAM this long (default 0: only for a
  request that asks, through ``kv_transfer_params``); see `kvprefetch.vllm.leases`.
* ``lease_budget_share``: the share of the DRAM tier leases may hold (default 0.25).
* ``layerwise``: load layer by layer inside the forward pass (default true).
* ``save``: save new whole chunks (default true).
* ``save_policy``: which requests' chunks are saved where (`kvprefetch.vllm.admission`): ``seen`` (default)
  saves a prefix's chunks from the second time its leading chunk is seen (a per-process frequency sketch), or when
  a warm-up, a lease on finish, a hit or the request's ``kv_transfer_params`` ``{"save": true}`` says it will be
  reused; ``probation`` puts a prefix seen once into DRAM only (nothing to disk) instead of not saving it;
  ``all`` saves every request's chunks to DRAM and disk. ``{"save": false}`` skips a request's saves under
  every policy. Chunks not saved (or not written back) are counted in ``vllm:kvprefetch_saves_skipped_total{reason}``.
* ``tier_events``: publish the tiers' chunks (DRAM as ``CPU``, disk and the shared tier as ``STORAGE``) on vLLM's
  KV-event stream when vLLM publishes one (default true); false: only vLLM's own GPU blocks, what a router fed by
  engine events alone sees.
* ``on_load_failure``: ``recompute`` (default: a failed chunk is a miss) or ``fail`` (vLLM's own policy).
* ``model_id``, ``tenant``: chunk-key identity and tenant salt.
* ``metrics_port``, ``metrics_dir``, ``log_interval_s``: Prometheus export and the one-line log summary.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, PositiveFloat, ValidationError

from kvprefetch.config import ConfigError, StoreConfig, _explain
from kvprefetch.modes import LoadMode
from kvprefetch.vllm.admission import SavePolicy

DEFAULT_CHUNK_TOKENS = 256

LoadPolicy = Literal["auto", "always", "never"]


class ConnectorSettings(BaseModel):
    """The connector's own keys (validated; an unknown key or a bad value is named in the error) and the store's
    config. ``store`` is built from the extra config's remaining keys by `parse_extra_config`."""

    model_config = ConfigDict(extra="forbid", frozen=True, arbitrary_types_allowed=True)

    store: StoreConfig = Field(description="The store's config (every key that is not the connector's own).")
    chunk_tokens: int = Field(
        default=DEFAULT_CHUNK_TOKENS,
        ge=1,
        le=1 << 20,
        description="Tokens per chunk, the unit of caching (rounded up to whole KV blocks of the engine).",
    )
    model_id: str | None = Field(
        default=None, description="Model identity used in chunk keys (default: the model path/name and revision)."
    )
    tenant: str | None = Field(default=None, description="Salt isolating tenants that share a cache.")
    load_policy: LoadPolicy = Field(
        default="auto", description="auto (load only what beats recompute), always, never (save only)."
    )
    load_mode: LoadMode = Field(
        default="async",
        description="async (default: a request whose chunks are on disk waits alone), sync (the step waits) or "
        "auto (whichever costs the batch less, per request).",
    )
    layerwise: bool = Field(default=True, description="Load layer by layer inside the forward pass (default true).")
    save: bool = Field(default=True, description="Save new whole chunks to the store (default true).")
    save_policy: SavePolicy = Field(
        default="seen",
        description="seen (default: a prefix's chunks are saved from the second time its leading chunk is seen, or "
        "when a warm-up, a lease on finish, a hit or the request's kv_transfer_params {\"save\": true} signal "
        "reuse), probation (as seen, but a prefix seen once is put into DRAM only, not to disk) or all (every "
        "request's chunks, to DRAM and disk).",
    )
    metrics_port: int | None = Field(
        default=None, ge=1, le=65535, description="Serve Prometheus metrics on this port (scheduler process)."
    )
    metrics_dir: str | None = Field(
        default=None, description="prometheus_client multiprocess directory (PROMETHEUS_MULTIPROC_DIR)."
    )
    log_interval_s: float = Field(
        default=60.0, ge=0, description="Seconds between one-line counter summaries in the log (0: never)."
    )
    disk_bps_prior: PositiveFloat | None = Field(default=None, description="Disk read bytes/s assumed until measured.")
    prefill_tps_prior: PositiveFloat | None = Field(
        default=None, description="Prefill tokens/s assumed until measured (unset: loads pay until measured)."
    )
    disk_probe_interval_s: float = Field(
        default=2.0,
        ge=0,
        description="When the rule recomputes chunks on disk because reading them looked slower, and the disk rate "
        "was last measured longer ago than this, a few of them are read in the background to measure it again (a "
        "slow moment or a pessimistic prior is otherwise never corrected: recomputing reads nothing). 0: never.",
    )
    load_margin: PositiveFloat = Field(
        default=1.0, description="Load a chunk only if its load time * margin <= its recompute time (default 1.0)."
    )
    keep_warm_s: float = Field(
        default=0.0,
        ge=0,
        le=86400,
        description="Lease on finish: keep a finished request's prompt + answer chunks in DRAM this long, as the "
        'likely head of its session\'s next turn (per request: kv_transfer_params {"kvprefetch": '
        '{"keep_warm_s": N}}). 0: no lease unless a request asks for one.',
    )
    lease_budget_share: float = Field(
        default=0.25,
        ge=0,
        le=0.5,
        description="Share of the DRAM tier that leases (lease on finish, warm-up calls) may hold at once; the "
        "oldest lease gives way when a new one needs room.",
    )
    tier_events: bool = Field(
        default=True,
        description="Publish the tiers' chunks (CPU, STORAGE) on vLLM's KV-event stream when vLLM publishes one "
        "(--kv-events-config); false: only vLLM's own GPU blocks, as a router fed by engine events alone sees.",
    )
    on_load_failure: Literal["recompute", "fail"] = Field(
        default="recompute",
        description="recompute (default: a failed chunk is a miss) or fail (vLLM's own default policy).",
    )

    @property
    def prefetch(self) -> bool:
        return bool(self.store.prefetch)


# The connector's own keys and what they mean (the rest of the extra config is the store's).
_CONNECTOR_KEYS: dict[str, str] = {
    name: f.description or "" for name, f in ConnectorSettings.model_fields.items() if name != "store"
}


def parse_extra_config(extra: dict[str, Any] | None) -> ConnectorSettings:
    """Split vLLM's extra config into connector keys and the store config; raise ConfigError (a ValueError)
    naming every bad key and value."""
    data = dict(extra or {})
    own = {k: data.pop(k) for k in list(data) if k in _CONNECTOR_KEYS}
    store = StoreConfig.from_dict(data)
    if "chunk_tokens" not in own and store.chunk_tokens is not None:  # from config_path or the environment
        own["chunk_tokens"] = store.chunk_tokens
    store = store.model_copy(update={"chunk_tokens": None})  # the connector's, not the store's: read it there
    try:
        return ConnectorSettings(store=store, **own)
    except ValidationError as err:
        raise ConfigError(_explain(err, source="kv_connector_extra_config")) from None


def transfer_config(extra: dict[str, Any] | None = None) -> dict[str, Any]:
    """vLLM's ``kv_transfer_config`` for the connector with `extra` as its extra config, checked as the connector
    will check it (raises ConfigError naming every bad key and value, before any engine starts). The one place
    this dict is written: `kvprefetch serve`, the bench and the tests all build it here."""
    extra = dict(extra or {})
    parse_extra_config(extra)
    return {
        "kv_connector": "KVPrefetchConnector",
        "kv_connector_module_path": "kvprefetch.vllm",
        "kv_role": "kv_both",
        "kv_connector_extra_config": extra,
    }
