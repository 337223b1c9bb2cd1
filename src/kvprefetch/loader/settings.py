"""The loader's options: vLLM's `--model-loader-extra-config` JSON, validated into one typed object."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ByteSize, ConfigDict, Field, ValidationError

from kvprefetch.config import ConfigError, PositiveBytes, StoreConfig, _explain

WEIGHTS_POOL = "kvprefetch-weights"
"""The default DRAM pool name for cached weights (separate from the KV pools: its slots are blocks)."""


class LoaderSettings(BaseModel):
    """How the kvprefetch loader reads a checkpoint, and where it caches it."""

    model_config = ConfigDict(extra="forbid")

    threads: int = Field(default=8, ge=1, le=256, description="Reads (and cache lookups) in flight.")
    block_bytes: PositiveBytes = Field(
        default=ByteSize(8 << 20), description="Read size, and the cache's chunk size (a multiple of 4 KiB)."
    )
    read_inflight_bytes: PositiveBytes = Field(
        default=ByteSize(64 << 20),
        description="Bytes of source reads on the device at once, as the disk tier's `disk.read_inflight_bytes`. "
        "Four 8 MiB reads at once loaded a 2 GB checkpoint ~4x faster than one 16 MiB read at a time on our test VM "
        "(whose disk tier prefers one 4 MiB chunk at a time: a checkpoint read is one long sequential stream); "
        "eight (into huge-page buffers) read it at 1.2-1.6 GB/s against 1.1-1.3 for four, as fio's best depth "
        "on these files was 4-16.",
    )
    staging: Literal["auto", "off"] = Field(
        default="off",
        description="auto: read through huge-page staging buffers as the disk tier does. Off by default here: a "
        "shard lands once in its own (huge-page) buffer and vLLM copies it into the model, so staging "
        "would add a third pass over every byte; on our loaded 2-core VM the load is CPU-bound, not read-bound.",
    )
    direct_io: bool = Field(default=True, description="O_DIRECT source reads (no page cache).")
    lookahead_shards: int = Field(default=1, ge=0, le=16, description="Shards read ahead of the one being copied.")
    tp_ranges: bool = Field(
        default=True,
        description="With tensor parallelism, each rank reads only the blocks its weights come from (found by a "
        "dry run of vLLM's weight loading; see kvprefetch/loader/tp_ranges.py); off: every rank reads everything.",
    )
    huge_pages: bool = Field(
        default=True,
        description="Shard buffers on the node's reserved 2 MiB pages (vm.nr_hugepages) while enough are free "
        "((1 + lookahead_shards) x the largest shard): O_DIRECT reads land faster there (reader.shard_buffer).",
    )
    identity: Literal["header", "full"] = Field(
        default="header",
        description="What a cached shard is keyed by: header = (name, size, mtime, hash of the safetensors "
        "header); full = also a hash of the whole source file (reads the source once per load to hash it).",
    )
    cache: dict[str, Any] | None = Field(
        default=None,
        description="A kvprefetch store configuration (dram, disk, io) for the weight cache; none: no cache. "
        f"dram.pool_name defaults to {WEIGHTS_POOL!r} and dram.capacity_bytes to 256MiB (a hub for disk-only "
        "caching); give it the model's size to keep the weights in the node's DRAM pool too. dram.reserve defaults "
        "to first_write: a load served by the disk cache puts nothing into the pool, so it does not allocate it "
        "(0.45 s of a 2.6 s warm load on our VM).",
    )

    def store_config(self) -> StoreConfig | None:
        """The weight cache's store configuration (None: no cache)."""
        if self.cache is None:
            return None
        data = dict(self.cache)
        defaults = {"pool_name": WEIGHTS_POOL, "capacity_bytes": "256MiB", "reserve": "first_write"}
        dram = defaults | dict(data.pop("dram", None) or {})
        return StoreConfig.from_dict({"tiers": ["dram", "disk"], **data, "dram": dram})

    @classmethod
    def from_extra_config(cls, extra: dict[str, Any] | None) -> LoaderSettings:
        """Validate vLLM's model_loader_extra_config; raise ConfigError naming each bad key."""
        try:
            settings = cls(**(extra or {}))
        except ValidationError as err:
            raise ConfigError(_explain(err, source="the kvprefetch loader's --model-loader-extra-config")) from None
        if int(settings.block_bytes) % 4096:
            raise ConfigError(f"kvprefetch loader: block_bytes must be a multiple of 4096, got {settings.block_bytes}")
        settings.store_config()  # the cache section is validated now, not at the first load
        return settings
