"""Models, accelerators and storage the simulator knows, each number with where it comes from.

Numbers marked "estimate" have no vendor source we could find; they matter little where a scenario fits
an efficiency factor, since peak FLOP/s and efficiency only ever appear as their product.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, replace
from pathlib import Path

GB = 1e9


@dataclass(frozen=True)
class Model:
    """Shape of a decoder-only transformer, enough to cost prefill, decode and KV transfers."""

    name: str
    layers: int
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    total_params: float
    active_params: float
    experts: int = 0
    experts_active: int = 0
    expert_params: float = 0.0
    weight_bytes: float = 2.0
    kv_dtype_bytes: float = 2.0
    kv_bytes_per_token_override: float | None = None
    source: str = ""

    @property
    def kv_bytes_per_token(self) -> float:
        """K and V for every layer (MLA models store one compressed latent instead)."""
        if self.kv_bytes_per_token_override is not None:
            return self.kv_bytes_per_token_override
        return 2 * self.layers * self.kv_heads * self.head_dim * self.kv_dtype_bytes

    @property
    def dense_params(self) -> float:
        return self.total_params - self.expert_params


@dataclass(frozen=True)
class Accelerator:
    """One device: peak matrix FLOP/s at the model's compute dtype, HBM, and its link to host memory."""

    name: str
    flops: float
    hbm_bytes: float
    hbm_bw: float
    host_link_bw: float
    step_overhead_s: float
    source: str = ""
    seq_overhead_s: float = 0.0  # per sequence in a step (serving loop's per-request work); measured for this-cpu


@dataclass(frozen=True)
class Storage:
    """A tier below host DRAM, as seen by one serving node. `parallelism`: reads in flight it takes to reach
    `read_bw` (one stream alone gets `read_bw / parallelism`; see `TierSpec`)."""

    name: str
    read_bw: float
    latency_s: float
    capacity_bytes: float
    source: str = ""
    parallelism: float = 1.0


MODELS: dict[str, Model] = {
    m.name: m
    for m in [
        Model(
            "qwen3-coder-480b-fp8",
            layers=62,
            hidden=6144,
            heads=96,
            kv_heads=8,
            head_dim=128,
            total_params=480e9,
            active_params=35e9,
            experts=160,
            experts_active=8,
            expert_params=62 * 160 * 3 * 6144 * 2560,
            weight_bytes=1.0,
            kv_dtype_bytes=2.0,
            source="Qwen/Qwen3-Coder-480B-A35B-Instruct-FP8 config.json (62 layers, 96/8 heads, "
            "160 experts top-8, moe_intermediate 2560); 480B total / 35B active from the model card; "
            "KV in bf16 (vLLM default kv_cache_dtype=auto)",
        ),
        Model(
            "qwen3-coder-30b-a3b-fp8",
            layers=48,
            hidden=2048,
            heads=32,
            kv_heads=4,
            head_dim=128,
            total_params=30.5e9,
            active_params=3.3e9,
            experts=128,
            experts_active=8,
            expert_params=48 * 128 * 3 * 2048 * 768,
            weight_bytes=1.0,
            kv_dtype_bytes=2.0,
            source="Qwen/Qwen3-Coder-30B-A3B-Instruct-FP8 config.json (48 layers, 32/4 heads, head_dim 128, "
            "128 experts top-8, moe_intermediate 768); 30.5B total / 3.3B active from the model card; "
            "KV in bf16",
        ),
        Model(
            "deepseek-v3",
            layers=61,
            hidden=7168,
            heads=128,
            kv_heads=1,
            head_dim=192,
            total_params=671e9,
            active_params=37e9,
            experts=256,
            experts_active=8,
            expert_params=58 * 256 * 3 * 7168 * 2048,
            weight_bytes=1.0,
            kv_bytes_per_token_override=61 * (512 + 64) * 2.0,
            source="deepseek-ai/DeepSeek-V3 config.json: 61 layers (58 MoE), 256 routed experts top-8, "
            "moe_intermediate 2048, MLA kv_lora_rank 512 + rope 64 cached per layer; 671B/37B (paper)",
        ),
        Model(
            "llama-3-70b",
            layers=80,
            hidden=8192,
            heads=64,
            kv_heads=8,
            head_dim=128,
            total_params=70.6e9,
            active_params=70.6e9,
            source="meta-llama/Meta-Llama-3-70B config.json; bf16 weights and KV",
        ),
        Model(
            "qwen-14b",
            layers=48,
            hidden=5120,
            heads=40,
            kv_heads=8,
            head_dim=128,
            total_params=14.7e9,
            active_params=14.7e9,
            source="Qwen/Qwen2.5-14B-Instruct config.json; bf16 weights and KV",
        ),
    ]
}


