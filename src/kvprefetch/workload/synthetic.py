"""Synthetic multi-turn long-context chat: shared system prompt, growing history, think time."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import numpy as np

from kvprefetch.workload.request import BLOCK_TOKENS, Request, TokenRecipe

_SESSION_BASE = 1 << 32
_PARTIAL_OFFSET = 1 << 31


@dataclass(frozen=True)
class ChatWorkload:
    """Shape of a synthetic chat workload; every field is a declared knob, nothing is hidden.

    `arrival="concurrency"`: a closed loop — the driver keeps `concurrency` sessions in flight and starts
    the next session when one ends (turn-0 `arrival_s` is 0). `arrival="poisson"`: sessions start at
    Poisson times with `rate_per_s`. Lengths vary by ±`jitter` (uniform) around their means.
    """

    sessions: int = 32
    turns: int = 4
    system_tokens: int = 2048
    first_user_tokens: int = 8192
    user_tokens: int = 512
    output_tokens: int = 128
    think_s: float = 5.0
    arrival: Literal["concurrency", "poisson"] = "concurrency"
    concurrency: int = 8
    rate_per_s: float = 1.0
    jitter: float = 0.25
    seed: int = 0
    block_tokens: int = BLOCK_TOKENS


def _vary(rng: np.random.Generator, mean: int, jitter: float) -> int:
    return max(1, round(mean * (1.0 + jitter * rng.uniform(-1.0, 1.0))))


def session_hash_ids(session_id: int, turn: int, input_len: int, system_tokens: int, size: int) -> tuple[int, ...]:
    """Prefix-block ids of one turn's prompt.

    Blocks wholly inside the system prompt are shared by all sessions; full blocks after it belong to the
    session and keep their id in later turns; a partial last block is unique to this turn.
    """
    full, rest = divmod(input_len, size)
    shared = system_tokens // size
    base = _SESSION_BASE * (session_id + 1)
    ids = [i if i < shared else base + i for i in range(full)]
    if rest:
        ids.append(base + _PARTIAL_OFFSET + turn)
    return tuple(ids)


def generate_chat(spec: ChatWorkload) -> list[Request]:
    """All turns of all sessions, sorted by (arrival_s, session, turn); deterministic from `spec.seed`."""
    rng = np.random.default_rng(spec.seed)
    recipe = TokenRecipe("session", spec.seed, spec.block_tokens, spec.system_tokens)
    starts = np.zeros(spec.sessions)
    if spec.arrival == "poisson":
        starts = np.cumsum(rng.exponential(1.0 / spec.rate_per_s, spec.sessions))
    out: list[Request] = []
    for sid in range(spec.sessions):
        history = spec.system_tokens
        clock = float(starts[sid])
        think = 0.0
        for turn in range(spec.turns):
            user = _vary(rng, spec.first_user_tokens if turn == 0 else spec.user_tokens, spec.jitter)
            answer = _vary(rng, spec.output_tokens, spec.jitter)
            prompt = history + user
            ids = session_hash_ids(sid, turn, prompt, spec.system_tokens, spec.block_tokens)
            out.append(Request(clock, sid, turn, prompt, answer, ids, recipe, think))
            history = prompt + answer
            think = float(rng.exponential(spec.think_s)) if spec.think_s > 0 else 0.0
            clock += think
    out.sort(key=lambda r: (r.arrival_s, r.session_id, r.turn))
    return out
