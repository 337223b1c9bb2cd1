"""vLLM integration: ``KVPrefetchConnector`` (``kv_connector_module_path: kvprefetch.vllm``).

The connector class is imported lazily so the vLLM-independent parts (layout, cost model, settings) import
without vLLM installed.
"""

from __future__ import annotations

from typing import Any

__all__ = ["KVPrefetchConnector"]


def __getattr__(name: str) -> Any:
    if name == "KVPrefetchConnector":
        from kvprefetch.vllm.connector import KVPrefetchConnector

        return KVPrefetchConnector
    raise AttributeError(name)
