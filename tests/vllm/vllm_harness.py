"""The tests' vLLM engines: the bench's engine process (`kvprefetch.testbed.engine_proc`), spoken to in its protocol
(`kvprefetch.testbed.protocol`), with the tests' defaults (float32, no prefix cache: each request's KV comes from the
connector or is computed)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from kvprefetch.testbed import protocol as P
from kvprefetch.testbed.client import EngineProcess

TEST_DEFAULTS: dict[str, Any] = {"dtype": "float32", "enable_prefix_caching": False}


class Engine(EngineProcess):
    def __init__(self, spec: dict, log_path: Path, timeout: float = 300):
        super().__init__(P.EngineSpec(**(TEST_DEFAULTS | spec)), log_path, start_timeout=timeout, log_level="INFO")

    def generate(self, prompts: list[list[int]], max_tokens: int = 8, **kw) -> list[P.Completion]:
        return self.call(P.Generate(prompts=prompts, max_tokens=max_tokens, **kw), timeout=300).outputs

    def counters(self) -> P.CountersReply:
        return self.call(P.Counters(), timeout=300)

    def flush(self) -> bool:
        return self.call(P.Flush(), timeout=300).flushed

