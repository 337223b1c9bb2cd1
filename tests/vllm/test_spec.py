"""`spec.py`: the connector built from vLLM's config, and what it refuses at start-up."""

from __future__ import annotations

from types import SimpleNamespace

import pytest


def test_pipeline_parallelism_is_refused_by_name():
    from kvprefetch.vllm.spec import check_parallelism

    check_parallelism(SimpleNamespace(pipeline_parallel_size=1, tensor_parallel_size=8))
    with pytest.raises(NotImplementedError, match="pipeline_parallel_size=2"):
        check_parallelism(SimpleNamespace(pipeline_parallel_size=2, tensor_parallel_size=1))


def vllm_configs(tmp_path, pool: str, block_size: int = 16, chunk_tokens: int = 24, tp_size: int = 1,
                 max_model_len: int = 4096):  # fmt: skip
    """The parts of vLLM's configs the connector reads (vLLM's side, faked): a 2-layer model with one KV head of
    8 float32 values (K and V: 64 B a token)."""
    extra = {"chunk_tokens": chunk_tokens, "log_interval_s": 0, "dram": {"capacity_bytes": 1 << 20, "pool_name": pool},
             "disk": {"path": str(tmp_path / "disk"), "fsync": False}}  # fmt: skip
    transfer = SimpleNamespace(kv_connector_extra_config=extra, kv_load_failure_policy="fail", engine_id=None)
    vllm_config = SimpleNamespace(
        parallel_config=SimpleNamespace(pipeline_parallel_size=1, tensor_parallel_size=tp_size),
        kv_transfer_config=transfer,
        model_config=SimpleNamespace(model="tiny", revision=None, max_model_len=max_model_len),
        cache_config=SimpleNamespace(cache_dtype="auto"),
    )
    attention = SimpleNamespace(block_size=block_size, page_size_bytes=64 * block_size, num_kv_heads=1, head_size=8,
                                dtype="torch.float32")  # fmt: skip
    group = SimpleNamespace(kv_cache_spec=attention, layer_names=["layers.0.attn", "layers.1.attn"])
    return vllm_config, SimpleNamespace(kv_cache_groups=[group], num_blocks=32)


def test_a_spec_keys_whole_blocks_of_this_model(tmp_path, caplog):
    from kvprefetch.vllm.compat import KVConnectorRole
    from kvprefetch.vllm.spec import connector_spec, use_load_failure_policy

    vllm_config, kv_cache_config = vllm_configs(tmp_path, "unused")
    spec = connector_spec(vllm_config, KVConnectorRole.SCHEDULER, kv_cache_config)
    assert spec.chunk_tokens == 48 and "using 48" in caplog.text  # 24 tokens is not whole 16-token blocks
    assert spec.settings.chunk_tokens == 24  # what was asked, beside what is used
    assert (spec.geo.blocks_per_chunk, spec.geo.chunk_bytes) == (3, 2 * 48 * 64)
    assert spec.is_scheduler and spec.rank == 0 and spec.layer_names == ("layers.0.attn", "layers.1.attn")
    assert spec.namespace.model == "tiny@main" and spec.namespace.dtype == "float32"
    assert spec.keyer.chunk_tokens == 48 and len(spec.keyer.keys(list(range(100)))) == 2
    use_load_failure_policy(vllm_config.kv_transfer_config, spec.settings)
    assert vllm_config.kv_transfer_config.kv_load_failure_policy == "recompute"  # a failed chunk is a miss


