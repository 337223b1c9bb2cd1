"""Model weights at storage speed: a vLLM model loader (`--load-format kvprefetch`) on kvprefetch's read path.

    shards   verify a checkpoint's safetensors files (sizes, headers, index) before anything is used
    reader   parallel O_DIRECT block reads, tensors handed out as their bytes land
    cache    blocks kept in the tiers (local disk, optionally the node's DRAM pool), keyed by content identity
    vllm_loader  the vLLM plugin; harness  one timed load (loaders compared: kvprefetch.bench.micro.loadbench)

Layering: this package uses config, io, tiers and store; nothing below it imports it.
"""

from kvprefetch.loader.settings import LoaderSettings
from kvprefetch.loader.shards import Checkpoint, CheckpointError, Shard, open_checkpoint, read_shard

__all__ = ["Checkpoint", "CheckpointError", "LoaderSettings", "Shard", "open_checkpoint", "read_shard"]
