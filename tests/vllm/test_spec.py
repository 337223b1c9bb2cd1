"""`spec.py`: the connector built from vLLM's config, and what it refuses at start-up."""

from __future__ import annotations

from types import SimpleNamespace

import pytest


def test_pipeline_parallelism_is_refused_by_name():
    from kvprefetch.vllm.spec import check_parallelism

    check_parallelism(SimpleNamespace(pipeline_parallel_size=1, tensor_parallel_size=8))
    with pytest.raises(NotImplementedError, match="pipeline_parallel_size=2"):
        check_parallelism(SimpleNamespace(pipeline_parallel_size=2, tensor_parallel_size=1))


def vllm_configs(tmp_path, pool: str, block_size: int = 16, chunk_tokens: int = 24, tp_size: int = 1):
    """The parts of vLLM's configs the connector reads (vLLM's side, faked): a 2-layer model with one KV head of
    8 float32 values (K and V: 64 B a token)."""
    extra = {"chunk_tokens": chunk_tokens, "log_interval_s": 0, "dram": {"capacity_bytes": 1 << 20, "pool_name": pool},
             "disk": {"path": str(tmp_path / "disk"), "fsync": False}}  # fmt: skip
    transfer = SimpleNamespace(kv_connector_extra_config=extra, kv_load_failure_policy="fail", engine_id=None)
    vllm_config = SimpleNamespace(
        parallel_config=SimpleNamespace(pipeline_parallel_size=1, tensor_parallel_size=tp_size),
        kv_transfer_config=transfer,
        model_config=SimpleNamespace(model="tiny", revision=None),
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
    assert (spec.geo.blocks_per_chunk, spec.geo.chunk_bytes) == (3, 2 * 48 * 64)
    assert spec.is_scheduler and spec.rank == 0 and spec.layer_names == ("layers.0.attn", "layers.1.attn")
    assert spec.namespace.model == "tiny@main" and spec.namespace.dtype == "float32"
    assert spec.keyer.chunk_tokens == 48 and len(spec.keyer.keys(list(range(100)))) == 2
    use_load_failure_policy(vllm_config.kv_transfer_config, spec.settings)
    assert vllm_config.kv_transfer_config.kv_load_failure_policy == "recompute"  # a failed chunk is a miss


def test_each_half_is_built_over_a_store_of_the_specs_chunk_size(tmp_path):
    import uuid

    from kvprefetch.vllm.compat import KVConnectorRole
    from kvprefetch.vllm.metrics import ConnectorCounters
    from kvprefetch.vllm.spec import build_scheduler, build_worker, connector_spec

    pool = f"kvpt-{uuid.uuid4().hex[:8]}"
    vllm_config, kv_cache_config = vllm_configs(tmp_path, pool)
    spec = connector_spec(vllm_config, KVConnectorRole.SCHEDULER, kv_cache_config)
    half = build_scheduler(spec, ConnectorCounters("scheduler"), lambda _req_id: [])
    try:
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
