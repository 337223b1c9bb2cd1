"""Fixtures: a real redis-server and a real Mooncake master per test session, stores wired to them."""

from __future__ import annotations

import uuid

import pytest

from kvprefetch.config import StoreConfig
from kvprefetch.store import TieredStore
from kvprefetch.testbed.local_servers import MooncakeMaster, RedisServer
from tests.store.conftest import keyer, namespace  # noqa: F401 - shared fixtures


@pytest.fixture(scope="session")
def redis_server(tmp_path_factory):
    server = RedisServer(tmp_path_factory.mktemp("redis"))
    yield server
    server.kill()


@pytest.fixture(scope="session")
def mooncake_master(tmp_path_factory):
    master = MooncakeMaster(tmp_path_factory.mktemp("mooncake"))
    yield master
    master.kill()


def remote_section(backend: str, redis_server=None, mooncake_master=None, **extra) -> dict:
    section = {"backend": backend, "key_prefix": f"t{uuid.uuid4().hex[:6]}:", "timeout_s": 1.0,
               "retry_after_s": 0.5, **extra}  # fmt: skip
    if backend == "redis":
        section["redis"] = {"url": redis_server.url}
    else:
        section["mooncake"] = {
            "master": mooncake_master.master,
            "metadata_server": mooncake_master.metadata_server,
            "segment_bytes": 64 << 20,
            "buffer_bytes": 16 << 20,
            "connect_timeout_s": 30,
        }
    return section


@pytest.fixture
def open_node(tmp_path):
    """Opens 'nodes': each a store with its own DRAM pool and disk directory, sharing the remote tier."""
    opened: list[TieredStore] = []

    def open_(remote: dict, chunk_bytes: int = 64 * 1024, tiers=("dram", "disk", "remote"), **extra) -> TieredStore:
        name = f"node-{uuid.uuid4().hex[:8]}"
        cfg = StoreConfig.load(
            tiers=list(tiers),
            dram={"capacity_bytes": 4 << 20, "pool_name": name},
            disk={"path": str(tmp_path / name), "capacity_bytes": 64 << 20},
            remote=remote,
            **extra,
        )
        store = TieredStore(cfg, chunk_bytes=chunk_bytes)
        opened.append(store)
        return store

    yield open_
    for store in opened:
        store.close()
        store.dram.path.unlink(missing_ok=True)
