"""Conversion between vLLM's paged KV cache and kvprefetch's contiguous chunk buffers.

vLLM hands the worker one tensor per attention layer, a logical ``[B, H, N, C]`` view (blocks, heads, tokens,
content) whose *physical* stride order depends on the backend and the resolved layout (LBHNC on the CPU
backend, LBNHC/HND variants on GPUs), and whose dim 0 may count kernel blocks (several per scheduler block).
We never assume a shape: a scheduler block's page for one layer is whatever ``layer[block]`` holds, copied with
indexing that follows the strides. What a page's bytes *mean* (how K and V sit inside it) is the
backend's business; the namespace tags the chunk with the device type and page geometry so chunks written
by one backend are never read by another.

A chunk of ``chunk_tokens`` tokens is ``blocks_per_chunk = chunk_tokens // block_size`` whole blocks, so a
chunk buffer (``chunk_bytes`` bytes) is laid out ``[layer][block in chunk][page]``: one layer's part of a chunk
is one contiguous run, which is what lets a load scatter layer by layer while the engine computes. A model with
several KV cache groups (`kvprefetch.vllm.groups`) has a block table per group: a chunk's block ids are then each
group's ``blocks_per_chunk`` ids in turn, and a layer's pages come from its own group's (``layer_groups``).

**Host KV is copied with numpy, never with torch ops** (invariant: the connector's threads start no OpenMP
team). The copies run on the connector's loader and saver threads. A torch CPU op on a thread that is not the
model's starts an OpenMP team of its own for that thread (``torch.get_num_threads() - 1`` more threads, which
live as long as that thread), and libgomp's threads spin-wait after every parallel region: on a CPU engine they
take the cores the model's forward runs on. On a 2-core machine this doubled the decode step (3.3 -> 6.3 ms)
in every mode with an async load path. numpy's copies are plain single-threaded memcpy loops. Device KV (GPU)
keeps torch's copies, which run on the device.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

# Chunks are read straight out of the shared DRAM pool through read-only views; torch warns that it cannot
# guarantee read-only-ness of such tensors. We only ever read them.
warnings.filterwarnings("ignore", message="The given (buffer|NumPy array) is not writable")


def host_bytes(t: torch.Tensor) -> np.ndarray:
    """A uint8 numpy view of a host tensor, strides kept (its last dimension must be contiguous)."""
    return (t if t.dtype == torch.uint8 else t.view(torch.uint8)).numpy()


def chunk_tensor(buf) -> torch.Tensor:
    """A flat uint8 tensor over a chunk buffer (tensor, numpy array or memoryview; zero-copy, maybe read-only)."""
    if isinstance(buf, torch.Tensor):
        return buf.view(torch.uint8).reshape(-1)
    return torch.from_numpy(np.frombuffer(buf, dtype=np.uint8))


@dataclass(frozen=True)
class ChunkGeometry:
    """Byte geometry of one chunk: what both the scheduler and the worker must agree on."""

    num_layers: int
    block_size: int
    blocks_per_chunk: int
    page_bytes: int  # one layer, one scheduler block (K and V)

    @property
    def chunk_tokens(self) -> int:
        return self.block_size * self.blocks_per_chunk

    @property
    def layer_bytes(self) -> int:
        return self.blocks_per_chunk * self.page_bytes

    @property
    def chunk_bytes(self) -> int:
        return self.num_layers * self.layer_bytes


def blocks_per_chunk(chunk_tokens: int, block_size: int) -> int:
    """How many whole blocks a chunk is. `chunk_tokens` must already be whole blocks: it is rounded once, where
    the connector's spec is built (`kvprefetch.vllm.spec.whole_blocks`); a value that is not is a caller's bug."""
    if chunk_tokens <= 0 or chunk_tokens % block_size:
        raise ValueError(f"chunk_tokens {chunk_tokens} is not whole {block_size}-token blocks")
    return chunk_tokens // block_size


def geometry_from_spec(spec, num_layers: int, chunk_tokens: int) -> ChunkGeometry:
    """Geometry from a vLLM AttentionSpec (scheduler side: no tensors there)."""
    page_bytes = int(getattr(spec, "real_page_size_bytes", None) or spec.page_size_bytes)
    return ChunkGeometry(num_layers, spec.block_size, blocks_per_chunk(chunk_tokens, spec.block_size), page_bytes)


class PagedKV:
    """The worker's paged KV: one ``[num_blocks, *page]`` view per layer, in chunk order; ``layer_groups[i]``: the
    position of layer i's KV cache group in a chunk's block ids (None: one group)."""

    def __init__(self, layer_tensors: Sequence[torch.Tensor], num_blocks: int, block_size: int,
                 layer_groups: Sequence[int] | None = None):  # fmt: skip
        if not layer_tensors:
            raise ValueError("no KV cache tensors")
        self.layer_groups = tuple(layer_groups) if layer_groups is not None else (0,) * len(layer_tensors)
        if len(self.layer_groups) != len(layer_tensors):
            raise ValueError(f"{len(self.layer_groups)} layer groups for {len(layer_tensors)} layers")
        self.num_groups = max(self.layer_groups) + 1
        self.layers = [self._per_block(t, num_blocks) for t in layer_tensors]
        first = self.layers[0]
        for t in self.layers[1:]:
            if t.shape != first.shape or t.dtype != first.dtype:
                raise ValueError(f"layers differ in page shape/dtype: {tuple(t.shape)} vs {tuple(first.shape)}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.page_shape = tuple(first.shape[1:])
        self.dtype = first.dtype
        self.device = first.device
        self.page_bytes = math.prod(self.page_shape) * first.element_size()
        # uint8 views of host KV, one per layer ([num_blocks, *page] with the last dim in bytes), for numpy copies
        self.host = [host_bytes(t) for t in self.layers] if self.device.type == "cpu" else None
        self.host_page = self.host[0].shape[1:] if self.host is not None else ()  # one block's page, in bytes

    @staticmethod
    def _per_block(t: torch.Tensor, num_blocks: int) -> torch.Tensor:
        # Kernel-block splitting: dim 0 counts kernel blocks, uniformly strided inside a scheduler block.
        if t.shape[0] == num_blocks:
            return t
        if t.shape[0] % num_blocks:
            raise ValueError(f"KV tensor dim 0 ({t.shape[0]}) is not a multiple of num_blocks ({num_blocks})")
        return t.unflatten(0, (num_blocks, -1))

    def geometry(self, chunk_tokens: int) -> ChunkGeometry:
        """The geometry of a chunk of `chunk_tokens` (whole blocks: the spec's) over these pages."""
        per = blocks_per_chunk(chunk_tokens, self.block_size)
        return ChunkGeometry(len(self.layers), self.block_size, per, self.page_bytes)

    # ---- views of chunk buffers -------------------------------------------------------------------------------
    def chunk_view(self, buf: torch.Tensor, geo: ChunkGeometry) -> torch.Tensor:
        """A uint8 ``[n, chunk_bytes]`` host buffer as ``[n, layers, blocks_per_chunk, *page]`` of the KV dtype."""
        n = buf.shape[0]
        return buf.view(self.dtype).view(n, geo.num_layers, geo.blocks_per_chunk, *self.page_shape)

    # ---- host views (numpy, see the module docstring) ----------------------------------------------------------
    def _host_pages(self, flat: np.ndarray, n: int) -> np.ndarray:
        """``n`` contiguous pages in a flat byte run, shaped like one block of a host layer view."""
        return flat.reshape(n, *self.host_page)

    def _host_chunks(self, rows: np.ndarray, geo: ChunkGeometry) -> np.ndarray:
        """``[n, chunk_bytes]`` bytes as ``[n, layers, blocks_per_chunk, *page bytes]``."""
        return rows.reshape(rows.shape[0], geo.num_layers, geo.blocks_per_chunk, *self.host_page)

    # ---- copies -----------------------------------------------------------------------------------------------
    def _index(self, block_ids: Sequence[int]) -> torch.Tensor:
        return torch.as_tensor(np.asarray(block_ids, dtype=np.int64), device=self.device)

    def _group_ids(self, li: int, chunk_ids: Sequence[int], geo: ChunkGeometry) -> Sequence[int]:
        """Layer li's blocks among one chunk's ids (its group's ``blocks_per_chunk``)."""
        g, per = self.layer_groups[li], geo.blocks_per_chunk
        return chunk_ids[g * per : (g + 1) * per]

    def _check_ids(self, block_ids: Sequence[Sequence[int]], geo: ChunkGeometry) -> None:
        if any(len(chunk) != self.num_groups * geo.blocks_per_chunk for chunk in block_ids):
            raise ValueError("every chunk to save needs exactly blocks_per_chunk blocks per KV cache group")

    def gather(self, block_ids: Sequence[Sequence[int]], out: torch.Tensor, geo: ChunkGeometry) -> None:
        """Copy the pages of whole chunks (``block_ids[i]`` = the chunk's blocks) into ``out[i]``."""
        self._check_ids(block_ids, geo)
        view = self.chunk_view(out[: len(block_ids)], geo)
        for li, layer in enumerate(self.layers):
            ids = [b for chunk in block_ids for b in self._group_ids(li, chunk, geo)]
            pages = layer.index_select(0, self._index(ids))
            view[:, li].copy_(pages.view(len(block_ids), geo.blocks_per_chunk, *self.page_shape))

    def gather_into(self, block_ids: Sequence[Sequence[int]], out: torch.Tensor, geo: ChunkGeometry) -> None:
        """Like `gather`, with no intermediate tensor: each chunk's pages go straight into its row of ``out``
        (host KV; device KV takes `gather`'s path: one batched gather on the device, then one transfer)."""
        if out.device != self.device:
            self.gather(block_ids, out, geo)
            return
        self._check_ids(block_ids, geo)
        per = geo.blocks_per_chunk
        if self.host is not None:
            rows = self._host_chunks(host_bytes(out[: len(block_ids)]), geo)
            idx = np.asarray(block_ids, dtype=np.int64)  # [n, groups * blocks_per_chunk]
            for li, layer in enumerate(self.host):
                g = self.layer_groups[li]
                rows[:, li] = layer[idx[:, g * per : (g + 1) * per]]
            return
        view = self.chunk_view(out[: len(block_ids)], geo)
        for i, chunk in enumerate(block_ids):
            for li, layer in enumerate(self.layers):
                torch.index_select(layer, 0, self._index(self._group_ids(li, chunk, geo)), out=view[i, li])

    def scatter_chunk_layer(self, li: int, chunk: torch.Tensor, block_ids: Sequence[int], geo: ChunkGeometry) -> None:
        """Copy layer ``li`` of one chunk (flat uint8, e.g. a view of the DRAM pool) into its blocks (< 0: skip;
        ``block_ids``: the chunk's ids, every group's)."""
        block_ids = self._group_ids(li, block_ids, geo)
        lb = geo.layer_bytes
        keep = [j for j, b in enumerate(block_ids) if b >= 0]
        if not keep:
            return
        if self.host is not None and chunk.device.type == "cpu":
            pages = self._host_pages(host_bytes(chunk)[li * lb : (li + 1) * lb], geo.blocks_per_chunk)
            if len(keep) != len(block_ids):
                pages = pages[keep]
            self.host[li][np.asarray([block_ids[j] for j in keep], dtype=np.int64)] = pages
            return
        pages = chunk[li * lb : (li + 1) * lb].view(self.dtype).view(geo.blocks_per_chunk, *self.page_shape)
        if len(keep) != len(block_ids):
            pages = pages[keep[0] :] if keep == list(range(keep[0], len(block_ids))) else pages[keep]
        if pages.device != self.device:
            pages = pages.to(self.device, non_blocking=True)
        self.layers[li].index_copy_(0, self._index([block_ids[j] for j in keep]), pages)

    def scatter_layer(self, li: int, src: torch.Tensor, block_ids: Sequence[Sequence[int]], geo: ChunkGeometry) -> None:
        """Copy layer ``li`` of chunks ``src[i]`` into their blocks; a block id < 0 is skipped (already present)."""
        rows, dst = [], []
        for i, chunk in enumerate(block_ids):
            for j, b in enumerate(self._group_ids(li, chunk, geo)):
                if b >= 0:
                    rows.append(i * geo.blocks_per_chunk + j)
                    dst.append(b)
        if not dst:
            return
        if self.host is not None and src.device.type == "cpu":
            pages = self._host_chunks(host_bytes(src), geo)[:, li].reshape(-1, *self.host_page)
            self.host[li][np.asarray(dst, dtype=np.int64)] = pages[rows]
            return
        pages = self.chunk_view(src, geo)[:, li].reshape(-1, *self.page_shape)  # [n * blocks_per_chunk, *page]
        if len(rows) != pages.shape[0]:
            pages = pages.index_select(0, torch.as_tensor(rows, dtype=torch.int64))
        if pages.device != self.device:
            pages = pages.to(self.device, non_blocking=True)
        self.layers[li].index_copy_(0, self._index(dst), pages)
