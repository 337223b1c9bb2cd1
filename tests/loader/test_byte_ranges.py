"""The TP byte-range machinery without vLLM: a read the plan left out is read when a torch op touches it (never
zeros handed on), views read nothing, and the dry run records only what ops read."""

from __future__ import annotations

import torch

from kvprefetch.loader import LoaderSettings
from kvprefetch.loader.reader import ShardReader
from kvprefetch.loader.shards import open_checkpoint
from kvprefetch.loader.tp_ranges import ByteReads, RangePlanner
from tests.loader.test_weight_cache import expected

BLOCK = 64 << 10


def test_blocks_left_out_of_the_plan_are_read_when_an_op_touches_them(ckpt):
    checkpoint = open_checkpoint(ckpt)
    headers_only = {s.path.name: frozenset(range(-(-s.data_start // BLOCK))) for s in checkpoint.shards}
    reader = ShardReader(LoaderSettings(block_bytes="64KiB", threads=2), plan=headers_only)
    want = expected(ckpt)
    try:
        with ByteReads(reader.ensure):
            got = {name: t.narrow(0, 0, 1).clone().numpy() for name, t in reader.tensors(checkpoint)}
    finally:
        reader.close()
    for name, arr in want.items():
        assert got[name].tobytes() == arr[:1].tobytes(), name
    c = reader.counters.as_dict()
    assert c["late_bytes"] > 0 and c["source_bytes"] < sum(s.size for s in checkpoint.shards)


def test_the_dry_run_records_what_ops_read_and_not_what_views_cover(ckpt):
    planner = RangePlanner(BLOCK)
    dst = {}
    with ByteReads(planner.on_read, skip_copies=True):
        for name, t in planner.weights(ckpt):
            if t.dim() == 2:
                part = t.narrow(0, 0, 1)  # a view: nothing read
                dst[name] = torch.empty_like(part)
                dst[name].copy_(part)  # recorded, and skipped (the real run copies)
    plan = planner.plan()
    checkpoint = open_checkpoint(ckpt)
    for shard in checkpoint.shards:
        nblocks = -(-shard.size // BLOCK)
        assert len(plan[shard.path.name]) < nblocks  # first rows only
        rows = [t for t in shard.tensors if len(t.shape) == 2]
        assert all(t.begin // BLOCK in plan[shard.path.name] for t in rows)
