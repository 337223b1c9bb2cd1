"""SGLang HiCache storage backend over kvprefetch's tiers (`--hicache-storage-backend dynamic`, see backend.py).

Importing this package needs SGLang's storage interface (`sglang.srt.mem_cache.hicache_storage`)."""

from kvprefetch.sglang.backend import BackendSettings, KVPrefetchStorage

__all__ = ["BackendSettings", "KVPrefetchStorage"]
