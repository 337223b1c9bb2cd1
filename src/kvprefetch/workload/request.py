"""The one request record that the benchmark and the simulator both consume."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from kvprefetch.workload.tokens import BLOCK_TOKENS, TokenRecipe, synthesize_tokens

__all__ = ["BLOCK_TOKENS", "Request", "TokenRecipe"]

if TYPE_CHECKING:
    import numpy as np


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
