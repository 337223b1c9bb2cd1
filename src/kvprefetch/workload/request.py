"""The one request record that the benchmark and the simulator both consume."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Literal

from kvprefetch.workload.tokens import synthesize_tokens

if TYPE_CHECKING:
    import numpy as np

BLOCK_TOKENS = 512
"""Mooncake's prefix-block size: one hash id covers this many tokens (and everything before them)."""


@dataclass(frozen=True)
class TokenRecipe:
    """How to rebuild a request's token ids on demand, so records stay small.

    `trace`: each block's tokens derive from its hash id. `session`: tokens derive from the session's
    position-indexed stream (shared system prompt first), so every turn extends the previous one exactly.
    """

    kind: Literal["trace", "session"]
    seed: int
    block_tokens: int = BLOCK_TOKENS
    system_tokens: int = 0


@dataclass(frozen=True)
class Request:
    """One request: when it arrives, how long it is, and which prefix blocks it shares with others.

    `think_s` is the pause after the same session's previous turn completes; drivers submit a turn at
    `max(arrival_s, previous_done + think_s)`. Turn 0 and trace requests have `think_s == 0`.
    """

    arrival_s: float
    session_id: int
    turn: int
    input_len: int
    output_len: int
    hash_ids: tuple[int, ...]
    recipe: TokenRecipe = field(repr=False)
    think_s: float = 0.0

    def token_ids(self, vocab_size: int = 32000) -> np.ndarray:
        """The prompt's token ids (int64), rebuilt deterministically from the recipe."""
        return synthesize_tokens(self, vocab_size)
