"""`TierEvents` on its own: what a pass over the tiers announces (`reconcile`), against a store whose tiers the
test sets (the scheduler tests' fake), with requests as vLLM hands them over (their blocks' hashes)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

pytest.importorskip("vllm")

from fake_store import FakeStore
from vllm.distributed.kv_events import BlockRemoved, BlockStored
from vllm.v1.core.kv_cache_utils import maybe_convert_block_hash

from kvprefetch.vllm.events import TierEvents

BLOCK, PER = 4, 2  # tokens a block, blocks a chunk


def request(n_chunks: int, **extra) -> SimpleNamespace:
    tokens = list(range(100, 100 + n_chunks * BLOCK * PER + 3))  # whole chunks and a partial block
    hashes = [bytes([j]) * 32 for j in range(len(tokens) // BLOCK)]
    return SimpleNamespace(all_token_ids=tokens, block_hashes=hashes, **extra)


def keys(n_chunks: int, ranks: int = 1) -> list[list[bytes]]:
    return [[bytes([r, i]) * 16 for i in range(n_chunks)] for r in range(ranks)]


class Clock:
    def __init__(self):
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


def events_for(store: FakeStore, clock=None) -> TierEvents:
    return TierEvents(store, BLOCK, PER, forget_s=60.0, **({"clock": clock} if clock else {}))


def test_a_chunk_is_announced_where_it_is_in_vllms_hash_space_and_removed_when_it_leaves():
    store, req, ks = FakeStore(), request(2), keys(2)
    ev = events_for(store)
    ev.note(req, ks, 2)
    assert ev.reconcile() == 0 and ev.take() == []  # noted, in no tier: nothing to say
    store.tiers[ks[0][0]], store.tiers[ks[0][1]] = "dram", "disk"
    ev.reconcile()
    stored = ev.take()
    assert [(e.medium, e.locality, e.ownership) for e in stored] == [
        ("CPU", "LOCAL", "kvprefetch-dram"), ("STORAGE", "LOCAL", "kvprefetch-disk")]  # fmt: skip
    first, second = stored
    assert isinstance(first, BlockStored) and first.block_size == BLOCK
    assert first.block_hashes == [maybe_convert_block_hash(h) for h in req.block_hashes[:PER]]
    assert first.parent_block_hash is None and first.token_ids == req.all_token_ids[: BLOCK * PER]
    assert second.parent_block_hash == maybe_convert_block_hash(req.block_hashes[PER - 1])
    assert ev.reconcile() == 0  # nothing changed: nothing said twice
    del store.tiers[ks[0][1]]
    ev.reconcile()
    (gone,) = ev.take()
    assert isinstance(gone, BlockRemoved) and gone.medium == "STORAGE" and gone.block_hashes == second.block_hashes


def test_the_shared_pool_is_storage_and_remote():
    store, req, ks = FakeStore(), request(1), keys(1)
    ev = events_for(store)
    ev.note(req, ks, 1)
    store.tiers[ks[0][0]] = "remote"
    ev.reconcile()
    (e,) = ev.take()
    assert (e.medium, e.locality, e.ownership) == ("STORAGE", "REMOTE", "kvprefetch-pool")


def test_with_tensor_parallelism_a_chunk_is_in_a_tier_only_when_every_rank_is():
    store, req, ks = FakeStore(), request(1), keys(1, ranks=2)
    ev = events_for(store)
    ev.note(req, ks, 1)
    store.tiers[ks[0][0]] = "dram"
    assert ev.reconcile() == 0
    store.tiers[ks[1][0]] = "dram"
    assert ev.reconcile() == 1


def test_a_chunk_no_tier_holds_is_forgotten_after_a_while_and_a_tier_that_fails_changes_nothing():
    store, req, ks, clock = FakeStore(), request(2), keys(2), Clock()
    ev = events_for(store, clock)
    ev.note(req, ks, 2)
    store.tiers[ks[0][0]] = "dram"
    ev.reconcile()
    clock.t = 61.0
    ev.reconcile()  # chunk 1 was never held: forgotten; chunk 0 is held: kept
    assert len(ev._noted) == 1
    ev.take()

    def fail(keys):
        raise ConnectionError("remote down")

    store.residency = fail
    del store.tiers[ks[0][0]]
    assert ev.reconcile() == 0  # no answer: what was announced stands until the tiers answer again


@pytest.fixture
def hash_seed():
    """vLLM's hash seed (NONE_HASH), which its engine core sets; the catalog's file is named by it."""
    from vllm.utils.hashing import get_hash_fn_by_name
    from vllm.v1.core import kv_cache_utils

    before = getattr(kv_cache_utils, "NONE_HASH", None)
    kv_cache_utils.init_none_hash(get_hash_fn_by_name("sha256"))
    yield
    if before is None:
        del kv_cache_utils.NONE_HASH
    else:
        kv_cache_utils.NONE_HASH = before


def test_engines_on_one_node_announce_each_others_chunks_through_the_catalog(tmp_path, hash_seed):
    store, req, ks = FakeStore(), request(2), keys(2)
    a = TierEvents(store, BLOCK, PER, catalog_dir=tmp_path)
    b = TierEvents(store, BLOCK, PER, catalog_dir=tmp_path)  # the same tiers, another engine: keyed nothing
    a.note(req, ks, 2)
    store.tiers[ks[0][0]] = "disk"
    a.reconcile()
    b.reconcile()
    (ours,), (theirs,) = a.take(), b.take()
    assert theirs == ours and theirs.medium == "STORAGE"
    restarted = TierEvents(store, BLOCK, PER, catalog_dir=tmp_path)  # a new engine: what the disk holds
    restarted.reconcile()
    assert restarted.take() == [ours]
    # a line cut short by a writer killed mid-write is skipped, and the lines after it are read
    (catalog,) = tmp_path.glob("*.jsonl")
    with open(catalog, "a") as f:
        f.write('{"k": ["00"], "h": [1, 2]')
    c = TierEvents(store, BLOCK, PER, catalog_dir=tmp_path)
    c.reconcile()
    assert c.take() == [ours]


def test_a_catalog_is_per_hash_space(tmp_path, hash_seed):
    store, ks = FakeStore(), keys(1)
    a = TierEvents(store, BLOCK, PER, catalog_dir=tmp_path)
    a.note(request(1), ks, 1)
    store.tiers[ks[0][0]] = "dram"
    a.reconcile()
    other = TierEvents(store, BLOCK, PER, catalog_dir=tmp_path, hash_algo="xxhash")
    assert other.reconcile() == 0 and len(list(tmp_path.glob("*.jsonl"))) == 1


def test_a_request_with_an_adapter_a_salt_and_prompt_embeddings_is_announced_with_vllms_own_extra_keys(
    tmp_path, hash_seed
):
    """Chunks keyed under an identity are announced like vLLM announces its own blocks of that request: its
    block hashes, ``lora_name``, and per block the extra keys vLLM hashed (the same through the node's catalog)."""
    import torch
    from vllm.lora.request import LoRARequest
    from vllm.utils.hashing import get_hash_fn_by_name
    from vllm.v1.core.kv_cache_utils import (
        generate_block_hash_extra_keys,
        get_request_block_hasher,
        to_event_extra_keys,
    )
    from vllm_requests import vllm_request

    hasher = get_request_block_hasher(BLOCK, get_hash_fn_by_name("sha256"))
    embeds = torch.randn(2 * BLOCK * PER, 8, generator=torch.Generator().manual_seed(0))
    req = vllm_request([0] * 2 * BLOCK * PER, lora_request=LoRARequest("ad", 1, "/adapters/ad"),
                       cache_salt="alice", prompt_embeds=embeds, block_hasher=hasher)  # fmt: skip
    own = [generate_block_hash_extra_keys(req, b * BLOCK, (b + 1) * BLOCK, 0)[0] for b in range(2 * PER)]
    store, ks = FakeStore(), keys(2)
    a = TierEvents(store, BLOCK, PER, catalog_dir=tmp_path)
    a.note(req, ks, 2)
    store.tiers[ks[0][0]] = store.tiers[ks[0][1]] = "dram"
    a.reconcile()
    events = a.take()
    assert [e.lora_name for e in events] == ["ad", "ad"]
    assert [e.extra_keys for e in events] == [to_event_extra_keys(own[:PER]), to_event_extra_keys(own[PER:])]
    assert events[0].extra_keys[0][:2] == ("ad", "alice") and events[1].extra_keys[0][0] == "ad"  # salt: block 0
    assert events[0].block_hashes == [maybe_convert_block_hash(h) for h in req.block_hashes[:PER]]
    b = TierEvents(store, BLOCK, PER, catalog_dir=tmp_path)  # another engine of the node, through the catalog
    b.reconcile()
    assert b.take() == events


def test_a_hybrid_models_chunk_is_one_event_per_kv_cache_group():
    """A chunk holds every group's KV (issue 62): its store and its removal are announced for each group, under
    the group's index and kind, as vLLM announces its own blocks."""
    store, req, ks = FakeStore(), request(1), keys(1)
    ev = TierEvents(store, BLOCK, PER, groups=((0, "sliding_window"), (1, "full_attention")))
    ev.note(req, ks, 1)
    store.tiers[ks[0][0]] = "dram"
    ev.reconcile()
    stored = ev.take()
    assert [(e.group_idx, e.kv_cache_spec_kind) for e in stored] == [(0, "sliding_window"), (1, "full_attention")]
    assert stored[0].block_hashes == stored[1].block_hashes
    del store.tiers[ks[0][0]]
    ev.reconcile()
    assert [(type(e), e.group_idx) for e in ev.take()] == [(BlockRemoved, 0), (BlockRemoved, 1)]
