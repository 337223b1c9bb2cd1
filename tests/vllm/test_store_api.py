"""`store_api.py`: the Protocols name exactly what the connector calls on a store, the real store implements
them, and so does the scheduler tests' fake."""

from __future__ import annotations

import ast
import inspect
import uuid
from pathlib import Path

from fake_store import FakeStore

from kvprefetch.config import StoreConfig
from kvprefetch.store import TieredStore
from kvprefetch.vllm import store_api
from kvprefetch.vllm.store_api import ConnectorStore, Lookup, ReadHandle, SchedulerStore, WorkerStore

VLLM = Path(store_api.__file__).parent


def members(proto: type) -> set[str]:
    """A Protocol's methods and attributes, its bases' included."""
    names: set[str] = set()
    for cls in proto.__mro__:
        if cls in (object, store_api.Protocol) or not getattr(cls, "_is_protocol", False):
            continue
        names |= {n for n in vars(cls) if not n.startswith("_")} | set(getattr(cls, "__annotations__", {}))
    return names


def store_uses(*files: str) -> set[str]:
    """What the connector's source reaches for on a store: ``X`` in ``store.X`` / ``<anything>.store.X``
    (``settings.store`` is the store's *config*, not a store: left out)."""
    used: set[str] = set()
    for name in files:
        for node in ast.walk(ast.parse((VLLM / name).read_text())):
            if not isinstance(node, ast.Attribute):
                continue
            v = node.value
            if isinstance(v, ast.Name) and v.id == "store":
                used.add(node.attr)
            elif isinstance(v, ast.Attribute) and v.attr == "store":
                owner = v.value
                if not (isinstance(owner, ast.Name | ast.Attribute) and "settings" in ast.unparse(owner)):
                    used.add(node.attr)
    return used


def test_the_protocols_name_exactly_what_each_half_calls():
    assert store_uses("scheduler.py", "leases.py", "events.py") == members(SchedulerStore)
    assert store_uses("worker.py") == members(WorkerStore)
    assert store_uses("connector.py", "scheduler.py", "leases.py", "events.py", "worker.py") == members(ConnectorStore)


def accepts(impl: object, proto: type) -> list[str]:
    """The protocol's methods that impl lacks or cannot be called as the protocol says (by position)."""
    bad = []
    for name in sorted(members(proto)):
        spec = inspect.getattr_static(proto, name, None)
        if not callable(spec):
            continue  # an attribute or a property: present is enough here
        positional = [p for p in inspect.signature(spec).parameters.values() if p.name != "self"]
        try:
            inspect.signature(getattr(impl, name)).bind(*(object() for _ in positional))
        except (AttributeError, TypeError):
            bad.append(name)
    return bad


def test_the_tiered_store_is_a_connector_store(tmp_path):
    config = StoreConfig.from_dict({"dram": {"capacity_bytes": 1 << 20, "pool_name": f"kvpt-{uuid.uuid4().hex[:8]}"},
                                    "disk": {"path": str(tmp_path), "fsync": False}})  # fmt: skip
    store = TieredStore(config, 4096)
    try:
        typed: ConnectorStore = store
        assert isinstance(typed, ConnectorStore) and accepts(store, ConnectorStore) == []
        assert isinstance(store.prefetch([b"k" * 32]), ReadHandle) and accepts(store.prefetch([]), ReadHandle) == []
        assert isinstance(store.lookup([]), Lookup)
    finally:
        store.close()
        store.dram.path.unlink(missing_ok=True)


def test_the_scheduler_tests_fake_store_is_a_scheduler_store():
    fake: SchedulerStore = FakeStore()
    assert isinstance(fake, SchedulerStore) and accepts(fake, SchedulerStore) == []
    assert not isinstance(fake, WorkerStore), "the scheduler side's fake needs none of the worker's calls"
    handle = fake.prefetch([])
    assert isinstance(handle, ReadHandle) and accepts(handle, ReadHandle) == []
    assert isinstance(fake.lookup([]), Lookup)
