"""A small random Llama checkpoint for the exactness tests."""

from __future__ import annotations


def make_model(path: str, layers: int = 4, hidden: int = 256, heads: int = 4, kv_heads: int = 2, seed: int = 0):
    """A small random Llama checkpoint (float32 safetensors): real, non-uniform logits, fast on a CPU."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    cfg = LlamaConfig(
        vocab_size=2048,
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        head_dim=hidden // heads,
        max_position_embeddings=8192,
        initializer_range=0.02,
        torch_dtype="float32",
    )
    LlamaForCausalLM(cfg).to(torch.float32).save_pretrained(path, safe_serialization=True)
