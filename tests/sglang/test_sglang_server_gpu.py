"""End to end under a real SGLang server on a GPU: the backend loaded by `--hicache-storage-backend dynamic`,
a prompt's pages written through it, the server's caches flushed, the same prompt served again from our tiers,
the same greedy tokens. Skipped without CUDA and SGLang's full install (this CPU machine has neither); run it on a
GPU node with `pytest -m gpu tests/sglang`."""

from __future__ import annotations

import importlib.util
import json
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest
import torch

from tests.sglang.conftest import BACKEND
from tests.vllm.tiny_llama import make_model

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
    pytest.mark.skipif(importlib.util.find_spec("sgl_kernel") is None, reason="needs SGLang's full install"),
]


def _post(url: str, body: dict | None = None, timeout: float = 120) -> dict:
    req = urllib.request.Request(url, json.dumps(body or {}).encode(), {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout) as resp:
        text = resp.read().decode()
    return json.loads(text) if text.strip().startswith("{") else {"text": text}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_a_prompt_served_again_from_kvprefetchs_tiers_gives_the_same_tokens(tmp_path: Path):
    model = tmp_path / "model"
    make_model(str(model))
    port = _free_port()
    extra = BACKEND | {"interface_v1": 1, "dram": {"capacity_bytes": "1GiB", "pool_name": f"sgl-gpu-{port}"},
                       "disk": {"path": str(tmp_path / "disk")}}  # fmt: skip
    cmd = [sys.executable, "-m", "sglang.launch_server", "--model-path", str(model), "--port", str(port),
           "--skip-tokenizer-init", "--page-size", "16", "--mem-fraction-static", "0.2",
           "--enable-hierarchical-cache", "--hicache-ratio", "2", "--hicache-storage-backend", "dynamic",
           "--hicache-storage-prefetch-policy", "wait_complete",
           "--hicache-storage-backend-extra-config", json.dumps(extra)]  # fmt: skip
    log = open(tmp_path / "server.log", "w")  # noqa: SIM115
    server = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 600
        while True:
            assert server.poll() is None, (tmp_path / "server.log").read_text()[-4000:]
            try:
                urllib.request.urlopen(base + "/health", timeout=5)
                break
            except OSError:
                assert time.monotonic() < deadline, "the server did not start"
                time.sleep(2)
        prompt = [int(t) for t in torch.randint(3, 2000, (1024,), generator=torch.Generator().manual_seed(1))]
        ask = {"input_ids": prompt, "sampling_params": {"temperature": 0, "max_new_tokens": 16}, "return_logprob": True}
        first = _post(base + "/generate", ask)
        time.sleep(5)  # the backup thread writes the prompt's pages behind the answer
        assert list((tmp_path / "disk").rglob("*.kv")), "no page reached kvprefetch's disk tier"
        _post(base + "/flush_cache")  # device and host caches emptied: only storage holds the prompt now
        again = _post(base + "/generate", ask)
        assert again["output_ids"] == first["output_ids"]
        assert again["meta_info"]["cached_tokens"] >= 512, again["meta_info"]
    finally:
        server.terminate()
        server.wait(timeout=60)
        log.close()
