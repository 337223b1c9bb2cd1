"""LoRA adapters for the tests, made offline: peft's on-disk format (``adapter_config.json`` and
``adapter_model.safetensors``), random A and B on every layer's q/k/v/o projections, shaped for a Llama config."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj")


def make_adapter(path: Path, base: dict[str, Any], seed: int, rank: int = 8, scale: float = 0.02) -> Path:
    """An adapter for the Llama whose config is `base`, in `path` (rewritten in place if it is there): A ~ N(0,
    1/in), B ~ N(0, scale^2). B is not zero (as a trained adapter's is not): on the tests' tiny Llamas its greedy
    tokens differ from the base model's from the first one on (vLLM's CPU build serves it, at TP=2 too)."""
    import torch
    from safetensors.torch import save_file

    hidden, heads, kv_heads = base["hidden_size"], base["num_attention_heads"], base["num_key_value_heads"]
    head_dim = base.get("head_dim") or hidden // heads
    dims = {"q_proj": (hidden, heads * head_dim), "k_proj": (hidden, kv_heads * head_dim),
            "v_proj": (hidden, kv_heads * head_dim), "o_proj": (heads * head_dim, hidden)}  # fmt: skip
    g = torch.Generator().manual_seed(seed)
    weights = {}
    for layer in range(base["num_hidden_layers"]):
        for name, (fan_in, fan_out) in dims.items():
            prefix = f"base_model.model.model.layers.{layer}.self_attn.{name}"
            weights[f"{prefix}.lora_A.weight"] = torch.randn(rank, fan_in, generator=g) / fan_in**0.5
            weights[f"{prefix}.lora_B.weight"] = torch.randn(fan_out, rank, generator=g) * scale
    path.mkdir(parents=True, exist_ok=True)
    save_file(weights, str(path / "adapter_model.safetensors"))
    config = {"peft_type": "LORA", "task_type": "CAUSAL_LM", "r": rank, "lora_alpha": 2 * rank,
              "target_modules": list(TARGETS), "lora_dropout": 0.0, "bias": "none", "fan_in_fan_out": False,
              "modules_to_save": None, "base_model_name_or_path": "base"}  # fmt: skip
    (path / "adapter_config.json").write_text(json.dumps(config))
    return path


def model_config(model_dir: str | Path) -> dict[str, Any]:
    """A checkpoint's config.json (the shapes an adapter for it needs)."""
    return json.loads((Path(model_dir) / "config.json").read_text())
