"""SGLang's own host KV pool (`MHATokenToKVPoolHost`) and storage config, built as SGLang's cache controller
builds them, for what drives the backend without an SGLang server: the contract tests (tests/sglang) and
`kvprefetch iobench --sglang`.

The host pool's module imports SGLang's device-pool module (`sglang.srt.mem_cache.memory_pool`), which imports
SGLang's whole model, quantization and MoE stack at import time (CUDA kernels, torchvision): none of it loads
beside vLLM's CPU build. The host pool takes from that module only two class names, for `isinstance` checks
against the device pool it is given. Where the module cannot be imported, those two names are registered as empty
classes (the device pool built here is neither) and every line of the host pool that runs is SGLang's own. Where
SGLang is fully installed, its real module is used. A server never goes through here: SGLang builds its pools.
"""

from __future__ import annotations

import importlib
import sys
import types

import torch

DEVICE_POOL_MODULE = "sglang.srt.mem_cache.memory_pool"


def _device_pool_module() -> None:
    if DEVICE_POOL_MODULE in sys.modules:
        return
    try:
        importlib.import_module(DEVICE_POOL_MODULE)
    except Exception:  # the CPU machine: SGLang's GPU stack does not import
        sys.modules.pop(DEVICE_POOL_MODULE, None)
        module = types.ModuleType(DEVICE_POOL_MODULE)
        module.MHATokenToKVPool = type("MHATokenToKVPool", (), {})
        module.MHATokenToKOnlyPool = type("MHATokenToKOnlyPool", (), {})
        sys.modules[DEVICE_POOL_MODULE] = module


def host_pool(layout: str = "page_first", page_size: int = 16, layers: int = 4, heads: int = 2, head_dim: int = 64,
              tokens: int = 1024, dtype: torch.dtype = torch.bfloat16, ratio: float = 2.0):  # fmt: skip
    """An `MHATokenToKVPoolHost` over a CPU device pool of `tokens` tokens (SGLang keeps `page_size` more as its
    padding page), `ratio` times its size on the host, in `layout`."""
    _device_pool_module()
    from sglang.srt.mem_cache.device_pool_info import KVBufferLayout, KVBuffers, MHABufferInfo
    from sglang.srt.mem_cache.pool_host.mha import MHATokenToKVPoolHost

    k = tuple(torch.zeros(tokens + page_size, heads, head_dim, dtype=dtype) for _ in range(layers))
    v = tuple(torch.zeros(tokens + page_size, heads, head_dim, dtype=dtype) for _ in range(layers))
    ptrs = [torch.tensor([t.data_ptr() for t in side], dtype=torch.uint64) for side in (k, v)]
    info = MHABufferInfo(
        buffers=KVBuffers(k=k, v=v, k_data_ptrs=ptrs[0], v_data_ptrs=ptrs[1], layout=KVBufferLayout.NHD),
        page_size=page_size,
        head_num=heads,
        head_dim=head_dim,
        v_head_dim=head_dim,
        dtype=dtype,
        device=torch.device("cpu"),
    )
    return MHATokenToKVPoolHost(info, ratio, 0, page_size, layout, pin_memory=False, device="cpu",
                                device_capacity_tokens=tokens, start_layer=0, end_layer=layers)  # fmt: skip


def storage_config(tp_rank: int = 0, tp_size: int = 1, extra: dict | None = None, model: str = "test/model",
                   mla: bool = False, layout: str = "page_first"):  # fmt: skip
    """The `HiCacheStorageConfig` SGLang's cache controller makes for a rank (`_generate_storage_config`)."""
    from sglang.srt.mem_cache.hicache_storage import HiCacheStorageConfig

    return HiCacheStorageConfig(
        tp_rank=tp_rank, tp_size=tp_size, pp_rank=0, pp_size=1, attn_cp_rank=0, attn_cp_size=1,
        is_mla_model=mla, enable_storage_metrics=False, is_page_first_layout=layout == "page_first",
        model_name=model, extra_config=extra,
    )  # fmt: skip
