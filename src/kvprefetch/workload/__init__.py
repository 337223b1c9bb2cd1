"""Workloads shared by the benchmark and the simulator: synthetic multi-turn chat and Mooncake traces."""

from kvprefetch.workload.mooncake import TraceScaling, read_mooncake_trace
from kvprefetch.workload.request import BLOCK_TOKENS, Request, TokenRecipe
from kvprefetch.workload.synthetic import ChatWorkload, generate_chat
from kvprefetch.workload.tokens import synthesize_tokens

__all__ = [
    "BLOCK_TOKENS",
    "ChatWorkload",
    "Request",
    "TokenRecipe",
    "TraceScaling",
    "generate_chat",
    "read_mooncake_trace",
    "synthesize_tokens",
]
