"""Small real checkpoints written by transformers (several shards and an index) for the loader's tests."""

from __future__ import annotations

import json
import shutil
import uuid
from pathlib import Path

import numpy as np
import pytest


def write_checkpoint(path: Path, layers: int = 2, hidden: int = 128, seed: int = 0, shards: int = 3) -> Path:
    """Llama-named random float32 tensors in several safetensors shards with a model.safetensors.index.json, as
    transformers lays them out (numpy only: importing transformers costs a minute on a loaded 2-core machine;
    the vLLM tests use a checkpoint transformers wrote)."""
    from safetensors.numpy import save_file

    rng = np.random.default_rng(seed)
    shapes = {"model.embed_tokens.weight": (1024, hidden)}
    h, kv, ff = hidden, hidden // 2, 2 * hidden
    per_layer = {"self_attn.q_proj": (h, h), "self_attn.k_proj": (kv, h), "self_attn.v_proj": (kv, h),
                 "self_attn.o_proj": (h, h), "mlp.gate_proj": (ff, h), "mlp.up_proj": (ff, h),
                 "mlp.down_proj": (h, ff), "input_layernorm": (h,), "post_attention_layernorm": (h,)}  # fmt: skip
    for i in range(layers):
        shapes |= {f"model.layers.{i}.{n}.weight": shape for n, shape in per_layer.items()}
    shapes |= {"model.norm.weight": (hidden,), "lm_head.weight": (1024, hidden)}
    names = list(shapes)
    path.mkdir(parents=True)
    weight_map, total = {}, 0
    for k in range(shards):
        part = names[k * len(names) // shards : (k + 1) * len(names) // shards]
        file = f"model-{k + 1:05d}-of-{shards:05d}.safetensors"
        tensors = {n: rng.standard_normal(shapes[n], dtype=np.float32) for n in part}
        save_file(tensors, str(path / file), metadata={"format": "pt"})
        weight_map |= dict.fromkeys(part, file)
        total += sum(t.nbytes for t in tensors.values())
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (path / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))
    (path / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLM"], "hidden_size": hidden}))
    return path


@pytest.fixture(scope="session")
def pristine(tmp_path_factory) -> Path:
    return write_checkpoint(tmp_path_factory.mktemp("ckpt") / "model")


@pytest.fixture(scope="session")
def other_model(tmp_path_factory) -> Path:
    """Another model with the same shard names: same architecture, other width, other weights."""
    return write_checkpoint(tmp_path_factory.mktemp("other") / "model", hidden=192, seed=1)


@pytest.fixture
def ckpt(pristine, tmp_path) -> Path:
    """A private copy of the pristine checkpoint, for a test to damage."""
    return Path(shutil.copytree(pristine, tmp_path / "model"))


@pytest.fixture
def cache_settings(tmp_path):
    """Loader settings with a weight cache in a temp dir and a private DRAM pool (removed afterwards)."""
    from kvprefetch.loader import LoaderSettings

    pool = f"kvpl-{uuid.uuid4().hex[:10]}"

    def make(restarted: bool = False, **kw) -> LoaderSettings:
        """restarted: the node's DRAM pool is gone (as after a reboot); only the disk cache is left."""
        if restarted:
            drop_pools(pool)
        # the pool outlives each load (keep_idle_s), as loadbench's and a serving node's does: the next load in
        # this process finds it warm
        dram = {"pool_name": pool, "capacity_bytes": "32MiB", "keep_idle_s": 600}
        cache = {"disk": {"path": str(tmp_path / "wcache")}, "dram": dram}
        return LoaderSettings.from_extra_config({"block_bytes": "256KiB", "cache": cache} | kw)

    yield make
    drop_pools(pool)


def drop_pools(name: str) -> None:
    for f in Path("/dev/shm").glob(f"*{name}*"):
        f.unlink(missing_ok=True)
