"""Namespace of a KV cache: everything that changes the bytes of a chunk's KV.

Two namespaces that differ in any field produce disjoint key spaces, so two models, two KV layouts or two
tenants can never read each other's KV even when they share a tier.
"""

from __future__ import annotations

import json

import blake3
from pydantic import BaseModel, ConfigDict, Field, model_validator

# The key scheme's version, first in every namespace's digest. v2: chunk keys carry the request's identity (LoRA
# adapter, cache salt, multimodal items, prompt embeddings; `ChunkKeyer.keys`' extras). v1 keyed tokens alone, so a
# tier written under v1 may hold an adapter's or a tenant's KV under the plain tokens' key: every v1 chunk must read
# as a miss now, and does, because no v2 key equals a v1 key (the disk tier's LRU evicts them in time).
# (Issue 62 changed no existing key, so v2 stands: a hybrid model's KV cache groups enter its `layout` tag, which
# only a model with several groups has, and such a model never ran with its groups before; MLA at TP > 1 keys every
# rank as rank 0, whose keys, and bytes, are the ones rank 0 always wrote.)
KEY_SCHEME = b"kvprefetch-ns-v2\0"


class KVNamespace(BaseModel):
    """Identity of a KV layout; its digest seeds every chunk key."""

    model_config = ConfigDict(frozen=True)

    model: str = Field(min_length=1, description="Model identity: name/path plus revision or weights hash.")
    num_layers: int = Field(ge=1)
    num_kv_heads: int = Field(ge=1, description="KV heads held by this rank.")
    head_dim: int = Field(ge=1)
    dtype: str = Field(min_length=1, description="KV cache dtype, e.g. 'bfloat16', 'float32', 'fp8_e4m3'.")
    tp_rank: int = Field(default=0, ge=0)
    tp_size: int = Field(default=1, ge=1)
    layout: str = Field(default="kv", description="Byte order of a chunk inside the payload (format tag).")
    tenant: str | None = Field(default=None, description="Optional salt isolating tenants that share a cache.")

    @model_validator(mode="after")
    def _rank_in_group(self) -> KVNamespace:
        if self.tp_rank >= self.tp_size:
            raise ValueError(f"tp_rank {self.tp_rank} is not below tp_size {self.tp_size}")
        return self

    def for_rank(self, tp_rank: int) -> KVNamespace:
        """The namespace of another tensor-parallel rank of the same deployment: each rank holds other KV heads,
        so other bytes, under keys of its own."""
        return KVNamespace.model_validate(self.model_dump() | {"tp_rank": tp_rank})

    @property
    def digest(self) -> bytes:
        """32-byte blake3 digest of the key scheme's version and the canonical JSON of every field (not cached:
        copies must not inherit it)."""
        canonical = json.dumps(self.model_dump(), sort_keys=True, separators=(",", ":"))
        return blake3.blake3(KEY_SCHEME + canonical.encode()).digest()

    @property
    def short_id(self) -> str:
        """Hex prefix used to name the namespace's directory on disk."""
        return self.digest[:8].hex()
