"""Where one page of SGLang's host KV pool lies in memory, as `Segments` the store copies into and out of.

SGLang's zero-copy storage calls (`batch_get_v1` / `batch_set_v1`) name pages of its host pool by token index. A
page is not one run of bytes: the pool keeps K and V apart (`page_first`: two runs per page) or every layer apart
(`layer_first`: two runs per layer). The runs are read off the page's own strided view
(`get_data_page(index, flat=False)`), in that view's row-major order: the order of the page's flat form
(`get_data_page(index, flat=True)`), which is what SGLang's non-zero-copy calls hand a backend. So a page written
through one path reads back byte-identical through the other, whatever the layout, and no layout is spelled out
here.

A pool whose pages are not plain views of one CPU tensor (another pool kind, or a layout whose view this cannot
walk) has no runs: the backend then copies pages through the pool's own flat-page calls.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from kvprefetch.tiers.memory import Segments


@dataclass(frozen=True)
class PageGeometry:
    """What a host pool's page is: the chunk the store keeps for one SGLang page key."""

    page_tokens: int
    page_bytes: int
    dtype: str
    layers: int
    heads: int
    head_dim: int
    layout: str

    @classmethod
    def of(cls, host_pool: Any) -> PageGeometry:
        dummy = host_pool.get_dummy_flat_data_page()
        return cls(
            page_tokens=int(host_pool.page_size),
            page_bytes=dummy.numel() * dummy.element_size(),
            dtype=str(host_pool.dtype).removeprefix("torch."),
            layers=max(1, int(getattr(host_pool, "layer_num", 1) or 1)),
            heads=max(1, int(getattr(host_pool, "head_num", 1) or 1)),
            head_dim=max(1, int(getattr(host_pool, "head_dim", 1) or 1)),
            layout=str(host_pool.layout),
        )


class HostPages:
    """The runs of each page of one host pool (None where the pool's pages are not views this can walk)."""

    def __init__(self, host_pool: Any, page_bytes: int):
        self.pool = host_pool
        self.page_bytes = page_bytes
        self._base = _pool_bytes(host_pool)

    @property
    def zero_copy(self) -> bool:
        return self._base is not None

    def runs(self, index: int) -> Segments | None:
        """The page starting at token index `index`, as runs of the pool's memory in flat-page order."""
        if self._base is None:
            return None
        page = self.pool.get_data_page(index, flat=False)
        base, base_ptr = self._base
        runs = _strided_runs(page, page.data_ptr() - base_ptr)
        if runs is None or sum(n for _, n in runs) != self.page_bytes:
            return None
        if any(off < 0 or off + n > base.nbytes for off, n in runs):
            return None
        return Segments(memoryview(base[off : off + n]) for off, n in runs)


def _pool_bytes(host_pool: Any) -> tuple[np.ndarray, int] | None:
    """The host pool's whole KV tensor as one flat byte array (and its address), if it is one contiguous CPU
    tensor."""
    buf = getattr(host_pool, "kv_buffer", None)
    if not isinstance(buf, torch.Tensor) or buf.device.type != "cpu" or not buf.is_contiguous() or buf.numel() == 0:
        return None
    flat = buf.reshape(-1).view(torch.uint8)
    return flat.numpy(), flat.data_ptr()


def _strided_runs(view: torch.Tensor, start: int) -> list[tuple[int, int]] | None:
    """(byte offset, byte length) of each contiguous run of a strided view, in its row-major order: the
    innermost dims that are laid out row-major make one run; the outer dims enumerate the runs."""
    shape, strides, item = list(view.shape), list(view.stride()), view.element_size()
    if any(s < 0 for s in strides):
        return None
    inner, split = 1, len(shape)
    for d in reversed(range(len(shape))):
        if shape[d] != 1 and strides[d] != inner:
            break
        inner *= shape[d]
        split = d
    outer = shape[:split]
    if math.prod(outer) > 1 << 16:  # not a page's handful of runs: let the copy path do it
        return None
    return [
        (start + item * sum(i * s for i, s in zip(idx, strides[:split], strict=True)), inner * item)
        for idx in itertools.product(*(range(n) for n in outer))
    ]
