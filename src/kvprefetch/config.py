"""One typed configuration for the store, from YAML, `KVPREFETCH_*` environment variables and CLI flags.

Precedence (highest first): explicit overrides (CLI flags, connector extra config) > environment > YAML file >
defaults. Every bad value fails at load time with a message naming the field, never later on the hot path.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Annotated, Any, Literal

import yaml
from pydantic import (
    BaseModel,
    BeforeValidator,
    ByteSize,
    ConfigDict,
    Field,
    NonNegativeInt,
    ValidationError,
    field_validator,
    model_validator,
)
from pydantic_settings import BaseSettings, SettingsConfigDict

from kvprefetch.tiers.access import resolve_group

TierName = Literal["dram", "disk", "remote"]


def _positive_size(value: Any) -> Any:
    if isinstance(value, int | float) and not isinstance(value, bool) and value <= 0:
        raise ValueError(f"must be a positive size in bytes (a number or e.g. '2GiB'), got {value}")
    if isinstance(value, str) and value.strip().startswith("-"):
        raise ValueError(f"must be a positive size in bytes (a number or e.g. '2GiB'), got {value!r}")
    return value


PositiveBytes = Annotated[ByteSize, BeforeValidator(_positive_size), Field(gt=0)]
NonNegativeBytes = Annotated[ByteSize, Field(ge=0)]


class ConfigError(ValueError):
    """A configuration value is wrong; the message names each bad field and why."""


def default_cache_dir() -> Path:
    """The user's cache directory (XDG), where the disk tier lives unless told otherwise."""
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "kvprefetch"


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid")


class DramConfig(_Section):
    """Host DRAM tier: one shared-memory pool per name on a node, shared by every process that names it."""

    capacity_bytes: PositiveBytes = ByteSize(2 << 30)
    pool_name: str = Field(default="default", pattern=r"^[A-Za-z0-9_.-]{1,64}$")
    hugepages: bool = Field(default=True, description="madvise(MADV_HUGEPAGE) on the pool where the kernel allows.")
    backing: Literal["auto", "shm", "hugetlbfs"] = Field(
        default="auto", description="auto: hugetlbfs when mounted with enough free huge pages, else /dev/shm."
    )
    max_processes: int = Field(default=64, ge=1, le=4096, description="Processes that may attach at once.")
    reserve: Literal["at_open", "first_write"] = Field(
        default="at_open",
        description="When a new pool's RAM is allocated (posix_fallocate; 0.45 s for 2 GiB on our VM): at_open"
        " (default) fails an engine's start on a node without the memory; first_write waits for the first chunk"
        " written into it, so a process that only reads the pool never pays for it (the weight loader's default: a"
        " load whose blocks come from the disk cache writes none). Either way no write into the pool can SIGBUS.",
    )
    keep_idle_s: float | None = Field(
        default=0.0,
        ge=0,
        description="How long the pool outlives its last process, for a warm restart: 0 (default) frees its RAM"
        " when the last process detaches, like vLLM's own memory (the disk tier still holds every chunk); N keeps"
        " it N seconds (removed by the next attach or `kvprefetch status` after that); null keeps it until"
        " `kvprefetch status --remove/--gc`.",
    )


