"""Fixtures for the SGLang backend: SGLang's own host pool and storage config, real shared memory, real files."""

from __future__ import annotations

import os
import uuid
from pathlib import Path

import pytest
import torch


def _import_sglang_keeping_the_environment() -> None:
    """`import sglang` points torch's and Triton's JIT caches at SGLang's own directory through the environment
    (TORCHINDUCTOR_CACHE_DIR, ...). The suite imports it while collecting, in the process that later starts every
    vLLM engine: those must see the environment a user's shell gives them, so it is put back."""
    before = dict(os.environ)
    import sglang  # noqa: F401

    for key in set(os.environ) - set(before):
        del os.environ[key]
    os.environ.update(before)


_import_sglang_keeping_the_environment()

from kvprefetch.sglang.hostpool import host_pool, storage_config  # noqa: E402

BACKEND = {"backend_name": "kvprefetch", "module_path": "kvprefetch.sglang", "class_name": "KVPrefetchStorage"}


def page_content(key: str, nbytes: int, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """Deterministic bytes for a page key (as in SGLang, one key always names the same KV), as a flat page."""
    seed = int.from_bytes(key.encode()[-8:].rjust(8, b"\0"), "little") ^ len(key)
    raw = torch.randint(0, 256, (nbytes,), dtype=torch.uint8, generator=torch.Generator().manual_seed(seed))
    return raw.view(dtype)


def page_bytes(page: torch.Tensor) -> bytes:
    """A page's bytes (compared as bytes: random bf16 bit patterns include NaNs, which never compare equal)."""
    return page.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()


def tiers_extra(root: Path, pool: str, **store) -> dict:
    """The extra config a user passes: SGLang's dynamic-backend keys plus the store's tiers."""
    extra = BACKEND | {
        "interface_v1": 1,
        "dram": {"capacity_bytes": 16 << 20, "pool_name": pool},
        "disk": {"path": str(root / "disk"), "capacity_bytes": 256 << 20},
        "io": {"threads": 4},
    }
    return extra | store


def open_backend(extra: dict, pool=None, **config):
    """Our backend as SGLang's cache controller makes it: through the dynamic factory, then the host pool."""
    from sglang.srt.mem_cache.storage.backend_factory import StorageBackendFactory

    pool = pool if pool is not None else host_pool()
    backend = StorageBackendFactory.create_backend("dynamic", storage_config(extra=extra, **config), pool)
    backend.register_mem_pool_host(pool)
    return backend


@pytest.fixture
def pool_name() -> str:
    return f"sgl-{uuid.uuid4().hex[:12]}"


@pytest.fixture
def backends(tmp_path, pool_name):
    """Opens backends on this test's tiers; closes them (and so frees the DRAM pool) at the end."""
    opened = []

    def open_(pool=None, extra: dict | None = None, **config):
        backend = open_backend(extra or tiers_extra(tmp_path, pool_name), pool, **config)
        opened.append(backend)
        return backend

    yield open_
    for backend in opened:
        backend.close()