def test_each_half_is_built_over_a_store_of_the_specs_chunk_size(tmp_path, caplog):
    import logging
    import uuid

    from kvprefetch.vllm.compat import KVConnectorRole
    from kvprefetch.vllm.metrics import ConnectorCounters
    from kvprefetch.vllm.spec import build_scheduler, build_worker, connector_spec

    pool = f"kvpt-{uuid.uuid4().hex[:8]}"
    vllm_config, kv_cache_config = vllm_configs(tmp_path, pool)
    spec = connector_spec(vllm_config, KVConnectorRole.SCHEDULER, kv_cache_config)
    with caplog.at_level(logging.INFO, logger="kvprefetch.vllm"):
        half = build_scheduler(spec, ConnectorCounters("scheduler"), lambda _req_id: [])
    try:
        assert "scheduler side up (chunk_tokens 48 (configured 24, as whole 16-token blocks) = 6144 B" in caplog.text
        assert half.side.store is half.store and half.store.stats()["chunk_bytes"] == spec.geo.chunk_bytes
        assert half.side.blocks_per_chunk == 3 and half.side.chunk_tokens == 48
        assert half.warm_server is None  # no engine id: no warm-up socket
        worker = build_worker(spec, ConnectorCounters("worker"), kv_cache_config)
        assert (worker.num_blocks, worker.chunk_tokens, worker.store) == (32, 48, None)  # opens with the caches
        with pytest.raises(RuntimeError, match="unexpected KV page layout"):
            worker.open_store(spec.geo.chunk_bytes + 64)
    finally:
        half.reporter.close()
        half.store.close()
        half.store.dram.path.unlink(missing_ok=True)


def test_chunk_tokens_is_rounded_once_and_said_once(caplog):
    """`whole_blocks` is the one rounding: whole blocks pass unchanged and silently; another value becomes the
    least common multiple (as since the first release: old configs keep their keys), with one warning naming
    both values and the block size."""
    import logging

    from kvprefetch.vllm.spec import whole_blocks

    with caplog.at_level(logging.WARNING, logger="kvprefetch.vllm"):
        assert whole_blocks(256, 16, 4096) == 256 and whole_blocks(256, 128, None) == 256
        assert not caplog.records
        assert whole_blocks(64, 128, 4096) == 128 and whole_blocks(96, 64, 4096) == 192
    assert [r.getMessage() for r in caplog.records] == [
        "kvprefetch: chunk_tokens 64 is not a multiple of vLLM's KV block size 128; using 128 (their least common "
        "multiple; set chunk_tokens to a multiple of 128 to choose it)",
        "kvprefetch: chunk_tokens 96 is not a multiple of vLLM's KV block size 64; using 192 (their least common "
        "multiple; set chunk_tokens to a multiple of 64 to choose it)",
    ]


@pytest.mark.parametrize(
    ("chunk_tokens", "words"),
    [
        (8192, ["a chunk of 8192 tokens is longer than max_model_len 4096", "multiple of 16 from 16 to 4096"]),
        (4090, ["a chunk of 32720 tokens (chunk_tokens 4090 as whole 16-token blocks)", "max_model_len 4096"]),
    ],
)
def test_a_chunk_no_request_can_fill_is_refused_at_construction(tmp_path, chunk_tokens, words):
    """Refused with the reason when the connector is built (each half builds its spec), before any store opens:
    a chunk longer than the engine's longest request would never be saved nor loaded."""
    from kvprefetch.vllm.compat import KVConnectorRole
    from kvprefetch.vllm.spec import connector_spec

    vllm_config, kv_cache_config = vllm_configs(tmp_path, "unused", chunk_tokens=chunk_tokens)
    with pytest.raises(ValueError) as err:
        connector_spec(vllm_config, KVConnectorRole.WORKER, kv_cache_config)
    assert all(w in str(err.value) for w in words), str(err.value)
    fits, _ = vllm_configs(tmp_path, "unused", chunk_tokens=4096)  # the longest request is one whole chunk
    assert connector_spec(fits, KVConnectorRole.SCHEDULER, kv_cache_config).chunk_tokens == 4096


@pytest.mark.parametrize(("published", "tier_events", "announced"),
                         [(True, True, True), (True, False, False), (False, True, False)])  # fmt: skip
def test_the_tiers_join_vllms_kv_events_only_when_vllm_publishes_and_tier_events_is_on(
    tmp_path, published, tier_events, announced
):
    """`tier_events: false` leaves vLLM's stream to its own GPU blocks (what a router fed by engine events alone
    sees: the cluster-serve bench's kv-gpu mode)."""
    from kvprefetch.vllm.compat import KVConnectorRole
    from kvprefetch.vllm.spec import connector_spec

    vllm_config, kv_cache_config = vllm_configs(tmp_path, "unused")
    vllm_config.kv_transfer_config.kv_connector_extra_config["tier_events"] = tier_events
    vllm_config.kv_events_config = SimpleNamespace(enable_kv_cache_events=published)
    assert connector_spec(vllm_config, KVConnectorRole.SCHEDULER, kv_cache_config).kv_events is announced


