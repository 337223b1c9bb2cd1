"""Chunk keys: chained over the whole prefix, namespaced, stable across processes."""

import subprocess
import sys

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvprefetch.keys import ChunkKeyer, KVNamespace

NS = KVNamespace(model="m", num_layers=4, num_kv_heads=2, head_dim=64, dtype="bfloat16")
tokens = st.lists(st.integers(0, 200_000), min_size=0, max_size=200)


@given(tokens)
def test_only_whole_chunks_have_keys(toks):
    keyer = ChunkKeyer(NS, chunk_tokens=16)
    assert len(keyer.keys(toks)) == len(toks) // 16


@given(tokens, st.integers(0, 199), st.integers(1, 200_000))
def test_a_changed_token_changes_its_chunk_key_and_every_later_one(toks, pos, delta):
    keyer = ChunkKeyer(NS, chunk_tokens=8)
    if pos >= len(toks):
        return
    other = list(toks)
    other[pos] = (other[pos] + delta) % 200_001
    a, b = keyer.keys(toks), keyer.keys(other)
    first_changed = pos // 8
    assert a[:first_changed] == b[:first_changed]
    assert all(x != y for x, y in zip(a[first_changed:], b[first_changed:], strict=True))


def test_equal_chunks_after_different_prefixes_have_different_keys():
    keyer = ChunkKeyer(NS, chunk_tokens=4)
    a = keyer.keys([1, 2, 3, 4, 9, 9, 9, 9])
    b = keyer.keys([5, 6, 7, 8, 9, 9, 9, 9])
    assert a[1] != b[1]


def test_namespace_fields_and_tenant_separate_key_spaces():
    toks = list(range(64))
    base = ChunkKeyer(NS, 16).keys(toks)
    variants = [
        NS.model_copy(update={"model": "other"}),
        NS.model_copy(update={"dtype": "float16"}),
        NS.model_copy(update={"num_layers": 5}),
        NS.model_copy(update={"tp_rank": 1, "tp_size": 2}),
        NS.model_copy(update={"tenant": "acme"}),
    ]
    for ns in variants:
        assert set(ChunkKeyer(ns, 16).keys(toks)).isdisjoint(base), ns
    assert set(ChunkKeyer(NS, 32).keys(toks)).isdisjoint(base)  # chunk size is part of the key space too


def test_keys_are_stable_across_processes():
    """Never Python's salted hash(): another interpreter computes the same keys."""
    code = (
        "from kvprefetch.keys import ChunkKeyer, KVNamespace;"
        "ns=KVNamespace(model='m',num_layers=4,num_kv_heads=2,head_dim=64,dtype='bfloat16');"
        "print(ChunkKeyer(ns,16).keys(list(range(48)))[-1].hex())"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.strip()
    assert out == ChunkKeyer(NS, 16).keys(np.arange(48))[-1].hex()


def test_every_rank_has_keys_of_its_own():
    """Tensor parallelism: each rank stores its own part of a chunk under a key of its own."""
    toks = list(range(1024))
    ns = KVNamespace(model="m", num_layers=2, num_kv_heads=1, head_dim=8, dtype="float32", tp_size=2)
    keyers = ChunkKeyer(ns, 256).rank_keyers()
    assert [k.namespace.tp_rank for k in keyers] == [0, 1]
    k0, k1 = (k.keys(toks) for k in keyers)
    tp1 = ChunkKeyer(ns.model_copy(update={"tp_size": 1}), 256).keys(toks)
    assert len(set(k0) | set(k1) | set(tp1)) == 12  # no two ranks, nor TP=1 and TP=2, share a key
    assert ChunkKeyer(ns.for_rank(1), 256).rank_keyers()[0].keys(toks) == k0  # any rank derives them all
    with pytest.raises(ValueError, match="tp_rank 2 is not below tp_size 2"):
        ns.for_rank(2)