class DiskConfig(_Section):
    """Local NVMe/disk tier: one file per chunk under `path`."""

    path: Path = Field(default_factory=lambda: default_cache_dir() / "disk")
    capacity_bytes: PositiveBytes = ByteSize(32 << 30)
    direct_io: bool = Field(default=True, description="O_DIRECT where the file system allows it.")
    fsync: bool = Field(default=True, description="fsync each chunk before acknowledging it as durable.")
    read_inflight_bytes: PositiveBytes = Field(
        default=ByteSize(4 << 20),
        description="Bytes of reads in flight at once (a read larger than this runs alone): 4 MiB was fastest on"
        " the VMs we test on (see tiers/inflight.py); NVMe arrays want 32-128 MiB. `kvprefetch iobench` sweeps it.",
    )
    staging: Literal["auto", "off"] = Field(
        default="auto",
        description="auto: read into per-thread huge-page buffers, verify there, copy to the DRAM slot (faster on"
        " VMs, see tiers/staging.py) when the node has free huge pages; off: read straight into the slot.",
    )

    @field_validator("path")
    @classmethod
    def _writable(cls, path: Path) -> Path:
        path = path.expanduser()
        probe = path
        while not probe.exists():
            if probe.parent == probe:
                break
            probe = probe.parent
        if probe.exists() and not probe.is_dir():
            raise ValueError(f"{probe} exists and is not a directory")
        if probe.exists() and not os.access(probe, os.W_OK | os.X_OK):
            raise ValueError(f"no write permission on {probe} (needed to create the disk tier at {path})")
        return path


class IOConfig(_Section):
    """The I/O engine that moves every chunk between tiers."""

    threads: int = Field(default=4, ge=1, le=256, description="Reads/writes in flight at once.")
    join_timeout_s: float = Field(
        default=10.0, gt=0, description="How long a read waits for another process's read of the same chunk."
    )
    read_rate_limit_bps: PositiveBytes | None = Field(
        default=None, description="Cap on the disk tier's read rate (to emulate a slower storage regime)."
    )
    read_stream_bps: PositiveBytes | None = Field(
        default=None,
        description="Cap on one read of the disk tier (each I/O thread is one stream), to emulate storage that "
        "needs several reads in flight to reach its bandwidth: the whitepaper's array read 0.98 GB/s with one "
        "read and 5.23 GB/s with parallel ones.",
    )
    cpus: list[NonNegativeInt] | None = Field(
        default=None,
        description="Cores the store's and the connector's threads run on (default: wherever their process "
        "runs). Keep them off the cores a CPU engine binds its model to (kvprefetch.io.affinity).",
    )


class RedisConfig(_Section):
    """Redis or Valkey: `redis://` or TLS `rediss://` URL; AUTH through the URL or the fields below."""

    url: str = "redis://127.0.0.1:6379/0"
    cluster: bool = Field(default=False, description="Use the Redis Cluster client (url names any node).")
    username: str | None = None
    password: str | None = None
    ssl_ca_certs: Path | None = None
    ttl_s: int | None = Field(default=None, ge=1, description="Expire chunks after this many seconds.")


class MooncakeConfig(_Section):
    """Mooncake Store client: where its master and metadata service are, and what this node contributes."""

    master: str = "127.0.0.1:50051"
    metadata_server: str = "http://127.0.0.1:8080/metadata"
    local_hostname: str = "127.0.0.1"
    protocol: Literal["tcp", "rdma"] = "tcp"
    segment_bytes: NonNegativeBytes = Field(
        default=ByteSize(512 << 20),
        description="Memory this node lends the pool; 0: none, a client only (the pool's memory is elsewhere).",
    )
    buffer_bytes: PositiveBytes = ByteSize(64 << 20)
    connect_timeout_s: float = Field(default=5.0, gt=0)


class RemoteConfig(_Section):
    """The shared tier below disk."""

    backend: Literal["redis", "mooncake"] = "redis"
    key_prefix: str = Field(default="kvprefetch:", pattern=r"^[A-Za-z0-9_.:-]{0,64}$")
    write_policy: Literal["write_through", "hit_count"] = Field(
        default="write_through", description="write_through: every new chunk; hit_count: after min_hits reads."
    )
    min_hits: int = Field(default=2, ge=1)
    timeout_s: float = Field(default=2.0, gt=0)
    retry_after_s: float = Field(default=5.0, gt=0, description="How long a failed remote is skipped.")
    redis: RedisConfig = Field(default_factory=RedisConfig)
    mooncake: MooncakeConfig = Field(default_factory=MooncakeConfig)


