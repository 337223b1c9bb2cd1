"""`layout.py`: vLLM's paged KV <-> contiguous chunk buffers, and the copies' threads."""

from __future__ import annotations

import pytest
import torch

from kvprefetch.vllm.layout import PagedKV, blocks_per_chunk

L, B, H, N, C = 3, 10, 2, 4, 6  # layers, blocks, heads, tokens per block, content


def make_layers(order: str, kernel_split: int = 1) -> list[torch.Tensor]:
    """Per-layer logical [B, H, N, C] views of one backing tensor in the given physical order."""
    nb = B * kernel_split
    n = N // kernel_split
    phys = {"LBHNC": (L, nb, H, n, C), "LBNHC": (L, nb, n, H, C), "LHBNC": (L, H, nb, n, C), "BLHNC": (nb, L, H, n, C)}
    back = torch.randn(phys[order])
    perm = {"LBHNC": (0, 1, 2, 3, 4), "LBNHC": (0, 1, 3, 2, 4), "LHBNC": (0, 2, 1, 3, 4), "BLHNC": (1, 0, 2, 3, 4)}
    logical = back.permute(*perm[order])  # [L, B, H, N, C] view over the physical order
    return [logical[i] for i in range(L)]


@pytest.mark.parametrize("order,split", [("LBHNC", 1), ("LBNHC", 1), ("LHBNC", 1), ("BLHNC", 1), ("LBHNC", 2)])
def test_gather_scatter_round_trip(order, split):
    src_layers = make_layers(order, split)
    dst_layers = [torch.zeros_like(t) for t in src_layers]
    src, dst = PagedKV(src_layers, B, N), PagedKV(dst_layers, B, N)
    geo = src.geometry(2 * N)  # two blocks per chunk
    assert geo.blocks_per_chunk == 2 and geo.chunk_bytes == L * 2 * src.page_bytes
    chunks = [[7, 2], [0, 9]]
    buf = torch.empty((2, geo.chunk_bytes), dtype=torch.uint8)
    src.gather(chunks, buf, geo)
    # The buffer is [layer][block in chunk][page]: layer li of chunk 0 block 1 is block 2's page.
    view = src.chunk_view(buf, geo)
    assert torch.equal(view[0, 1, 1], src.layers[1][2])
    # Load into other blocks, skipping one that is "already there" (-1).
    targets = [[3, 4], [-1, 6]]
    for li in range(L):
        dst.scatter_layer(li, buf, targets, geo)
    for li in range(L):
        assert torch.equal(dst.layers[li][3], src.layers[li][7])
        assert torch.equal(dst.layers[li][4], src.layers[li][2])
        assert torch.equal(dst.layers[li][6], src.layers[li][9])
        assert not dst.layers[li][0].any()  # the skipped block was not written
    # Untouched blocks stay zero.
    for b in set(range(B)) - {3, 4, 6}:
        assert not dst.layers[0][b].any()
    # The copy-free paths: gather straight into chunk rows, scatter one chunk from a read-only byte view.
    buf2 = torch.empty_like(buf)
    src.gather_into(chunks, buf2, geo)
    assert torch.equal(buf, buf2)
    from kvprefetch.vllm.layout import chunk_tensor

    ro = memoryview(buf2[1].numpy()).toreadonly()
    dst2 = PagedKV([torch.zeros_like(t) for t in src_layers], B, N)
    for li in range(L):
        dst2.scatter_chunk_layer(li, chunk_tensor(ro), [-1, 5], geo)
        assert torch.equal(dst2.layers[li][5], src.layers[li][9]) and not dst2.layers[li][0].any()