def model_from_hf_config(path: str | Path, name: str | None = None) -> Model:
    """A dense Llama-style model's shape and parameter counts from its Hugging Face config.json."""
    c = json.loads(Path(path).read_text())
    hidden, layers, vocab = c["hidden_size"], c["num_hidden_layers"], c["vocab_size"]
    heads, kv_heads = c["num_attention_heads"], c.get("num_key_value_heads", c["num_attention_heads"])
    head_dim = c.get("head_dim", hidden // heads)
    attention = hidden * head_dim * (2 * heads + 2 * kv_heads)  # q and o; k and v
    mlp = 3 * hidden * c["intermediate_size"]
    lm_head = hidden * vocab
    embed = 0 if c.get("tie_word_embeddings") else hidden * vocab
    dtype_bytes = {"float32": 4.0, "bfloat16": 2.0, "float16": 2.0}.get(c.get("torch_dtype", "bfloat16"), 2.0)
    return Model(
        name or Path(path).parent.name,
        layers=layers,
        hidden=hidden,
        heads=heads,
        kv_heads=kv_heads,
        head_dim=head_dim,
        total_params=float(layers * (attention + mlp) + lm_head + embed),
        active_params=float(layers * (attention + mlp) + lm_head),  # the embedding is a lookup
        weight_bytes=dtype_bytes,
        kv_dtype_bytes=dtype_bytes,
        source=f"computed from {Path(path).name} of the model",
    )


BENCH_MODEL_CONFIG = Path(__file__).resolve().parents[1] / "testbed" / "models" / "tiny-llama" / "config.json"
MODELS["tiny-llama"] = replace(
    model_from_hf_config(BENCH_MODEL_CONFIG),
    source="kvprefetch/testbed/models/tiny-llama/config.json, the benchmark's model (fp32 on CPU); params computed",
)

ACCELERATORS: dict[str, Accelerator] = {
    a.name: a
    for a in [
        Accelerator(
            "mi308x",
            flops=0.69e15,
            hbm_bytes=192 * GB,
            hbm_bw=5.3e12,
            host_link_bw=50 * GB,
            step_overhead_s=0.010,
            source="estimate: MI300-family part with 80 of MI300X's 304 CUs (press reports), so FP8 "
            "dense ~ 2.61 PF x 80/304; 192 GB HBM3 at 5.3 TB/s as MI300X (AMD datasheet); "
            "PCIe Gen5 x16 = 64 GB/s raw, ~50 effective; 10 ms step overhead (vLLM scheduler, estimate)",
        ),
        Accelerator(
            "h200",
            flops=1.979e15,
            hbm_bytes=141 * GB,
            hbm_bw=4.8e12,
            host_link_bw=50 * GB,
            step_overhead_s=0.005,
            source="NVIDIA H200 SXM datasheet: FP8 1,979 TFLOPS dense, 141 GB HBM3e, 4.8 TB/s; PCIe Gen5",
        ),
        Accelerator(
            "h100",
            flops=1.979e15,
            hbm_bytes=80 * GB,
            hbm_bw=3.35e12,
            host_link_bw=50 * GB,
            step_overhead_s=0.005,
            source="NVIDIA H100 SXM datasheet: FP8 1,979 TFLOPS dense, 80 GB HBM3, 3.35 TB/s; PCIe Gen5",
        ),
        Accelerator(
            "a100",
            flops=0.312e15,
            hbm_bytes=80 * GB,
            hbm_bw=2.039e12,
            host_link_bw=25 * GB,
            step_overhead_s=0.005,
            source="NVIDIA A100 80GB SXM datasheet: BF16 312 TFLOPS dense (no FP8), 2,039 GB/s; PCIe Gen4",
        ),
        Accelerator(
            "ascend-910b",
            flops=0.32e15,
            hbm_bytes=64 * GB,
            hbm_bw=1.6e12,
            host_link_bw=25 * GB,
            step_overhead_s=0.008,
            source="estimate from public reports: ~320 TFLOPS FP16, 64 GB HBM2e at ~1.6 TB/s, PCIe Gen4",
        ),
    ]
}

STORAGE: dict[str, Storage] = {
    s.name: s
    for s in [
        Storage(
            "nvmeof-100gbe-raid0",
            read_bw=5.23 * GB,
            latency_s=200e-6,
            capacity_bytes=100e12,
            source="read bandwidth: the whitepaper's highest measured R1 point (5.23 GB/s), below the "
            "100 GbE line rate of 12.5 GB/s; latency: NVMe-oF RDMA round trip + flash read (estimate); "
            "parallelism: the whitepaper's R1 read the same array at 0.98 GB/s with serial reads and 5.23 GB/s "
            "with parallel ones, so one stream gets 0.98 GB/s",
            parallelism=5.23 / 0.98,
        ),
        Storage(
            "local-nvme",
            read_bw=6.9 * GB,
            latency_s=100e-6,
            capacity_bytes=7.68e12,
            source="one PCIe Gen4 x4 datacenter SSD (e.g. Samsung PM9A3 datasheet: 6.9 GB/s seq. read); "
            "parallelism (estimate): 128 KB sequential reads reach a drive's rated speed at queue depth 4-8 "
            "(published QD sweeps), the chunk reads of a KV load are MBs each and need fewer; on this "
            "project's own machine fio gained nothing past queue depth 2-4",
            parallelism=2.0,
        ),
        Storage(
            "nfs",
            read_bw=1.1 * GB,
            latency_s=1e-3,
            capacity_bytes=100e12,
            source="NFS over 10 GbE: line rate 1.25 GB/s minus protocol overhead (estimate); parallelism: one "
            "stream of large sequential reads is assumed to fill the link (estimate)",
        ),
    ]
}


def lookup(table: dict, name: str, kind: str):
    """Catalog entry by name, with the valid names in the error."""
    try:
        return table[name]
    except KeyError:
        raise KeyError(f"unknown {kind} {name!r}; known: {', '.join(sorted(table))}") from None
