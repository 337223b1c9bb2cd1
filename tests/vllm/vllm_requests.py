"""Requests as vLLM's scheduler hands them to the connector: real `vllm.v1.request.Request` objects (their identity
fields, token lists and kv_transfer_params are vLLM's own), for the tests that drive the connector's scheduler side
without an engine."""

from __future__ import annotations

import itertools
from typing import Any

_ids = itertools.count()


def vllm_request(tokens: list[int], kv_transfer_params: dict[str, Any] | None = None, **identity: Any):
    """A vLLM request of `tokens` (greedy, 16 tokens out); `identity`: vLLM's own keyword arguments (lora_request,
    cache_salt, mm_features, prompt_embeds, ...)."""
    from vllm.v1.request import Request

    from vllm import SamplingParams

    extra = {"kv_transfer_params": kv_transfer_params} if kv_transfer_params else None
    return Request(f"r{next(_ids)}", list(tokens), SamplingParams(max_tokens=16, extra_args=extra), None, **identity)
