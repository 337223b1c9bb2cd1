"""kvprefetch's tiers as an SGLang HiCache storage backend.

SGLang's hierarchical cache keeps KV in GPU memory over a host pool and asks a storage backend (its "L3") for the
pages the host pool lacks: `batch_exists` when a request arrives (how many leading pages storage holds), then a
prefetch thread reads them into the host pool (`batch_get_v1` with host indices, or `batch_get` into flat pages),
and a backup thread writes new pages (`batch_set_v1` / `batch_set`). SGLang loads this class at run time:

    --hicache-storage-backend dynamic --hicache-storage-backend-extra-config '{"backend_name": "kvprefetch",
      "module_path": "kvprefetch.sglang", "class_name": "KVPrefetchStorage", "interface_v1": 1, ...}'

Every other key of the extra config is the store's own config (`kvprefetch.config.StoreConfig`: `dram`, `disk`,
`remote`, `io`, ...; `config_path` names a YAML base), plus `tenant` and `model_id` (the key identity). Bad keys or
values fail the server's start with the key named. The chunk is SGLang's page (``--page-size`` tokens): a
`chunk_tokens` set anyway (the vLLM connector's key, in the extra config, the YAML base or
``KVPREFETCH_CHUNK_TOKENS``) is refused unless it is that page size (`check_chunk_tokens`), rather than ignored.

What it keeps of SGLang's contract and what it adds:
- One SGLang page is one chunk of the store, under a key derived from SGLang's page key inside a namespace of the
  model, the host pool's layout and geometry, the TP rank (not for MLA, whose KV every rank shares) and the PP/CP
  shard, and the tenant: two servers that share a node's tiers never read each other's bytes.
- `exists` / `batch_exists` answer from the tiers' indexes (the node-wide DRAM pool's table, the disk tier's index;
  one batched round trip to a shared tier): no read.
- A batch read starts every page's read at once on the store's I/O engine at prefetch priority (below a vLLM
  engine's demand loads on the same node), and copies each page straight into the host pool's memory as it
  lands (zero-copy path: no staging page).
- A page is readable as soon as `batch_set` returns: it is in the node's DRAM pool, and written to disk behind it.
- A damaged or missing page is a miss (`False` / `None`), never other bytes: every chunk is checksummed.
- A page of one identity is never another's: SGLang (from sgl-project/sglang#38577, in 0.5.23) seeds the hash chain
  of the page keys it hands a storage backend with the request's ``extra_key`` (its LoRA adapter's id appended) and
  ``cache_salt``, on the backup and the prefetch path alike; a backend sees nothing else of a request's identity, so
  an SGLang whose page keys do not carry it is refused at start (`check_page_keys_carry_identity`). What SGLang
  itself leaves open is its to close: a client's ``extra_key`` is concatenated with the adapter's id unframed
  (sgl-project/sglang#24638), and an adapter or model replaced in place keeps its keys (SGLang names an adapter by
  its name and path): strip client ``extra_key`` at the gateway, and change ``model_id`` or ``tenant`` when weights
  change under one name.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from concurrent.futures import Future
from typing import Any

import blake3
import torch
from pydantic import BaseModel, ConfigDict, Field, ValidationError
from sglang.srt.mem_cache.hicache_storage import HiCacheStorage, HiCacheStorageConfig, HiCacheStorageExtraInfo

from kvprefetch.config import ConfigError, StoreConfig, _explain
from kvprefetch.episodes import EpisodeLog
from kvprefetch.io.engine import IOClass
from kvprefetch.keys import KVNamespace
from kvprefetch.sglang.host_pages import HostPages, PageGeometry
from kvprefetch.store import TieredStore
from kvprefetch.tiers.chunk_format import image_bytes
from kvprefetch.tiers.memory import copy_bytes

log = logging.getLogger(__name__)

# The dynamic factory's and SGLang's own keys in the extra config: not the store's.
SGLANG_KEYS = frozenset({"backend_name", "module_path", "class_name", "interface_v1", "tp_lcm_size"})


class BackendSettings(BaseModel):
    """The backend's keys of SGLang's extra config; the rest (but SGLang's own) is the store's config."""

    model_config = ConfigDict(extra="forbid", frozen=True, arbitrary_types_allowed=True)

    store: StoreConfig
    model_id: str | None = Field(default=None, description="Model identity in the keys (default: SGLang's name).")
    tenant: str | None = Field(default=None, description="Salt isolating tenants that share a cache.")

    @classmethod
    def from_extra_config(cls, extra: dict[str, Any] | None) -> BackendSettings:
        """Parse SGLang's extra config; raise ConfigError naming the bad key or value."""
        data = {k: v for k, v in (extra or {}).items() if k not in SGLANG_KEYS}
        own = {k: data.pop(k) for k in ("model_id", "tenant") if k in data}
        store = StoreConfig.from_dict(data)
        try:
            return cls(store=store, **own)
        except ValidationError as err:
            raise ConfigError(_explain(err, source="hicache-storage-backend-extra-config")) from None


def check_page_keys_carry_identity() -> None:
    """Refuse an SGLang whose HiCache page keys are its tokens' alone (before sgl-project/sglang#38577): its LoRA
    requests' and salted tenants' pages would sit under the base model's keys, in tiers that outlive the server."""
    from sglang.srt.mem_cache import utils

    seed = getattr(utils, "storage_namespace_seed", None)
    if seed is None or seed("lora-a", None) == seed(None, None) or seed(None, "salt-a") == seed(None, "salt-b"):
        import sglang

        raise RuntimeError(
            f"kvprefetch: SGLang {getattr(sglang, '__version__', '?')}'s HiCache page keys do not carry a request's "
            "extra_key / LoRA adapter / cache_salt, so pages of one identity would be served to another from "
            "kvprefetch's tiers; use SGLang >= 0.5.23 (or serve without --hicache-storage-backend)"
        )


def check_chunk_tokens(asked: int | None, page_tokens: int) -> None:
    """SGLang stores and asks for whole pages of its own size, one page per storage key: the backend cannot cut
    them into chunks of another size, so a config that asks for one is refused (naming both sizes) instead of
    silently keeping SGLang's. Unset, or equal to the page size: nothing to say."""
    if asked is not None and asked != page_tokens:
        raise ConfigError(
            f"kvprefetch: chunk_tokens {asked} differs from SGLang's page size {page_tokens}: with SGLang a chunk is "
            f"one HiCache page, so set --page-size {asked} or drop chunk_tokens (from the extra config, its "
            "config_path file or KVPREFETCH_CHUNK_TOKENS)"
        )


class KVPrefetchStorage(HiCacheStorage):
    """An SGLang `HiCacheStorage` over a `TieredStore` (node DRAM pool, disk tier, shared tier)."""

    def __init__(self, storage_config: HiCacheStorageConfig, kwargs: dict | None = None):
        check_page_keys_carry_identity()
        self.storage_config = storage_config
        self.settings = BackendSettings.from_extra_config(storage_config.extra_config)
        self.store: TieredStore | None = None
        self.geometry: PageGeometry | None = None
        self.pages: HostPages | None = None
        self._digest = b""
        self._episodes = EpisodeLog(log)

    # ---- attach ------------------------------------------------------------------------------------------
    def register_mem_pool_host(self, mem_pool_host: Any) -> None:
        """SGLang hands over its host pool right after creating the backend: its page is the store's chunk."""
        super().register_mem_pool_host(mem_pool_host)
        geometry = PageGeometry.of(mem_pool_host)
        check_chunk_tokens(self.settings.store.chunk_tokens, geometry.page_tokens)
        if self.geometry is not None and geometry != self.geometry:
            raise ValueError(f"kvprefetch: a host pool of another geometry ({geometry}) after {self.geometry}")
        self.pages = HostPages(mem_pool_host, geometry.page_bytes)
        if self.store is not None:
            return
        self.geometry = geometry
        self._digest = self.namespace(geometry).digest
        self.store = TieredStore(self.store_config(geometry), chunk_bytes=geometry.page_bytes)
        log.info("kvprefetch: HiCache storage over %s, pages of %d B (%s%s)", ",".join(self.settings.store.tiers),
                 geometry.page_bytes, geometry.layout, ", zero-copy" if self.pages.zero_copy else "")  # fmt: skip

    def store_config(self, geometry: PageGeometry) -> StoreConfig:
        """The store's config, with room for a page per I/O thread on the device unless the user set the cap on
        reads in flight: an SGLang page (8 MiB for a Llama-3-8B page of 64 tokens) is larger than the default cap
        (4 MiB), which would let one read run at a time."""
        config = self.settings.store
        if "read_inflight_bytes" in config.disk.model_fields_set:
            return config
        room = config.io.threads * image_bytes(geometry.page_bytes)
        disk = config.disk.model_copy(update={"read_inflight_bytes": max(int(config.disk.read_inflight_bytes), room)})
        return config.model_copy(update={"disk": disk})

    def namespace(self, geometry: PageGeometry) -> KVNamespace:
        """Everything that changes a page's bytes under one SGLang page key (its hash chain covers the tokens)."""
        c = self.storage_config
        shared = c.is_mla_model  # every TP rank holds the same KV: one copy under rank 0's keys
        shard = f"pp{c.pp_rank}/{c.pp_size}.cp{c.attn_cp_rank}/{c.attn_cp_size}.dcp{c.dcp_rank}/{c.dcp_size}"
        return KVNamespace(
            model=self.settings.model_id or c.model_name or "sglang",
            num_layers=geometry.layers,
            num_kv_heads=geometry.heads,
            head_dim=geometry.head_dim,
            dtype=geometry.dtype,
            tp_rank=0 if shared else c.tp_rank,
            tp_size=1 if shared else c.tp_size,
            layout=f"sglang.{geometry.layout}.page{geometry.page_tokens}.{geometry.page_bytes}B.{shard}",
            tenant=self.settings.tenant,
        )

    def chunk_keys(self, keys: Sequence[str]) -> list[bytes]:
        """The store's keys of SGLang page keys: each inside this backend's namespace."""
        return [blake3.blake3(self._digest + k.encode()).digest() for k in keys]

    def _attached(self) -> TieredStore:
        if self.store is None:
            raise RuntimeError("kvprefetch: register_mem_pool_host(host_pool) before any data call (SGLang does)")
        return self.store

    # ---- queries -----------------------------------------------------------------------------------------
    def exists(self, key: str) -> bool:
        return self.batch_exists([key]) == 1

    def batch_exists(self, keys: list[str], extra_info: HiCacheStorageExtraInfo | None = None) -> int:
        """How many leading pages some tier holds, from the tiers' indexes."""
        return self._attached().lookup(self.chunk_keys(keys)).num_hit_chunks

    # ---- reads -------------------------------------------------------------------------------------------
    def get(self, key: str, target_location: torch.Tensor | None = None, target_sizes: Any = None):
        return self.batch_get([key], None if target_location is None else [target_location])[0]

    def batch_get(self, keys: list[str], target_locations: list[torch.Tensor] | None = None, target_sizes: Any = None):
        """Read pages into flat pages (SGLang's non-zero-copy path); None where a page is missing or damaged."""
        pool = self._attached_pages().pool
        targets = list(target_locations) if target_locations else [pool.get_dummy_flat_data_page() for _ in keys]
        ok = self._read(keys, [_tensor_bytes(t) for t in targets])
        return [t if hit else None for t, hit in zip(targets, ok, strict=True)]

    def batch_get_v1(self, keys: list[str], host_indices: torch.Tensor,
                     extra_info: HiCacheStorageExtraInfo | None = None) -> list[bool]:  # fmt: skip
        """Read pages straight into the host pool at host_indices (one page per key)."""
        starts = self._page_starts(keys, host_indices)
        if starts is None:
            return [False] * len(keys)
        pages = self._attached_pages()
        runs = [pages.runs(i) for i in starts]
        if all(r is not None for r in runs):
            return self._read(keys, runs)
        staged = [pages.pool.get_dummy_flat_data_page() for _ in keys]
        ok = self._read(keys, [_tensor_bytes(t) for t in staged])
        for start, page, hit in zip(starts, staged, ok, strict=True):
            if hit:
                pages.pool.set_from_flat_data_page(start, page)
        return ok

    def _read(self, keys: Sequence[str], dsts: Sequence) -> list[bool]:
        """Per key, whether its page was read into its destination. Reads run at prefetch priority: SGLang reads
        storage ahead of the request's turn. A miss does not end the batch (SGLang's own file backend answers
        page by page too); SGLang uses the leading hits. A key named twice is read once and copied."""
        ids = self.chunk_keys(keys)
        first: dict[bytes, int] = {}
        unique = [i for i, key in enumerate(ids) if first.setdefault(key, i) == i]
        ok = [False] * len(ids)
        for i, hit in zip(unique, self._read_unique([ids[i] for i in unique], [dsts[i] for i in unique]), strict=True):
            ok[i] = hit
        for i, key in enumerate(ids):
            if first[key] != i and ok[first[key]]:
                copy_bytes(dsts[i], dsts[first[key]])
                ok[i] = True
        return ok

    def _read_unique(self, ids: list[bytes], dsts: Sequence) -> list[bool]:
        store = self._attached()
        ok = [False] * len(ids)
        held: list | None = None  # after a miss: which keys some tier holds, so each run of hits is one call
        at = 0
        while at < len(ids):
            got = store.get_into(ids[at:], dsts[at:], cls=IOClass.PREFETCH)
            ok[at : at + got] = [True] * got
            at += got + 1  # past the miss
            if at < len(ids):  # asked only after a miss inside the batch: a batch of hits asks nothing more
                held = held if held is not None else store.residency(ids)
                while at < len(ids) and not held[at]:
                    at += 1
        return ok

    # ---- writes ------------------------------------------------------------------------------------------
    def set(self, key: str, value: Any = None, target_location: Any = None, target_sizes: Any = None) -> bool:
        return self.batch_set([key], [value])

    def batch_set(self, keys: list[str], values: Any = None, target_locations: Any = None,
                  target_sizes: Any = None) -> bool:  # fmt: skip
        """Store flat pages (SGLang's non-zero-copy path); True if every page was stored."""
        if values is None or len(values) != len(keys):
            got = "no" if values is None else len(values)
            log.error("kvprefetch: batch_set of %d keys with %s values: nothing stored", len(keys), got)
            return False
        return all(self._write(keys, [_tensor_bytes(v.contiguous()) for v in values]))

    def batch_set_v1(self, keys: list[str], host_indices: torch.Tensor,
                     extra_info: HiCacheStorageExtraInfo | None = None) -> list[bool]:  # fmt: skip
        """Store the host pool's pages at host_indices (one page per key), copied straight out of the pool."""
        starts = self._page_starts(keys, host_indices)
        if starts is None:
            return [False] * len(keys)
        pages = self._attached_pages()
        srcs = [r if (r := pages.runs(i)) is not None else _tensor_bytes(pages.pool.get_data_page(i).contiguous())
                for i in starts]  # fmt: skip
        return self._write(keys, srcs)

    def _write(self, keys: Sequence[str], srcs: Sequence) -> list[bool]:
        """Put pages in the node's DRAM pool now (readable at once, by every process on the node) and on disk
        behind it. A page of the wrong size is refused, logged; a failed write-back is logged, the page stays
        readable from DRAM while it lasts."""
        store = self._attached()
        good = [len(s) == store.chunk_bytes for s in srcs]
        wrong = [len(s) for s, g in zip(srcs, good, strict=True) if not g]
        if wrong:
            self._episodes.warn("size", "kvprefetch: a page of %d B for pages of %d B: not stored", wrong[0],
                                store.chunk_bytes)  # fmt: skip
        keep = [i for i, g in enumerate(good) if g]
        if keep:
            written = store.put(self.chunk_keys([keys[i] for i in keep]), [srcs[i] for i in keep])
            written.add_done_callback(self._written)
        return good

    def _written(self, fut: Future) -> None:
        err = fut.exception()
        if err is not None:
            self._episodes.warn(f"writeback:{type(err).__name__}", "kvprefetch: a page's write-back failed (%s: %s); "
                                "it stays readable from DRAM while it lasts", type(err).__name__, err)  # fmt: skip

    # ---- helpers -----------------------------------------------------------------------------------------
    def _attached_pages(self) -> HostPages:
        self._attached()
        assert self.pages is not None
        return self.pages

    def _page_starts(self, keys: Sequence[str], host_indices: torch.Tensor) -> list[int] | None:
        """The token index each key's page starts at; None (logged) if host_indices does not hold a page per key."""
        page = self._attached_pages().pool.page_size
        if host_indices is None or host_indices.numel() != len(keys) * page:
            self._episodes.warn("indices", "kvprefetch: %d keys with %s host indices (pages of %d tokens)", len(keys),
                                None if host_indices is None else host_indices.numel(), page)  # fmt: skip
            return None
        return [int(i) for i in host_indices.reshape(-1)[::page].tolist()]

    # ---- lifecycle ---------------------------------------------------------------------------------------
    def clear(self) -> bool:
        """SGLang's `/clear_hicache_storage_backend`: empty this node's DRAM pool and disk tier (as SGLang's own
        file backend empties its directory), chunks a reader pins now excepted; the shared tier stays."""
        dropped = self._attached().drop_local()
        log.info("kvprefetch: cleared %d chunks from the node's tiers", dropped)
        return True

    def get_stats(self):
        return None

    def close(self) -> None:
        if self.store is not None:
            self.store.close()  # runs the queued write-backs first
            self.store = None


def _tensor_bytes(t: torch.Tensor) -> memoryview:
    """A contiguous CPU tensor's bytes, writable, whatever its dtype (bfloat16 has no numpy type)."""
    if t.device.type != "cpu" or not t.is_contiguous():
        raise ValueError("kvprefetch: pages must be contiguous CPU tensors")
    return memoryview(t.reshape(-1).view(torch.uint8).numpy())
