"""vLLM integration: ``KVPrefetchConnector`` (``kv_connector_module_path: kvprefetch.vllm``).

The connector class is imported lazily so the vLLM-independent parts (layout, cost model, settings) import
without vLLM installed. `transfer_config(extra)` builds vLLM's ``kv_transfer_config`` for it.
"""

from __future__ import annotations

from typing import Any

from kvprefetch.vllm.settings import transfer_config

__all__ = ["KVPrefetchConnector", "transfer_config"]


def __getattr__(name: str) -> Any:
    if name == "KVPrefetchConnector":
        from kvprefetch.vllm.connector import KVPrefetchConnector

        return KVPrefetchConnector
    raise AttributeError(name)
