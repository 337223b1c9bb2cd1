"""`kvprefetch bench --model NAME`: the packaged tiny models by name (issue 62), with their KV bytes per token."""

from __future__ import annotations

import pytest

from kvprefetch.bench.plan import resolve_model


@pytest.mark.parametrize("name,folder,per_token", [
    ("kvprefetch-tiny", "tiny-llama", 2 * 4 * 2 * 64 * 4),  # K and V, 4 layers x 2 KV heads x 64, float32
    ("kvprefetch-tiny-hybrid", "tiny-gemma3", 2 * 4 * 2 * 64 * 4),  # sliding layers count in full: a chunk holds them
    ("kvprefetch-tiny-mla", "tiny-deepseek-v2", 4 * (512 + 64) * 4),  # one latent (512 + rotary 64) a layer
])  # fmt: skip
def test_a_packaged_model_by_name(name, folder, per_token):
    info = resolve_model(name, {})
    assert info.path.endswith(folder) and info.load_format == "dummy" and info.bytes_per_token == per_token
