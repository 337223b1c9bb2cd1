"""`groups.py`: a hybrid model's chunk block ids, group after group: what a load writes and what a save may take."""

from __future__ import annotations

import pytest

from kvprefetch.vllm.groups import NULL_BLOCK, SKIP, KVGroup, KVGroups, per_group, served_group

BS, PER = 16, 2  # 16-token blocks, 2 blocks (32 tokens) a chunk
# A 20-token window (vLLM keeps 19 tokens below the next one), then one full-attention group.
GROUPS = KVGroups((KVGroup(0, "sliding_window", ("l0", "l1"), window=19), KVGroup(1, "full_attention", ("l2",))), BS)


def test_chunk_order_is_group_after_group():
    assert GROUPS.layer_names == ("l0", "l1", "l2") and GROUPS.layer_groups == (0, 0, 1)
    assert GROUPS.hybrid and GROUPS.windowed and GROUPS.kinds() == ((0, "sliding_window"), (1, "full_attention"))
    assert GROUPS.describe() == "sliding_window/w19x2+full_attention x1".replace(" ", "")
    assert not KVGroups.single(("a", "b"), BS).hybrid


def test_a_load_writes_a_windowed_groups_blocks_inside_the_window_only():
    # A hit of 3 chunks (96 tokens): the token at 96 reads tokens 77..95, blocks 4 and 5 (block 4 holds 64..79).
    # vLLM allocated the sliding group's blocks 4, 5 and put its null block before them.
    sliding = [NULL_BLOCK] * 4 + [40, 41, 42]
    full = [10, 11, 12, 13, 14, 15, 16]
    tables = (sliding, full)
    assert GROUPS.load_ids(tables, 0, PER, 0, 96) == [SKIP, SKIP, 10, 11]
    assert GROUPS.load_ids(tables, 2, PER, 0, 96) == [40, 41, 14, 15]
    # the engine's own prefix hit covers blocks < 5 (80 tokens): only block 5 of chunk 2 is loaded
    assert GROUPS.load_ids(tables, 2, PER, 80, 96) == [SKIP, 41, SKIP, 15]


def test_a_chunk_is_saved_only_with_its_windows_tail_resident():
    full = list(range(10, 17))
    # Chunk 1 ends at 64: a hit there reads 45..63, blocks 2 and 3. Block 0 and 1 were freed: saved as null pages.
    assert GROUPS.save_ids(([NULL_BLOCK, NULL_BLOCK, 22, 23], full), 1, PER) == [22, 23, 12, 13]
    assert GROUPS.save_ids(([20, 21, 22, 23], full), 0, PER) == [20, 21, 10, 11]
    # chunk 0 (ends at 32: reads 13..31, blocks 0 and 1) after vLLM freed block 0: not saved
    assert GROUPS.save_ids(([NULL_BLOCK, 21, 22, 23], full), 0, PER) is None
    # blocks before the window are saved as the null block's page even when still resident
    assert GROUPS.save_ids(([20, 21, 22, 23], full), 1, PER) == [22, 23, 12, 13]
    one = KVGroups.single(("a",), BS)
    assert one.save_ids(([5, 6, 7, 8],), 1, PER) == [7, 8]
    assert one.load_ids(([5, 6, 7, 8],), 1, PER, 48, 64) == [SKIP, 8]


def test_block_ids_per_group():
    assert per_group([1, 2]) == ([1, 2],) and per_group(([1], [2])) == ([1], [2]) and per_group([]) == ()
    assert GROUPS.tables([]) == ([], []) and GROUPS.tables(([1], [2])) == ([1], [2])  # none given: empty lists


def test_a_kind_it_cannot_serve_is_refused_by_name():
    assert served_group(0, "full_attention", None, ["a"], hybrid=True).window is None
    with pytest.raises(NotImplementedError, match="group 1 of kind 'mamba'"):
        served_group(1, "mamba", None, ["layers.1.mixer"], hybrid=True)
    with pytest.raises(NotImplementedError, match="chunked_local_attention"):
        served_group(0, "chunked_local_attention", None, ["a"], hybrid=True)
    assert served_group(0, "unknown", None, ["a"], hybrid=False).window is None  # one group: as before
