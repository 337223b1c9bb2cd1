"""Cache tiers below the engine: a shared-memory DRAM pool and a crash-safe local disk tier."""

from kvprefetch.tiers.chunk_format import HEADER_BYTES, CorruptChunk, image_bytes
from kvprefetch.tiers.disk import DiskFullError, DiskTier
from kvprefetch.tiers.dram import PoolGeometryError, SharedChunkPool

__all__ = [
    "HEADER_BYTES",
    "CorruptChunk",
    "DiskFullError",
    "DiskTier",
    "PoolGeometryError",
    "SharedChunkPool",
    "image_bytes",
]
