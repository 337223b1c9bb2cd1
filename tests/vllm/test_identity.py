"""A request's identity in its chunk keys (`kvprefetch.vllm.identity`), on vLLM's own `Request` objects: what vLLM
hashes into a block beyond its tokens (adapter, cache salt, multimodal items, prompt embeddings) separates chunk
keys the same way, the same identity keeps its keys (reuse), and what cannot be keyed is served without the tiers.
The engine tests (`test_vllm_identity.py`) check the answers; these check the keys and the scheduler's decisions."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from types import SimpleNamespace

import pytest

pytest.importorskip("vllm")

import torch
from fake_store import FakeStore
from vllm.lora.request import LoRARequest
from vllm.multimodal.inputs import MultiModalFeatureSpec, PlaceholderRange
from vllm_requests import vllm_request

from kvprefetch.keys import ChunkKeyer, KVNamespace
from kvprefetch.keys.namespace import KEY_SCHEME
from kvprefetch.vllm.identity import Identity, Untiered, adapter_fingerprint, request_identity
from kvprefetch.vllm.metrics import ConnectorCounters
from kvprefetch.vllm.scheduler import SchedulerSide
from kvprefetch.vllm.settings import parse_extra_config

CHUNK, BLOCK = 256, 128
KEYER = ChunkKeyer(KVNamespace(model="m", num_layers=2, num_kv_heads=1, head_dim=8, dtype="float32"), CHUNK)
TOKENS = list(range(1, 4 * CHUNK + 1))


def keys_of(request) -> list[bytes]:
    identity = request_identity(request, BLOCK)
    assert isinstance(identity, Identity), identity
    n = request.num_tokens // CHUNK
    extras = None if identity.plain else identity.chunk_extras(0, n, CHUNK)
    return KEYER.keys(list(request.all_token_ids), extras=extras)


def make_adapter(path: Path, seed: int) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    (path / "adapter_config.json").write_text(json.dumps({"r": 8, "lora_alpha": 16, "peft_type": "LORA"}))
    from safetensors.torch import save_file

    g = torch.Generator().manual_seed(seed)
    save_file({"base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight": torch.randn(8, 16, generator=g)},
              str(path / "adapter_model.safetensors"))  # fmt: skip
    return path


def image(identifier: str, offset: int, length: int = 64) -> MultiModalFeatureSpec:
    return MultiModalFeatureSpec(data=None, modality="image", identifier=identifier,
                                 mm_position=PlaceholderRange(offset=offset, length=length))  # fmt: skip


def test_a_plain_request_keys_its_tokens_alone():
    plain = keys_of(vllm_request(TOKENS))
    assert plain == KEYER.keys(TOKENS) and len(plain) == 4


def test_an_adapter_separates_every_chunk_from_the_base_and_from_other_adapters_and_keeps_its_own(tmp_path):
    a, b = make_adapter(tmp_path / "a", 1), make_adapter(tmp_path / "b", 2)
    base = keys_of(vllm_request(TOKENS))
    ad = keys_of(vllm_request(TOKENS, lora_request=LoRARequest("ad", 1, str(a))))
    other = keys_of(vllm_request(TOKENS, lora_request=LoRARequest("other", 2, str(b))))
    assert set(ad).isdisjoint(base) and set(ad).isdisjoint(other) and set(other).isdisjoint(base)
    # the same adapter again, under another per-process id, from a copy at another path (another node): its keys
    shutil.copytree(a, tmp_path / "copy")
    assert keys_of(vllm_request(TOKENS, lora_request=LoRARequest("ad", 7, str(tmp_path / "copy")))) == ad
    # the same weights under another name are another adapter (vLLM's own hashes name it too)
    assert set(keys_of(vllm_request(TOKENS, lora_request=LoRARequest("ad2", 1, str(a))))).isdisjoint(ad)


def test_an_adapter_name_rebound_to_other_weights_misses_and_an_unreadable_adapter_is_untiered(tmp_path):
    a = make_adapter(tmp_path / "a", 1)
    before = keys_of(vllm_request(TOKENS, lora_request=LoRARequest("ad", 1, str(a))))
    fingerprint = adapter_fingerprint(a)
    make_adapter(a, 3)  # rewritten in place: same name, same path, other weights
    assert adapter_fingerprint(a) != fingerprint
    assert set(keys_of(vllm_request(TOKENS, lora_request=LoRARequest("ad", 1, str(a))))).isdisjoint(before)
    shutil.rmtree(a)
    gone = request_identity(vllm_request(TOKENS, lora_request=LoRARequest("ad", 1, str(a))), BLOCK)
    assert isinstance(gone, Untiered) and gone.reason == "adapter_unreadable"


def test_a_cache_salt_separates_the_whole_chain_and_the_same_salt_reuses():
    alice = keys_of(vllm_request(TOKENS, cache_salt="alice"))
    bob = keys_of(vllm_request(TOKENS, cache_salt="bob"))
    plain = keys_of(vllm_request(TOKENS))
    assert set(alice).isdisjoint(bob) and set(alice).isdisjoint(plain)
    assert keys_of(vllm_request(TOKENS, cache_salt="alice")) == alice


def test_an_image_separates_the_chunks_from_its_own_on_and_keeps_the_shared_prefix():
    """Two images behind the same placeholder tokens at token 300 (chunk 1): chunk 0 is shared, chunks 1.. differ;
    the same image at another offset differs too; the same image again reuses."""
    cat, dog = keys_of(vllm_request(TOKENS, mm_features=[image("cat", 300)])), None
    dog = keys_of(vllm_request(TOKENS, mm_features=[image("dog", 300)]))
    assert cat[0] == dog[0] == KEYER.keys(TOKENS)[0]
    assert set(cat[1:]).isdisjoint(dog[1:])
    moved = keys_of(vllm_request(TOKENS, mm_features=[image("cat", 320)]))
    assert moved[0] == cat[0] and set(moved[1:]).isdisjoint(cat[1:])
    assert keys_of(vllm_request(TOKENS, mm_features=[image("cat", 300)])) == cat
    # an image across a chunk boundary (tokens 500-563) separates both chunks it covers
    across = keys_of(vllm_request(TOKENS, mm_features=[image("cat", 500)]))
    across_dog = keys_of(vllm_request(TOKENS, mm_features=[image("dog", 500)]))
    assert across[0] == across_dog[0] and across[1] != across_dog[1] and across[2] != across_dog[2]


def test_an_image_without_a_content_hash_is_untiered():
    r = vllm_request(TOKENS, mm_features=[image("", 300)])
    why = request_identity(r, BLOCK)
    assert isinstance(why, Untiered) and why.reason == "mm_unhashed"


def test_prompt_embeddings_of_one_length_are_told_apart_and_the_same_ones_reuse():
    g = torch.Generator().manual_seed(0)
    e1, e2 = torch.randn(len(TOKENS), 16, generator=g), torch.randn(len(TOKENS), 16, generator=g)
    zeros = [0] * len(TOKENS)  # (vLLM's token ids of an embeddings prompt)
    k1 = keys_of(vllm_request(zeros, prompt_embeds=e1))
    k2 = keys_of(vllm_request(zeros, prompt_embeds=e2))
    assert set(k1).isdisjoint(k2) and set(k1).isdisjoint(KEYER.keys(zeros))
    assert keys_of(vllm_request(zeros, prompt_embeds=e1.clone())) == k1
    # only the chunk whose embeddings differ and those after it change
    e3 = e1.clone()
    e3[3 * CHUNK + 5] += 1.0
    k3 = keys_of(vllm_request(zeros, prompt_embeds=e3))
    assert k3[:3] == k1[:3] and k3[3] != k1[3]


def test_something_vllm_hashes_that_kvprefetch_does_not_know_is_untiered(monkeypatch):
    """A vLLM outside the tested range that folds a new kind of extra key into its block hashes: such requests are
    served without the tiers, never keyed by their tokens alone. (vLLM's function is wrapped: the one thing here
    that stands in for a version that cannot be installed beside this one.)"""
    from vllm.v1.core import kv_cache_utils

    real = kv_cache_utils.generate_block_hash_extra_keys

    def newer(request, start, end, mm_idx):
        extra, idx = real(request, start, end, mm_idx)
        return (*(extra or ()), ("adapter_stack", "x")), idx

    monkeypatch.setattr(kv_cache_utils, "generate_block_hash_extra_keys", newer)
    why = request_identity(vllm_request(TOKENS), BLOCK)
    assert isinstance(why, Untiered) and why.reason == "unknown_extra_key" and "adapter_stack" in why.detail


def test_the_key_scheme_is_versioned_so_chunks_keyed_without_identity_read_as_misses():
    assert KEY_SCHEME == b"kvprefetch-ns-v2\0"
    import blake3

    ns = KEYER.namespace
    v1_digest = blake3.blake3(b"kvprefetch-ns-v1\0" + json.dumps(ns.model_dump(), sort_keys=True,
                                                                 separators=(",", ":")).encode()).digest()  # fmt: skip
    assert v1_digest != ns.digest


# ---- the scheduler side ------------------------------------------------------------------------------------------
def scheduler() -> tuple[SchedulerSide, FakeStore]:
    store = FakeStore()
    side = SchedulerSide(parse_extra_config({"save_policy": "all"}), KEYER, store, block_size=BLOCK, blocks_per_chunk=2,
                         chunk_bytes=1000, counters=ConnectorCounters("scheduler"),
                         get_block_ids=lambda rid: list(range(16)))  # fmt: skip
    return side, store


def test_the_scheduler_never_loads_another_identitys_chunks(tmp_path):
    """alice's chunks are in DRAM: bob (another salt), the base model and an adapter hit nothing; alice hits all."""
    side, store = scheduler()
    alice = vllm_request(TOKENS, cache_salt="alice")
    for k in keys_of(alice):
        store.tiers[k] = "dram"
    adapter = LoRARequest("ad", 1, str(make_adapter(tmp_path / "a", 1)))
    others = (vllm_request(TOKENS, cache_salt="bob"), vllm_request(TOKENS), vllm_request(TOKENS, lora_request=adapter))
    for other in others:
        side.on_new_request(other)
        assert side.get_num_new_matched_tokens(other, 0) == (0, False)
    again = vllm_request(TOKENS, cache_salt="alice")
    side.on_new_request(again)
    assert side.get_num_new_matched_tokens(again, 0) == (3 * CHUNK, False)  # (the last chunk: its last token)