class StoreConfig(BaseSettings):
    """The whole store's configuration."""

    model_config = SettingsConfigDict(
        env_prefix="KVPREFETCH_", env_nested_delimiter="__", extra="forbid", validate_default=True
    )

    chunk_tokens: int | None = Field(
        default=None,
        ge=1,
        le=1 << 20,
        description="Not the store's: the store keeps whatever chunks it is given (their size is chunk_bytes). "
        "The vLLM connector owns the chunk size (`kvprefetch.vllm.settings.ConnectorSettings.chunk_tokens`, "
        "default 256) and reads it from here only when a config file or KVPREFETCH_CHUNK_TOKENS sets it, so those "
        "keep working; the SGLang backend refuses a value other than SGLang's page size.",
    )
    tiers: list[TierName] = Field(default_factory=lambda: ["dram", "disk"])
    prefetch: bool = Field(default=True, description="Start moving a request's hits up on arrival.")
    dram: DramConfig = Field(default_factory=DramConfig)
    disk: DiskConfig = Field(default_factory=DiskConfig)
    io: IOConfig = Field(default_factory=IOConfig)
    remote: RemoteConfig = Field(default_factory=RemoteConfig)
    share_group: str | int | None = Field(
        default=None,
        description="Unix group (name or gid) whose members share this node's cache: DRAM pool 0660, disk tier"
        " directories 2770, chunk files 0640, all of that group. None: private to this user (0600/0700/0600).",
    )

    @field_validator("share_group")
    @classmethod
    def _group_exists(cls, group: str | int | None) -> str | int | None:
        if group is not None:
            resolve_group(group)
        return group

    @model_validator(mode="after")
    def _dram_first(self) -> StoreConfig:
        if "dram" not in self.tiers:
            raise ValueError("tiers must include 'dram': every load and save passes through the DRAM pool")
        if len(set(self.tiers)) != len(self.tiers):
            raise ValueError(f"tiers lists a tier twice: {self.tiers}")
        return self

    @property
    def disk_enabled(self) -> bool:
        return "disk" in self.tiers

    @property
    def remote_enabled(self) -> bool:
        return "remote" in self.tiers

    @classmethod
    def load(cls, path: str | os.PathLike | None = None, **overrides: Any) -> StoreConfig:
        """Build from an optional YAML file, the environment and overrides; raise ConfigError if invalid."""
        data: dict[str, Any] = {}
        if path is not None:
            data = _read_yaml(Path(path))
        _deep_update(data, overrides)
        try:
            return cls(**data)
        except ValidationError as err:
            raise ConfigError(_explain(err, source=str(path) if path else None)) from None

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> StoreConfig:
        """Build from a plain dict (e.g. vLLM's kv_connector_extra_config); `config_path` names a YAML base."""
        data = dict(data)
        path = data.pop("config_path", None)
        return cls.load(path, **data)


def _read_yaml(path: Path) -> dict[str, Any]:
    try:
        text = path.read_text()
    except OSError as err:
        raise ConfigError(f"cannot read config file {path}: {err.strerror}") from None
    try:
        data = yaml.safe_load(text) or {}
    except yaml.YAMLError as err:
        raise ConfigError(f"config file {path} is not valid YAML: {err}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"config file {path} must hold a mapping at the top level, got {type(data).__name__}")
    return data


def _deep_update(base: dict[str, Any], extra: dict[str, Any]) -> None:
    for key, value in extra.items():
        if value is None:
            continue
        if isinstance(value, dict) and isinstance(base.get(key), dict):
            _deep_update(base[key], value)
        else:
            base[key] = value


def _explain(err: ValidationError, source: str | None) -> str:
    where = f" in {source}" if source else ""
    lines = [f"invalid kvprefetch configuration{where}:"]
    for e in err.errors():
        field = ".".join(str(p) for p in e["loc"]) or "(top level)"
        got = e.get("input")
        shown = "" if isinstance(got, dict) else f" (got {got!r})"
        lines.append(f"  {field}: {e['msg']}{shown}")
    return "\n".join(lines)