def test_each_layer_copies_its_own_groups_blocks():
    """Several KV cache groups (`kvprefetch.vllm.groups`): a chunk's ids are each group's blocks in turn, and layer
    li's pages come from its group's (layers 0 and 1 in group 0, layer 2 in group 1)."""
    src_layers = make_layers("LBHNC")
    src = PagedKV(src_layers, B, N, layer_groups=[0, 0, 1])
    dst = PagedKV([torch.zeros_like(t) for t in src_layers], B, N, layer_groups=[0, 0, 1])
    geo = src.geometry(2 * N)
    chunks = [[7, 2, 5, 6]]  # group 0: blocks 7, 2; group 1: blocks 5, 6
    buf = torch.empty((1, geo.chunk_bytes), dtype=torch.uint8)
    buf2 = torch.empty_like(buf)
    src.gather(chunks, buf, geo)
    src.gather_into(chunks, buf2, geo)
    assert torch.equal(buf, buf2)
    view = src.chunk_view(buf, geo)
    assert torch.equal(view[0, 1, 0], src.layers[1][7]) and torch.equal(view[0, 2, 0], src.layers[2][5])
    with pytest.raises(ValueError, match="per KV cache group"):
        src.gather([[7, 2]], buf, geo)
    for li in range(L):  # group 0's first block is not needed (-1), group 1's land in 8, 9
        dst.scatter_layer(li, buf, [[-1, 3, 8, 9]], geo)
    assert not dst.layers[0][7].any() and torch.equal(dst.layers[1][3], src.layers[1][2])
    assert torch.equal(dst.layers[2][8], src.layers[2][5]) and torch.equal(dst.layers[2][9], src.layers[2][6])
    assert not dst.layers[2][3].any()  # layer 2 took group 1's ids, not group 0's


_SIDE_THREAD_COPIES = """
import os, threading, torch
from kvprefetch.vllm.layout import PagedKV, chunk_tensor
torch.set_num_threads(2)
layers = [torch.randn(64, 2, 16, 256).to(torch.bfloat16) for _ in range(4)]  # big enough for torch to go parallel
kv = PagedKV(layers, 64, 16)
geo = kv.geometry(256)
torch.ones(1 << 20).add_(1)  # the model's thread has its OpenMP team
before = len(os.listdir("/proc/self/task"))
copied, done = threading.Event(), threading.Event()
def save_and_load():  # a connector thread: it lives on after its copies, as the loader and saver pools do
    buf = torch.empty((2, geo.chunk_bytes), dtype=torch.uint8)
    kv.gather_into([list(range(16)), list(range(16, 32))], buf, geo)
    for li in range(4):
        kv.scatter_chunk_layer(li, chunk_tensor(buf[1].numpy()), list(range(32, 48)), geo)
        kv.scatter_layer(li, buf, [list(range(48, 64)), [-1] * 16], geo)
    copied.set()
    done.wait()
t = threading.Thread(target=save_and_load)
t.start()
copied.wait()
during = len(os.listdir("/proc/self/task"))  # the side thread, and any OpenMP team its copies started
done.set()
t.join()
assert torch.equal(layers[3][40], layers[3][24]) and torch.equal(layers[2][50], layers[2][2])
print(during - before - 1)
"""


def test_copies_on_the_connectors_threads_start_no_openmp_team():
    """The loader and saver threads copy host KV without torch ops: a torch op there starts an OpenMP team of
    its own whose threads spin beside the model's forward (the decode step doubled on a 2-core machine)."""
    import subprocess
    import sys

    run = subprocess.run([sys.executable, "-c", _SIDE_THREAD_COPIES], capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr[-2000:]
    assert run.stdout.split()[-1] == "0"  # the copies started no thread beside the connector's own


def test_the_layout_takes_whole_blocks_and_rounds_nothing():
    """The chunk size is rounded once, in the spec (`test_spec`); the layout only counts blocks, and a chunk that
    is not whole blocks reaching it is a bug, said at once rather than rounded a second way."""
    assert blocks_per_chunk(256, 128) == 2 and blocks_per_chunk(256, 16) == 16
    for bad in (64, 96, 0):
        with pytest.raises(ValueError, match="not whole 128-token blocks"):
            blocks_per_chunk(bad, 128)
