"""Fixtures for the storage core: real shared memory, real files, a fresh pool name per test."""

from __future__ import annotations

import contextlib
import os
import subprocess
import uuid
from pathlib import Path

import numpy as np
import pytest

from kvprefetch.config import StoreConfig
from kvprefetch.keys import ChunkKeyer, KVNamespace
from kvprefetch.store import TieredStore

CHUNK_BYTES = 64 * 1024


def chunk_payload(key: bytes, nbytes: int = CHUNK_BYTES) -> np.ndarray:
    """Deterministic bytes for a key, so any reader can tell whether it got the right chunk."""
    seed = int.from_bytes(key[:8], "little")
    return np.random.default_rng(seed).integers(0, 256, nbytes, dtype=np.uint8)


@contextlib.contextmanager
def mounted_tmpfs(mnt: Path, size: str):
    """A tmpfs of `size` at mnt for the block (skips the test unless root can mount one)."""
    mnt.mkdir()
    mount = ["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(mnt)]
    if os.geteuid() != 0 or subprocess.run(mount).returncode:
        pytest.skip("needs root to mount a tmpfs")
    try:
        yield mnt
    finally:
        subprocess.run(["umount", "-l", str(mnt)], check=False)


@pytest.fixture
def namespace() -> KVNamespace:
    return KVNamespace(model="test-llama", num_layers=2, num_kv_heads=2, head_dim=16, dtype="float32")


@pytest.fixture
def keyer(namespace) -> ChunkKeyer:
    return ChunkKeyer(namespace, chunk_tokens=16)


@pytest.fixture
def pool_name() -> str:
    return f"test-{uuid.uuid4().hex[:12]}"


@pytest.fixture
def make_config(tmp_path, pool_name):
    def make(**overrides) -> StoreConfig:
        base = {
            "dram": {"capacity_bytes": 4 << 20, "pool_name": pool_name},
            "disk": {"path": str(tmp_path / "disk"), "capacity_bytes": 64 << 20},
            "io": {"threads": 4},
        }
        for section, value in overrides.items():
            if isinstance(value, dict):
                base.setdefault(section, {}).update(value)
            else:
                base[section] = value
        return StoreConfig.load(**base)

    return make


@pytest.fixture
def open_store(make_config):
    """Opens stores; closes them and removes their shared-memory pools at the end of the test."""
    opened: list[TieredStore] = []

    def open_(chunk_bytes: int = CHUNK_BYTES, **overrides) -> TieredStore:
        store = TieredStore(make_config(**overrides), chunk_bytes=chunk_bytes)
        opened.append(store)
        return store

    yield open_
    for store in opened:
        store.close()
    for store in opened:
        store.dram.path.unlink(missing_ok=True)
