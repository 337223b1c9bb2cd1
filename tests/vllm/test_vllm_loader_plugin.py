"""`--load-format kvprefetch` in real vLLM: registered by the entry point, parameters byte-identical to vLLM's
default loader (a hash per tensor), the same greedy tokens and logprobs, and a bad shard fails the engine's load."""

from __future__ import annotations

import json
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest
from test_vllm_exactness import assert_same, reference

from conftest import prompt

pytestmark = [pytest.mark.slow, pytest.mark.engine]

ROOT = Path(__file__).resolve().parents[2]


def entry_point() -> tuple[str, str]:
    """The (module, function) pyproject.toml declares as the vllm.general_plugins entry point."""
    entry = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["entry-points"]["vllm.general_plugins"]
    module, func = entry["kvprefetch_loader"].split(":")
    return module, func


def reshard(src: Path, dst: Path, parts: int = 3) -> Path:
    """The test model's single safetensors file split into shards with an index, as a multi-file checkpoint."""
    from safetensors.numpy import load_file, save_file

    tensors = load_file(str(src / "model.safetensors"))
    dst.mkdir()
    for f in ("config.json", "generation_config.json"):
        if (src / f).exists():
            (dst / f).write_text((src / f).read_text())
    names = sorted(tensors)
    weight_map = {}
    for k in range(parts):
        file = f"model-{k + 1:05d}-of-{parts:05d}.safetensors"
        part = names[k * len(names) // parts : (k + 1) * len(names) // parts]
        save_file({n: tensors[n] for n in part}, str(dst / file), metadata={"format": "pt"})
        weight_map |= dict.fromkeys(part, file)
    total = sum(t.nbytes for t in tensors.values())
    (dst / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map})
    )
    return dst


def harness(loads: list[dict]) -> list[dict]:
    """Several loads in one process (one vLLM import), after registering the loader through pyproject's entry point:
    each {model, load_format, extra}; returns the hashes of every parameter, or the load's error."""
    module, func = entry_point()
    code = (
        f"import json, sys; import {module} as plugin; plugin.{func}(); "  # as vLLM runs the entry point
        "from vllm.config.load import LoadConfig; from vllm.model_executor.model_loader import get_model_loader; "
        "from kvprefetch.loader.harness import load_once; "
        "assert type(get_model_loader(LoadConfig(load_format='kvprefetch'))).__name__ == 'KVPrefetchModelLoader'\n"
        "specs = json.loads(sys.argv[1]); out = []\n"
        "for s in specs:\n"
        "    try: out.append(load_once(s['model'], s['load_format'], s.get('extra'), hashes=True))\n"
        "    except Exception as e: out.append({'error': f'{type(e).__name__}: {e}'})\n"
        "print('@@R ' + json.dumps(out))"
    )
    res = subprocess.run([sys.executable, "-c", code, json.dumps(loads)], capture_output=True, text=True, timeout=600)
    lines = [ln for ln in res.stdout.splitlines() if ln.startswith("@@R ")]
    assert lines, res.stderr[-3000:]
    return json.loads(lines[-1][4:])


def test_entry_point_loader_is_byte_identical_to_the_default_loader_cold_and_from_cache(model_dir, tmp_path, pools):
    sharded = reshard(Path(model_dir), tmp_path / "sharded")
    pools.append("kvpl-exact")
    # the pool outlives each load (keep_idle_s): the second load finds every block in the node's DRAM
    cache = {"cache": {"disk": {"path": str(tmp_path / "wcache")}, "dram": {"pool_name": "kvpl-exact",
                                                                         "keep_idle_s": 600}},
             "block_bytes": "1MiB"}  # fmt: skip
    broken = reshard(Path(model_dir), tmp_path / "broken")
    victim = broken / "model-00002-of-00003.safetensors"
    victim.write_bytes(victim.read_bytes()[:-4096])
    default, cold, warm, bad = harness([
        {"model": str(sharded), "load_format": "safetensors"},
        {"model": str(sharded), "load_format": "kvprefetch", "extra": cache},
        {"model": str(sharded), "load_format": "kvprefetch", "extra": cache},
        {"model": str(broken), "load_format": "kvprefetch"},
    ])  # fmt: skip
    for res in (default, cold, warm):
        assert "error" not in res, res
    assert len(default["hashes"]) > 10
    assert cold["hashes"] == default["hashes"]
    assert warm["hashes"] == default["hashes"]
    assert cold["counters"]["cache_bytes"] == 0 and warm["counters"]["source_bytes"] == 0
    # warm from DRAM: the pool's pages mapped under the tensors vLLM copied, never copied into the shard buffers
    assert warm["counters"]["cache_map_bytes"] == warm["counters"]["cache_bytes"] > 0
    assert "CheckpointError" in bad["error"] and victim.name in bad["error"] and "truncated" in bad["error"]


def test_greedy_tokens_match_the_default_loader(engines, model_dir, logs):
    from vllm_harness import Engine

    engine = Engine({"model": model_dir, "max_num_seqs": 1, "load_format": "kvprefetch",
                     "model_loader_extra_config": {"threads": 2}}, logs / "kvprefetch_loader.log")  # fmt: skip
    try:
        for seed in (1, 2):
            p = prompt(seed, 300)
            assert_same(engine.generate([p])[0], reference(engines, p))
    finally:
        engine.close()
