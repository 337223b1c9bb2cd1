"""Never another request's KV, on real vLLM CPU engines: a request is served KV from the tiers only if it was computed
under the same identity (LoRA adapter, cache salt, image, prompt embeddings), and the same identity still reuses.

Every answer is compared with vLLM alone (same engine arguments, no connector): greedy tokens and logprobs. The
tiers' engine runs with vLLM's prefix cache off, so every token it does not compute comes from the tiers, counted
by the connector (`worker_loaded_chunks`, `hit_tokens_*`). Cases: an adapter after the base model and the base after
an adapter, two adapters on one prompt, the same adapter twice (hits); an adapter name rebound to other weights in
place across a restart (misses); an adapter whose files went away (served without the tiers, counted); bob after
alice and alice after alice; two prompt embeddings of one length; two images behind the same placeholder tokens
(the prefix before the image is still shared).

The engines run in this file's order and are closed at its end.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from kvprefetch.testbed.protocol import Completion, CountersReply, PromptIdentity

pytest.importorskip("vllm")

from test_vllm_exactness import TOL, assert_same
from tests.adapters import make_adapter, model_config

from conftest import CHUNK, prompt

pytestmark = [pytest.mark.slow, pytest.mark.engine]

LEN = 4 * CHUNK + 76  # four whole chunks and a tail the engine always computes
N = 4  # whole chunks: every one reusable (the tail's last token is always computed)


@pytest.fixture(scope="module", autouse=True)
def close_identity_engines(engines):
    yield
    for name in ("id_tiers", "id_tiers_restarted", "id_reference", "vlm_tiers", "vlm_reference"):
        engines.close(name)


@pytest.fixture(scope="module")
def adapters(tmp_path_factory, model_dir) -> Path:
    root = tmp_path_factory.mktemp("adapters")
    for name, seed in (("ad", 1), ("ad2", 2), ("gone", 3)):
        make_adapter(root / name, model_config(model_dir), seed)
    return root


def lora(adapters: Path, name: str, as_name: str | None = None) -> PromptIdentity:
    return PromptIdentity(lora_name=as_name or name, lora_path=str(adapters / name))


def run(e, p: list[int], who: PromptIdentity | None) -> Completion:
    return e.generate([p], identities=[who])[0]


def delta(after: CountersReply, before: CountersReply) -> dict[str, int]:
    return {k: after.counters[k] - before.counters[k] for k in after.counters}


def served(e, p: list[int], who: PromptIdentity | None, reference: Completion) -> dict[str, int]:
    """Run p under `who` on the tiers' engine: its answer must be vLLM alone's; what the connector counted."""
    before = e.counters()
    assert_same(run(e, p, who), reference)
    assert e.flush()
    return delta(e.counters(), before)


def differs(a: Completion, b: Completion) -> bool:
    """Two answers that no loaded KV could pass off as each other (tokens, or logprobs beyond the tolerance)."""
    return a.token_ids != b.token_ids or max(abs(x - y) for x, y in zip(a.logprobs, b.logprobs, strict=True)) > TOL


def loaded_tokens(d: dict[str, int]) -> int:
    return sum(d[f"hit_tokens_{t}"] for t in ("dram", "disk", "remote"))


def test_the_adapters_change_the_answer(engines, adapters):
    """(The cases below would prove nothing if an adapter left the tiny model's answer as the base model's.)"""
    ref = engines.get("id_reference")
    p = prompt(3001, LEN)
    outs = [run(ref, p, who).token_ids for who in (None, lora(adapters, "ad"), lora(adapters, "ad2"))]
    assert outs[0] != outs[1] and outs[0] != outs[2] and outs[1] != outs[2]


def test_an_adapter_after_the_base_model_and_the_base_after_an_adapter_load_nothing(engines, adapters):
    ref, e = engines.get("id_reference"), engines.get("id_tiers")
    ad = lora(adapters, "ad")
    p, q = prompt(3002, LEN), prompt(3003, LEN)
    assert served(e, p, None, run(ref, p, None))["saved_chunks"] == N
    d = served(e, p, ad, run(ref, p, ad))  # the base model's chunks are in DRAM: none is the adapter's
    assert d["worker_loaded_chunks"] == 0 and loaded_tokens(d) == 0 and d["saved_chunks"] == N, d
    assert served(e, q, ad, run(ref, q, ad))["saved_chunks"] == N
    d = served(e, q, None, run(ref, q, None))
    assert d["worker_loaded_chunks"] == 0 and loaded_tokens(d) == 0, d


def test_two_adapters_on_one_prompt_never_share_and_the_same_adapter_reuses(engines, adapters):
    ref, e = engines.get("id_reference"), engines.get("id_tiers")
    ad, ad2 = lora(adapters, "ad"), lora(adapters, "ad2")
    p = prompt(3004, LEN)
    served(e, p, ad, run(ref, p, ad))
    d = served(e, p, ad2, run(ref, p, ad2))
    assert d["worker_loaded_chunks"] == 0 and loaded_tokens(d) == 0, d
    d = served(e, p, ad, run(ref, p, ad))  # the same adapter again: every whole chunk from the tiers
    assert d["worker_loaded_chunks"] == N and loaded_tokens(d) == N * CHUNK, d


def test_bob_never_gets_alices_kv_and_alice_gets_her_own(engines):
    ref, e = engines.get("id_reference"), engines.get("id_tiers")
    alice, bob = PromptIdentity(cache_salt="alice"), PromptIdentity(cache_salt="bob")
    p = prompt(3005, LEN)
    reference = run(ref, p, None)  # (a salt changes what may be reused, never the answer)
    assert served(e, p, alice, reference)["saved_chunks"] == N
    for other in (bob, None):
        d = served(e, p, other, reference)
        assert d["worker_loaded_chunks"] == 0 and loaded_tokens(d) == 0, (other, d)
    d = served(e, p, alice, reference)
    assert d["worker_loaded_chunks"] == N and loaded_tokens(d) == N * CHUNK, d


def test_two_prompt_embeddings_of_one_length_never_share(engines, tmp_path):
    """Their token ids are all 0: keyed by tokens alone they would be one prompt."""
    import torch
    from safetensors.torch import save_file

    ref, e = engines.get("id_reference"), engines.get("id_tiers")
    files = []
    for seed in (1, 2):
        embeds = torch.randn(LEN, 256, generator=torch.Generator().manual_seed(seed)) * 0.02
        save_file({"embeds": embeds}, str(tmp_path / f"e{seed}.safetensors"))
        files.append(PromptIdentity(embeds_file=str(tmp_path / f"e{seed}.safetensors")))
    e1, e2 = files
    r1, r2 = run(ref, [], e1), run(ref, [], e2)
    assert differs(r1, r2)
    assert served(e, [], e1, r1)["saved_chunks"] == N
    d = served(e, [], e2, r2)
    assert d["worker_loaded_chunks"] == 0 and loaded_tokens(d) == 0, d
    d = served(e, [], e1, r1)
    assert d["worker_loaded_chunks"] == N and loaded_tokens(d) == N * CHUNK, d


def test_an_adapter_whose_files_went_away_is_served_without_the_tiers(engines, adapters):
    """vLLM still holds the adapter it loaded, but the connector can no longer fingerprint it: the request is
    computed (not loaded on a guess), saved nowhere, and counted."""
    ref, e = engines.get("id_reference"), engines.get("id_tiers")
    gone = lora(adapters, "gone")
    p = prompt(3006, LEN)
    reference = run(ref, p, gone)
    served(e, p, gone, reference)  # computed and saved while its files are there
    shutil.rmtree(adapters / "gone")
    d = served(e, p, gone, reference)
    assert d["untiered_requests_adapter_unreadable"] == 1, d
    assert d["worker_loaded_chunks"] == 0 and d["saved_chunks"] == 0 and d["prefetched_chunks"] == 0, d


def test_an_adapter_rebound_to_other_weights_across_a_restart_misses(engines, adapters, tmp_path):
    """The adapter "ad" computes a prompt (saved to disk); the server restarts with "ad" rewritten in place (same
    name, same path, other weights): nothing saved under the old weights is loaded."""
    ref, e = engines.get("id_reference"), engines.get("id_tiers")
    ad = lora(adapters, "ad")
    p = prompt(3007, LEN)
    served(e, p, ad, run(ref, p, ad))
    engines.close("id_tiers")
    make_adapter(adapters / "ad", model_config(engines.model_dir), seed=11)  # rebound: other weights, same path
    shutil.copytree(adapters / "ad", adapters / "ad-v2")  # (vLLM alone holds the old "ad": the new one by another name)
    reference = run(ref, p, lora(adapters, "ad-v2"))
    d = served(engines.get("id_tiers_restarted"), p, ad, reference)
    assert d["worker_loaded_chunks"] == 0 and loaded_tokens(d) == 0 and d["prefetched_chunks"] == 0, d


def test_two_images_behind_the_same_placeholder_tokens_never_share_kv(engines, tmp_path):
    """A tiny vision-language model (Idefics3): one image after 300 tokens, so chunk 0 holds no image. Another image
    behind the same tokens reuses chunk 0 and computes the rest; the same image again reuses every chunk."""
    from tests.tiny_vlm import FIRST_WORD_ID, IMAGE, PLACEHOLDER_IDS, make_image

    ref, e = engines.get("vlm_reference"), engines.get("vlm_tiers")
    words = [FIRST_WORD_ID + i % 1500 for i in range(300 + 700)]
    tokens = [*words[:300], IMAGE, *words[300:]]  # the engine's prompt: 300 + 19 + 700 tokens
    length = len(tokens) - 1 + len(PLACEHOLDER_IDS)
    saved, n = (length + 7) // CHUNK, (length - 1) // CHUNK  # (8 tokens out: 7 computed); 3 whole chunks reusable
    images = []
    for seed in (1, 2):
        make_image(seed).save(tmp_path / f"i{seed}.png")
        images.append(PromptIdentity(image_file=str(tmp_path / f"i{seed}.png")))
    cat, dog = images
    r_cat, r_dog = run(ref, tokens, cat), run(ref, tokens, dog)
    assert differs(r_cat, r_dog)
    assert served(e, tokens, cat, r_cat)["saved_chunks"] == saved
    d = served(e, tokens, dog, r_dog)
    assert d["worker_loaded_chunks"] == 1 and loaded_tokens(d) == CHUNK, d  # chunk 0 only: before the image
    d = served(e, tokens, cat, r_cat)
    assert d["worker_loaded_chunks"] == n and loaded_tokens(d) == n * CHUNK, d
