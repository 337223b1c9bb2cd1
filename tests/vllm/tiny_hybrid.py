"""Small random checkpoints of the packaged hybrid and MLA models (`kvprefetch.testbed.server.TINY_MODELS`), for the
exactness tests: the packaged config, random weights of real scale (initializer_range 0.02), float32 safetensors."""

from __future__ import annotations

from kvprefetch.testbed.server import TINY_MODELS


def make_packaged(name: str, path: str, seed: int = 0) -> str:
    """Save a random checkpoint of the packaged model ``name`` (e.g. ``kvprefetch-tiny-hybrid``) in ``path``."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(seed)
    cfg = AutoConfig.from_pretrained(str(TINY_MODELS[name]))
    cfg.initializer_range = 0.02
    AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).save_pretrained(path, safe_serialization=True)
    return path
