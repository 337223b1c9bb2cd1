"""The shared remote tier: chunk images in a store the field already runs (Mooncake Store, Redis/Valkey)."""

from kvprefetch.tiers.remote.base import RemoteBackend, RemoteRejected, RemoteUnavailable
from kvprefetch.tiers.remote.tier import RemoteTier, open_backend

__all__ = ["RemoteBackend", "RemoteRejected", "RemoteTier", "RemoteUnavailable", "open_backend"]
