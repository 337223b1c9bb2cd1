"""The loader's memory: shard buffers (huge pages when the node has them, ordinary pages otherwise) and the
background prefault of the model's memory, which must never change what the memory holds."""

from __future__ import annotations

import torch

from kvprefetch.loader.prefault import host_ranges, prefaulted
from kvprefetch.loader.reader import shard_buffer


def test_shard_buffer_is_zeroed_and_large_enough_with_or_without_huge_pages():
    for huge in (True, False):
        raw, on_huge = shard_buffer(3 << 20, huge)
        assert len(raw) >= 3 << 20 and (huge or not on_huge)
        assert raw[: 3 << 20] == bytes(3 << 20)
        raw[len(raw) - 1] = 7  # writable to its end
        raw.close()


def test_prefault_keeps_the_memory_contents_and_skips_shared_storage():
    a = torch.arange(3_000_000, dtype=torch.float32)
    b = a[10:]  # the same storage: faulted once
    c = torch.empty(5_000_000, dtype=torch.bfloat16)
    before = a.clone()
    assert len(host_ranges([a, b, c])) == 2
    with prefaulted([a, b, c]):
        c.fill_(1.5)  # the copies run while the pages are being populated
    assert torch.equal(a, before) and bool((c == 1.5).all())


def test_prefault_of_nothing_is_a_no_op():
    with prefaulted([torch.empty(0)]):
        pass
