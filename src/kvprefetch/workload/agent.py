"""The agent workload of `kvprefetch bench --workload agent`: sessions of turns separated by tool calls.

Each session starts from a task context (system prompt + task, `task_tokens`) that an earlier request of the
deployment already computed: it is the prelude, so its KV is on disk before anything is measured. Then, turn after
turn, the agent calls the model and then a tool: turn k's prompt is turn k-1's prompt + the answer
(`answer_tokens`) + the tool's result (`tool_tokens`). Between two turns (and before the first: the tool call
that produced its input) the session waits for its tool, a gap drawn from `gap_s` (uniform between its bounds,
SGLang's proactive-prefetch experiment's 0.5-3 s by default).

What the client knows early is declared per turn: when its tool call starts, the client holds the previous
prompt and the answer, so `Turn.known_tokens` leading tokens of the next prompt (all but the tool's result) can
be named in a warm-up call (`POST /v1/kvprefetch/warm`) while the tool runs.

The answer inside the next prompt is the workload's own (synthetic) text, not the engine's output, so every mode
replays the same token ids.

Sizes: by default a turn adds 32 tokens (a 16-token answer, a 16-token tool result) to a 2048-token context, the
shape of the whitepaper's R2 request at this machine's scale, as the `context` workload has it (R2 adds 243 tokens
to 17,408: 1.4%; here 1.5%), so that storage is as large a part of a turn as it was there. A turn whose tool
returns much more (a file, a web page) is mostly prefill of new tokens, and there is less to hide: `tool_tokens`
(`kvprefetch bench --workload agent --user-tokens N`) measures that shape.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, fields

import numpy as np

from kvprefetch.workload.replay import BenchWorkload, Session, Turn, level_count


@dataclass(frozen=True)
class AgentBench:
    """Declared sizes of the agent workload, and how many sessions each concurrency level gets."""

    name: str = "agent"
    task_tokens: int = 2048  # the task context every session starts from (in the prelude: on disk)
    answer_tokens: int = 16  # the model's answer per turn (its tool call)
    tool_tokens: int = 16  # the tool's result, appended with the answer to the next prompt
    measured_turns: int = 4
    gap_min_s: float = 0.5  # a tool call's duration: uniform in [gap_min_s, gap_max_s]
    gap_max_s: float = 3.0
    min_sessions: int = 3
    sessions_per_concurrency: float = 2.0
    seed: int = 0

    def sessions_for(self, concurrency: int) -> int:
        return level_count(self.min_sessions, self.sessions_per_concurrency, concurrency)

    def prompt_tokens(self, turn: int) -> int:
        """Turn `turn`'s prompt length (turn 0: the task, in the prelude)."""
        return self.task_tokens + turn * (self.answer_tokens + self.tool_tokens)


def parse_gap(text: str) -> tuple[float, float]:
    """'0.5-3' -> (0.5, 3.0); '1.5' -> (1.5, 1.5); '0' -> no gap."""
    lo, sep, hi = text.strip().partition("-")
    try:
        a = float(lo)
        b = float(hi) if sep else a
    except ValueError:
        raise ValueError(f"--gap-s takes seconds or a range MIN-MAX (e.g. 0.5-3), got {text!r}") from None
    if a < 0 or b < a:
        raise ValueError(f"--gap-s needs 0 <= MIN <= MAX, got {text!r}")
    return a, b


def agent_workload(spec: AgentBench, concurrencies: list[int], vocab_size: int) -> BenchWorkload:
    rng = np.random.default_rng(spec.seed)
    counts = [spec.sessions_for(c) for c in concurrencies]
    prelude: list[Session] = []
    levels: dict[int, list[Session]] = {}
    sid = 0
    for c, n in zip(concurrencies, counts, strict=True):
        sessions = []
        for _ in range(n):
            tokens = rng.integers(4, vocab_size, size=spec.task_tokens).tolist()  # 0-3: special ids
            prelude.append(Session(f"p{sid}", 0.0, [Turn(list(tokens), 1)]))
            turns = []
            for _k in range(spec.measured_turns):
                gap = float(rng.uniform(spec.gap_min_s, spec.gap_max_s))
                known = len(tokens) + spec.answer_tokens
                tokens = tokens + rng.integers(4, vocab_size, size=spec.answer_tokens + spec.tool_tokens).tolist()
                turns.append(Turn(list(tokens), spec.answer_tokens, gap, known_tokens=known))
            # the first turn waits for the tool call that produced its input, as the later ones do
            sessions.append(Session(f"c{c}-s{sid}", 0.0, turns, lead_s=turns[0].think_s))
            sid += 1
        levels[c] = sessions
    declared = {"kind": spec.name, **asdict(spec),
                "sessions_per_level": {str(c): n for c, n in zip(concurrencies, counts, strict=True)}}  # fmt: skip
    return BenchWorkload(spec.name, declared, prelude, levels)


def agent_from_declared(declared: dict, concurrencies: list[int], vocab_size: int) -> BenchWorkload:
    """A run's agent workload regenerated from what it declared (as `replay.workload_from_declared` does for the
    others): token for token what the run replayed."""
    spec = AgentBench(**{f.name: declared[f.name] for f in fields(AgentBench) if f.name in declared})
    return agent_workload(spec, list(concurrencies), vocab_size)
