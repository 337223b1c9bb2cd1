"""Deterministic token ids: equal hash ids give identical blocks, later turns extend earlier ones."""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache
from typing import Literal, Protocol

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


class Prompted(Protocol):
    """What this module reads of a request (`kvprefetch.workload.request.Request`, which calls in here): named
    here so that the two modules do not import each other."""

    @property
    def recipe(self) -> TokenRecipe: ...
    @property
    def session_id(self) -> int: ...
    @property
    def input_len(self) -> int: ...
    @property
    def output_len(self) -> int: ...
    @property
    def hash_ids(self) -> tuple[int, ...]: ...


_TRACE_STREAM = 1
_SYSTEM_STREAM = 2
_SESSION_STREAM = 3
# Token 0 is often special (pad/bos); keep synthesized ids clear of the first few.
_FIRST_ID = 4


@lru_cache(maxsize=65536)
def _block(words: tuple[int, ...], length: int, vocab_size: int) -> np.ndarray:
    """One block's tokens, seeded only by `words` (never Python's hash(), which is salted per process)."""
    rng = np.random.Generator(np.random.PCG64(np.random.SeedSequence(list(words))))
    out = rng.integers(_FIRST_ID, vocab_size, size=length, dtype=np.int64)
    out.flags.writeable = False
    return out


def _trace_tokens(request: Prompted, vocab_size: int) -> np.ndarray:
    recipe = request.recipe
    size = recipe.block_tokens
    blocks = [_block((recipe.seed, _TRACE_STREAM, h), size, vocab_size) for h in request.hash_ids]
    return np.concatenate(blocks)[: request.input_len] if blocks else np.zeros(0, np.int64)


def _stream(words: tuple[int, ...], start: int, stop: int, size: int, vocab_size: int) -> np.ndarray:
    """Positions [start, stop) of an endless stream made of `size`-token blocks seeded by words + index."""
    if stop <= start:
        return np.zeros(0, np.int64)
    first, last = start // size, (stop - 1) // size
    parts = [_block((*words, i), size, vocab_size) for i in range(first, last + 1)]
    joined = np.concatenate(parts)
    offset = first * size
    return joined[start - offset : stop - offset]


def _session_tokens(request: Prompted, vocab_size: int) -> np.ndarray:
    recipe = request.recipe
    size, system = recipe.block_tokens, recipe.system_tokens
    n = request.input_len
    head = _stream((recipe.seed, _SYSTEM_STREAM), 0, min(n, system), size, vocab_size)
    tail = _stream((recipe.seed, _SESSION_STREAM, request.session_id), 0, max(0, n - system), size, vocab_size)
    return np.concatenate([head, tail])


def synthesize_tokens(request: Prompted, vocab_size: int = 32000) -> np.ndarray:
    """Token ids for `request` (a fresh int64 array of length `input_len`).

    Trace requests: block i is a pure function of (seed, hash_ids[i]), so equal hash ids give identical
    blocks. Session requests: token at position p is a pure function of (seed, session, p) past the shared
    system prompt, so a later turn's prompt starts with the earlier prompt plus its answer.
    """
    if vocab_size <= _FIRST_ID:
        raise ValueError(f"vocab_size must exceed {_FIRST_ID}")
    if request.recipe.kind == "trace":
        tokens = _trace_tokens(request, vocab_size)
    else:
        tokens = _session_tokens(request, vocab_size)
    return np.array(tokens, dtype=np.int64)


def session_answer_tokens(request: Prompted, vocab_size: int = 32000) -> np.ndarray:
    """The answer a session turn is assumed to produce: the stream right after its prompt.

    A driver that replays the next turn with these tokens reproduces the prefix property exactly.
    """
    recipe = request.recipe
    if recipe.kind != "session":
        raise ValueError("only session requests have a scripted answer")
    start = request.input_len - recipe.system_tokens
    stop = start + request.output_len
    words = (recipe.seed, _SESSION_STREAM, request.session_id)
    return np.array(_stream(words, start, stop, recipe.block_tokens, vocab_size), dtype=np.int64)
