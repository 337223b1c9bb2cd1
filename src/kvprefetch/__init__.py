"""kvprefetch: a tiered KV-cache store that prefetches KV up the tiers before the engine needs it."""

__version__ = "0.1.0"
