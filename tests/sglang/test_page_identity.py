"""A request's identity in SGLang's page keys: the keys SGLang hands a storage backend for one token sequence under
several identities (LoRA adapter, extra_key, cache_salt) stay apart, on the write path (the default Rust tree core's
node hashes) and the read path (`get_storage_hash_str`, as `HybridCacheController._storage_hit_query` computes them),
and our backend keeps them apart; an SGLang whose keys do not carry the identity is refused."""

from __future__ import annotations

from array import array

import pytest
import torch

from kvprefetch.sglang.backend import check_page_keys_carry_identity
from kvprefetch.sglang.host_pages import PageGeometry
from kvprefetch.sglang.hostpool import host_pool
from tests.sglang.conftest import page_content

utils = pytest.importorskip("sglang.srt.mem_cache.utils")


class Key:
    """The fields of SGLang's RadixKey that its storage hash reads (RadixKey's module does not import on a CPU
    machine: its import chain needs torchvision)."""

    def __init__(self, token_ids, extra_key=None, cache_salt=None):
        self.token_ids, self.extra_key, self.cache_salt, self.is_bigram = token_ids, extra_key, cache_salt, False

    def __len__(self):
        return len(self.token_ids)


LORA = "5b0e0c3fa9c44f51a3d1e2b64f7a1c90"  # a LoRARef.lora_id: 32 hex digits
# (extra_key, cache_salt) as Req builds them: extra_key = (extra_key or "") + lora_id (schedule_batch.py:1165)
IDENTITIES = {
    "base": (None, None),
    "lora": (LORA, None),
    "other lora": ("0" * 32, None),
    "extra_key": ("x", None),
    "extra_key+lora": ("x" + LORA, None),
    "salt": (None, "tenant-a"),
    "other salt": (None, "tenant-b"),
    "lora+salt": (LORA, "tenant-a"),
    "empty salt is no salt": (None, None),
}


def read_path_keys(tokens, ns, page):  # HybridCacheController._storage_hit_query from the root
    return utils.get_storage_hash_str(Key(tokens, *ns), None, page_size=page)


def write_path_keys(tokens, ns, page):  # the Rust TreeCore's node hashes (SGLang's default tree core)
    rc = pytest.importorskip("sglang.srt.mem_cache.rust_tree_core.mem_cache")
    core = rc.RustUnifiedTreeCoreBinding(rc.TreeCoreInitParamsBinding(eviction_policy="lru", page_size=page,
                                                                       device="cpu"), [0])  # FULL only
    core.set_enable_storage(True)
    core.begin_insert(rc.InsertParamsBinding(key=tokens, value=torch.arange(len(tokens)), extra_key=ns[0],
                                             cache_salt=ns[1]))
    core.end_insert()
    node = core.match_prefix(rc.MatchParamsBinding(key=tokens, extra_key=ns[0], cache_salt=ns[1])).last_device_node_id
    return core.get_prefix_hash_values(node) + core.get_hash_values(node)


def test_sglang_gives_each_identity_its_own_page_keys(backends):
    pool = host_pool()
    page, n = pool.page_size, PageGeometry.of(pool).page_bytes
    tokens = array("q", range(100, 100 + 4 * page))
    keys = {}
    for name, ns in IDENTITIES.items():
        read = read_path_keys(tokens, ns, page)
        assert write_path_keys(tokens, ns, page) == read, name  # backup and prefetch name a page alike
        # a prefetch anchored mid-sequence continues the chain from the anchor's last hash
        assert utils.get_storage_hash_str(Key(tokens[2 * page:], *ns), read[1], page_size=page) == read[2:], name
        keys[name] = read
    distinct = {k for name, ks in keys.items() if name != "empty salt is no salt" for k in ks}
    assert len(distinct) == 4 * (len(IDENTITIES) - 1)  # no page key shared by two identities
    assert keys["base"] == utils.get_hash_str(tokens, None, page_size=page)  # the base model's keys are unseeded

    ours = backends(pool)
    idx = pool.alloc(4 * page)
    for i in range(4):
        pool.set_from_flat_data_page(int(idx[i * page]), page_content(f"lora{i}", n))
    assert ours.batch_set_v1(keys["lora"], idx) == [True] * 4
    assert ours.batch_exists(keys["lora"]) == 4
    for name, ks in keys.items():
        if name != "lora":
            assert ours.batch_exists(ks) == 0, name
            assert ours.batch_get_v1(ks, idx) == [False] * 4, name


def test_a_base_model_extra_key_equal_to_an_adapters_id_aliases_it():
    """Known SGLang limitation (sgl-project/sglang#24638, unfixed in 0.5.23): Req concatenates extra_key and
    lora_id, so a base-model request whose extra_key is "x"+lora_id gets the adapter's namespace: the radix tree's
    and the storage's. Pinned here so an SGLang that fixes it shows up."""
    page = 16
    tokens = array("q", range(64))
    lora_request = ("x" + LORA, None)  # extra_key="x", lora_id=LORA, after schedule_batch.py:1165
    crafted_base_request = ("x" + LORA, None)  # extra_key="x"+LORA, no adapter
    assert read_path_keys(tokens, lora_request, page) == read_path_keys(tokens, crafted_base_request, page)


def test_an_sglang_whose_page_keys_are_tokens_alone_is_refused(backends, monkeypatch):
    """Before sgl-project/sglang#38577 storage keys were the tokens' alone: such an SGLang cannot keep identities
    apart in tiers that outlive it, so the backend refuses to start, saying why. (The function is removed here:
    the one thing that stands in for an SGLang version that cannot be installed beside this one.)"""
    check_page_keys_carry_identity()  # this SGLang's keys carry it
    monkeypatch.delattr(utils, "storage_namespace_seed")
    with pytest.raises(RuntimeError, match="do not carry a request's extra_key"):
        backends(host_pool())
