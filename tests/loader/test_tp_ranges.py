"""Tensor parallelism 2 in real vLLM (two processes, one gloo group, the model built and loaded on each rank):
each rank's parameters are byte-identical to vLLM's default loader's on that rank, and each rank reads only
part of the checkpoint (the column-parallel weights and the vocabulary are split between the ranks), the
parts together covering every byte; without per-rank ranges each rank reads everything."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import uuid
from pathlib import Path

import pytest

from tests.loader.conftest import write_checkpoint

pytest.importorskip("vllm")

pytestmark = [pytest.mark.slow, pytest.mark.engine]

MARK = "@@LOAD "


def vllm_checkpoint(path: Path) -> Path:
    """conftest's Llama-named checkpoint (2 layers, hidden 256, 4 heads of 64, 2 KV heads) with a config vLLM
    builds the model from."""
    write_checkpoint(path, layers=2, hidden=256)
    config = {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 1024, "hidden_size": 256,
        "intermediate_size": 512, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
        "head_dim": 64, "max_position_embeddings": 2048, "rms_norm_eps": 1e-5, "rope_theta": 10000.0,
        "torch_dtype": "float32", "tie_word_embeddings": False, "hidden_act": "silu",
    }  # fmt: skip
    (path / "config.json").write_text(json.dumps(config))
    return path


def run_tp2(loads: list[dict], tmp_path: Path) -> list[list[dict]]:
    """Both ranks' results of the loads, run in turn in one process per rank."""
    ident = f"kvpl-tp-{uuid.uuid4().hex[:10]}"  # vLLM names the group's shared memory after the rendezvous file
    try:
        return _run_tp2(loads, f"file://{tmp_path / ident}")
    finally:
        for f in Path("/dev/shm").glob(f"{ident}*"):
            f.unlink(missing_ok=True)


def spawn_rank(rank: int, loads: list[dict], init: str) -> subprocess.Popen:
    spec = {"loads": loads, "tp": {"rank": rank, "size": 2, "init": init}}
    env = dict(os.environ, VLLM_LOGGING_LEVEL="WARNING")
    cmd = [sys.executable, "-m", "kvprefetch.loader.harness", json.dumps(spec)]
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)


def _run_tp2(loads: list[dict], init: str) -> list[list[dict]]:
    procs = [spawn_rank(rank, loads, init) for rank in (0, 1)]
    out = []
    for p in procs:
        stdout, stderr = p.communicate(timeout=600)
        lines = [ln for ln in stdout.splitlines() if ln.startswith(MARK)]
        assert lines, stderr[-3000:]
        res = json.loads(lines[-1][len(MARK) :])
        assert isinstance(res, list), res
        out.append(res)
    return out


def test_tp2_ranks_read_only_their_byte_ranges_and_load_the_default_loaders_bytes(tmp_path):
    model = vllm_checkpoint(tmp_path / "model")
    total = sum(f.stat().st_size for f in model.glob("*.safetensors"))
    small = {"block_bytes": "16KiB", "read_inflight_bytes": "256KiB", "threads": 2}
    ranks = run_tp2([
        {"model": str(model), "load_format": "safetensors", "hashes": True},
        {"model": str(model), "load_format": "kvprefetch", "extra": small, "hashes": True},
        {"model": str(model), "load_format": "kvprefetch", "extra": small | {"tp_ranges": False}, "hashes": True},
    ], tmp_path)  # fmt: skip
    for default, ranged, whole in ranks:
        for res in (default, ranged, whole):
            assert "error" not in res, res
        assert len(default["hashes"]) > 10
        assert ranged["hashes"] == default["hashes"]
        assert whole["hashes"] == default["hashes"]
        assert whole["counters"]["source_bytes"] == total
        assert ranged["counters"]["source_bytes"] < 0.7 * total  # q/k/v, gate/up, vocab halved (0.64 measured)
        assert ranged["counters"]["late_bytes"] == 0  # the dry run foresaw every read
    assert ranks[0][0]["hashes"] != ranks[1][0]["hashes"]  # the ranks hold different halves
    assert ranks[0][1]["counters"]["source_bytes"] + ranks[1][1]["counters"]["source_bytes"] >= total