def test_an_untiered_request_is_neither_looked_up_nor_saved_and_is_counted(tmp_path):
    side, store = scheduler()
    gone = LoRARequest("gone", 1, str(tmp_path / "no-such-adapter"))
    r = vllm_request(TOKENS, lora_request=gone)
    looked: list = []
    lookup = store.lookup
    store.lookup = lambda keys: looked.append(keys) or lookup(keys)
    side.on_new_request(r)
    assert side.get_num_new_matched_tokens(r, 0) == (0, False)
    side.update_state_after_alloc(r, [], 0)
    new = SimpleNamespace(req_id=r.request_id, num_computed_tokens=0)
    step = SimpleNamespace(scheduled_new_reqs=[new], scheduled_cached_reqs=SimpleNamespace(req_ids=[]),
                           num_scheduled_tokens={r.request_id: len(TOKENS)}, total_num_scheduled_tokens=len(TOKENS))
    meta = side.build_connector_meta(step)
    assert looked == [] and meta.saves == [] and meta.loads == []
    counts = side.counters.snapshot()
    assert counts["untiered_requests_adapter_unreadable"] == 1 and counts["saved_chunks"] == 0


def test_a_warm_up_under_one_salt_counts_and_leases_only_its_own_chunks():
    side, store = scheduler()
    for k in keys_of(vllm_request(TOKENS, cache_salt="alice")):
        store.tiers[k] = "dram"
    bob = side.warm(TOKENS, 30, "w-bob", Identity(cache_salt="bob"))
    alice = side.warm(TOKENS, 30, "w-alice", Identity(cache_salt="alice"))
    assert (bob.in_dram, bob.missing, bob.leased_keys) == (0, 4, 0)
    assert (alice.in_dram, alice.missing, alice.leased_keys) == (4, 0, 4)