def hybrid_cache_config(*extra_groups):
    """vLLM's KV cache config of a sliding-window hybrid (real specs): a 20-token window group, a full group."""
    import torch
    from vllm.v1.kv_cache_interface import FullAttentionSpec, SlidingWindowSpec

    kw = {"block_size": 16, "num_kv_heads": 1, "head_size": 8, "dtype": torch.float32}
    groups = [SimpleNamespace(kv_cache_spec=SlidingWindowSpec(sliding_window=20, **kw), layer_names=["l.0", "l.1"]),
              SimpleNamespace(kv_cache_spec=FullAttentionSpec(**kw), layer_names=["l.2"]), *extra_groups]  # fmt: skip
    return SimpleNamespace(kv_cache_groups=groups, num_blocks=32)


def test_a_hybrid_spec_holds_every_group_under_keys_of_its_own(tmp_path):
    from kvprefetch.vllm.compat import KVConnectorRole
    from kvprefetch.vllm.spec import connector_spec

    vllm_config, one_group = vllm_configs(tmp_path, "unused", chunk_tokens=32)
    spec = connector_spec(vllm_config, KVConnectorRole.SCHEDULER, hybrid_cache_config())
    assert spec.layer_names == ("l.0", "l.1", "l.2") and spec.groups.layer_groups == (0, 0, 1)
    assert [(g.kind, g.window) for g in spec.groups.groups] == [("sliding_window", 19), ("full_attention", None)]
    assert spec.geo.chunk_bytes == 3 * 2 * 1024  # every group's layers
    assert "groups=sliding_window/w19x2+full_attentionx1" in spec.namespace.layout
    assert "groups=" not in connector_spec(vllm_config, KVConnectorRole.SCHEDULER, one_group).namespace.layout


def test_a_group_it_cannot_serve_is_refused_at_start_by_its_kind(tmp_path):
    import torch
    from vllm.v1.kv_cache_interface import MambaSpec

    from kvprefetch.vllm.compat import KVConnectorRole
    from kvprefetch.vllm.spec import connector_spec

    vllm_config, _ = vllm_configs(tmp_path, "unused", chunk_tokens=32)
    mamba = SimpleNamespace(kv_cache_spec=MambaSpec(block_size=16, shapes=((4,),), dtypes=(torch.float32,)),
                            layer_names=["l.3.mixer"])  # fmt: skip
    with pytest.raises(NotImplementedError, match="group 2 of kind 'mamba'"):
        connector_spec(vllm_config, KVConnectorRole.SCHEDULER, hybrid_cache_config(mamba))


def test_mla_at_tp2_is_one_copy_for_every_rank(tmp_path, monkeypatch):
    """MLA's latent KV is the same on every rank: every rank keys its chunks as rank 0 (one copy on disk, loaded by
    all); a model whose ranks hold other heads keeps a part per rank."""
    import torch
    from vllm.v1.kv_cache_interface import MLAAttentionSpec

    import kvprefetch.vllm.spec as spec_mod
    from kvprefetch.vllm.compat import KVConnectorRole

    monkeypatch.setattr(spec_mod, "_tp_rank", lambda: 1)
    vllm_config, per_head = vllm_configs(tmp_path, "unused", chunk_tokens=32, tp_size=2)
    latent = MLAAttentionSpec(block_size=16, num_kv_heads=1, head_size=576, dtype=torch.float32)
    mla = SimpleNamespace(kv_cache_groups=[SimpleNamespace(kv_cache_spec=latent, layer_names=["l.0", "l.1"])],
                          num_blocks=32)  # fmt: skip
    sched = spec_mod.connector_spec(vllm_config, KVConnectorRole.SCHEDULER, mla)
    worker = spec_mod.connector_spec(vllm_config, KVConnectorRole.WORKER, mla)
    assert sched.replicated and worker.replicated and worker.rank == 1 and worker.namespace.tp_rank == 0
    assert worker.keyer.keys(list(range(64))) == sched.keyer.keys(list(range(64)))
    heads = spec_mod.connector_spec(vllm_config, KVConnectorRole.WORKER, per_head)
    assert not heads.replicated and heads.namespace.tp_rank == 1
