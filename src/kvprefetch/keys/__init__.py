"""Chunk keys: chained prefix hashes namespaced by model, KV layout and tenant."""

from kvprefetch.keys.chunk_keys import KEY_BYTES, ChunkKeyer
from kvprefetch.keys.namespace import KVNamespace

__all__ = ["KEY_BYTES", "ChunkKeyer", "KVNamespace"]
