"""Tensor parallelism: each rank reads only the byte ranges of the checkpoint its own weights come from.

vLLM hands every rank the whole checkpoint tensor and lets the parameter's weight loader cut the rank's part
out of it (a `narrow` along the output dimension for column-parallel layers and the vocabulary, none for
replicated ones). Which bytes that touches is vLLM's and the model's business, so it is observed, not
re-derived: a dry run of `model.load_weights` over tensors that view unread, zero-filled shard buffers (no I/O,
copies into the model skipped) records, under a torch function mode, the extent of every tensor of those
buffers that an op reads data from (`narrow` and other views read nothing; the ops on what they return do).
The blocks under those extents are then read in parallel as usual, and the rest of each shard is not read.

The real load runs under the same mode, which checks every read of a shard buffer against the blocks read
and reads any block missing (synchronously) before the op runs: a weight loader that reads more in the real
run than in the dry run costs time, never correctness. A row-parallel layer cuts columns, so its part of each
row is strided across the whole tensor and the whole tensor is read: the saving is in the column-parallel
weights and the vocabulary (on a Llama at TP=2, about a third of the checkpoint per rank).
"""

from __future__ import annotations

import mmap
import weakref
from collections.abc import Callable, Iterator

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_flatten

from kvprefetch.loader.reader import Plan, as_tensor
from kvprefetch.loader.shards import open_checkpoint
from kvprefetch.tiers.chunk_format import ALIGN
from kvprefetch.tiers.memory import address_of

# Ops that read no element of their inputs: views (the ops on the view read, and are recorded) and metadata.
NO_READ = frozenset({
    "narrow", "view", "view_as", "t", "transpose", "permute", "chunk", "split", "split_with_sizes", "unbind",
    "select", "expand", "expand_as", "squeeze", "unsqueeze", "as_strided", "detach", "unflatten", "movedim",
    "swapaxes", "tensor_split", "__get__", "size", "dim", "numel", "nelement", "stride", "storage_offset",
    "data_ptr", "is_contiguous", "element_size", "__len__", "untyped_storage", "__getitem__",
})  # fmt: skip


def extent(t: torch.Tensor) -> tuple[int, int] | None:
    """[first, last + 1) byte addresses of t's elements in host memory (None: empty or not on the host)."""
    if t.device.type != "cpu" or t.numel() == 0:
        return None
    last = sum((n - 1) * s for n, s in zip(t.shape, t.stride(), strict=True))
    lo = t.data_ptr()
    return lo, lo + (last + 1) * t.element_size()


def _reads(name: str, args: tuple) -> bool:
    """Whether the op reads its inputs' elements; indexing with tensors or lists does, slicing does not."""
    if name != "__getitem__":
        return name not in NO_READ
    index = args[1] if len(args) > 1 else None
    parts = index if isinstance(index, tuple) else (index,)
    return any(isinstance(p, (torch.Tensor, list)) for p in parts)


class ByteReads(TorchFunctionMode):
    """Calls on_read(lo, hi) for every host tensor an op reads data from, before the op runs.

    on_read returns whether [lo, hi) lies in one of the loader's shard buffers. With skip_copies (the dry
    run), a copy out of a shard buffer is recorded and not done: the real run does it.
    """

    def __init__(self, on_read: Callable[[int, int], bool], skip_copies: bool = False):
        super().__init__()
        self.on_read = on_read
        self.skip_copies = skip_copies

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = getattr(func, "__name__", "")
        if _reads(name, args):
            ours = False
            for leaf in tree_flatten((args, kwargs))[0]:
                if isinstance(leaf, torch.Tensor) and (span := extent(leaf)) is not None:
                    ours = self.on_read(*span) or ours
            if ours and self.skip_copies and name == "copy_" and len(args) >= 2:
                return args[0]
        return func(*args, **kwargs)


class RangePlanner:
    """The dry run's side: zero-filled, unread stand-ins for the shards, and the blocks the run read from."""

    def __init__(self, block_bytes: int):
        self.block = block_bytes
        self._buffers: list[tuple[int, weakref.ref, str]] = []  # (address, mapping, shard file name)
        self._spans: dict[str, list[tuple[int, int]]] = {}
        self._checkpoints: list = []

    def weights(self, directory) -> Iterator[tuple[str, torch.Tensor]]:
        """Every tensor of the checkpoint, viewing a fresh zero-filled mapping per shard (nothing read)."""
        checkpoint = open_checkpoint(directory)
        self._checkpoints.append(checkpoint)
        for shard in checkpoint.shards:
            raw = mmap.mmap(-1, max(ALIGN, shard.size))  # untouched: costs no memory until read
            self._buffers.append((address_of(raw), weakref.ref(raw), shard.path.name))
            self._spans.setdefault(shard.path.name, [])
            view = memoryview(raw)
            for t in shard.tensors:
                yield t.name, as_tensor(view, t)

    def on_read(self, lo: int, hi: int) -> bool:
        """Record [lo, hi) against the live stand-in it lies in (a freed one's addresses get reused)."""
        for addr, ref, name in self._buffers:
            raw = ref()
            if raw is not None and addr <= lo < addr + len(raw):
                self._spans[name].append((lo - addr, min(hi, addr + len(raw)) - addr))
                return True
        return False

    def plan(self) -> Plan:
        """Per shard: its header's blocks (checked before use) and every block under a span read."""
        out: Plan = {}
        for checkpoint in self._checkpoints:
            for shard in checkpoint.shards:
                blocks = set(range(-(-shard.data_start // self.block)))
                for lo, hi in self._spans.get(shard.path.name, ()):
                    blocks.update(range(lo // self.block, (hi - 1) // self.block + 1))
                out[shard.path.name] = frozenset(blocks)
        return out
