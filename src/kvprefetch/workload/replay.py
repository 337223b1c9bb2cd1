"""What `kvprefetch bench` replays, and `kvprefetch sim --scenario bench` after it: a cache-populating prelude and,
per concurrency, sessions of turns. Both rebuild it from the knobs a run declares (`workload_from_declared`).

Every mode replays exactly the same token ids. The store is populated once, before any mode runs, with the
conversation history that a long-running deployment would already hold ("the conversations so far"); the
measured requests then reuse it, and each adds new tokens of its own that nothing has seen:

* **context** (default): the whitepaper's R2 shape. Each request is a long stored context (one per
  conversation, in the prelude) plus a few new tokens and a short answer, so ~98% of every prompt is reused and
  loading it is most of a request (see `CONTEXT`).
* **chat**: multi-turn long-context sessions (shared system prompt, a long first message, short
  follow-ups, think time). Turns ``0 .. T-2`` of every session form the prelude; the measured requests are
  turns ``1 .. T-1``, so each measured turn reuses the whole previous prompt (on disk) and brings the previous
  answer and a new user message. Each concurrency level gets its own sessions, so one level never warms the
  cache for the next.
* **trace**: a Mooncake-format trace (``hash_ids`` -> identical token blocks), lengths scaled so a trace block
  stays a whole number of chunks. Each level replays whole conversations (prefix groups) from the trace's
  window, in trace order, with at least the engine's KV cache of other prompts between two turns of one
  conversation (as the trace's other traffic would); the prelude is what those conversations held before the
  window (`kvprefetch.workload.sampling`).
"""

from __future__ import annotations

import hashlib
import math
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path

import numpy as np

from kvprefetch.workload import ChatWorkload, TraceScaling, generate_chat, read_mooncake_trace
from kvprefetch.workload.mooncake import DEFAULT_TRACE
from kvprefetch.workload.prefix_cache import prefix_hits
from kvprefetch.workload.sampling import (
    LevelNeed,
    SampleRule,
    fit_block_tokens,
    sample_conversations,
    spaced_order,
    utilisation_time_factor,
)


@dataclass
class Turn:
    tokens: list[int]
    max_tokens: int
    think_s: float = 0.0  # pause after the session's previous turn finished (ignored for its first turn)
    known_tokens: int = 0  # leading tokens a client knows once the previous turn finished (what it can warm)


@dataclass
class Session:
    sid: str
    arrival_s: float
    turns: list[Turn]
    lead_s: float = 0.0  # the session's first turn is due this long after the session starts (a tool call)


@dataclass
class BenchWorkload:
    name: str
    declared: dict  # every knob and scaling that shaped it, reported with the results
    prelude: list[Session]  # run before any measurement, one answer token each, to populate the store
    levels: dict[int, list[Session]] = field(default_factory=dict)

    def to_json(self) -> dict:
        return {
            "name": self.name,
            "declared": self.declared,
            "prelude": [asdict(s) for s in self.prelude],
            "levels": {str(c): [asdict(s) for s in ss] for c, ss in self.levels.items()},
        }

    @classmethod
    def from_json(cls, data: dict) -> BenchWorkload:
        def sessions(ss: list[dict]) -> list[Session]:
            return [Session(s["sid"], s["arrival_s"], [Turn(**t) for t in s["turns"]], s.get("lead_s", 0.0))
                    for s in ss]

        levels = {int(c): sessions(ss) for c, ss in data["levels"].items()}
        return cls(data["name"], data["declared"], sessions(data["prelude"]), levels)

    # ---- sizes ------------------------------------------------------------------------------------------
    def requests(self, concurrency: int) -> int:
        return sum(len(s.turns) for s in self.levels[concurrency])

    def prompt_tokens(self, concurrency: int | None = None) -> int:
        levels = [concurrency] if concurrency is not None else list(self.levels)
        return sum(len(t.tokens) for c in levels for s in self.levels[c] for t in s.turns)

    def prelude_tokens(self) -> int:
        return sum(len(t.tokens) for s in self.prelude for t in s.turns)

    def _turns(self):
        for ss in [self.prelude, *self.levels.values()]:
            for s in ss:
                yield from s.turns

    def max_prompt_tokens(self) -> int:
        return max((len(t.tokens) for t in self._turns()), default=1)

    def mean_prompt_tokens(self) -> float:
        lens = [len(t.tokens) for ss in self.levels.values() for s in ss for t in s.turns]
        return sum(lens) / len(lens) if lens else 0.0

    def max_len(self) -> int:
        """Longest prompt plus its answer (the engine's max_model_len must cover it)."""
        return max((len(t.tokens) + t.max_tokens for t in self._turns()), default=1)


def level_count(minimum: int, per_concurrency: float, concurrency: int) -> int:
    """Sessions (or requests) a concurrency level gets: per_concurrency per client, at least minimum."""
    return max(minimum, math.ceil(per_concurrency * concurrency))


@dataclass(frozen=True)
class ChatBench:
    """The bench's chat workload: declared sizes, and how many sessions each concurrency level gets."""

    name: str = "chat"
    system_tokens: int = 1024
    history_tokens: int = 2048  # the first (long) message of every conversation
    user_tokens: int = 256
    output_tokens: int = 32
    measured_turns: int = 2
    think_s: float = 0.5
    jitter: float = 0.25
    min_sessions: int = 4
    sessions_per_concurrency: float = 1.5
    seed: int = 0
    reuse: bool = True  # False: no prelude, no system prompt, one turn per session (nothing to hit anywhere)
    # Requests of each conversation run in the prelude: None = all but the last (every measured turn's history
    # is already stored); 1 = only the first, so each measured turn hits what the turn before it computed
    # (the two-instance scenario: on the other engine); 0 = none: the whole conversation runs in the cell, its
    # reuse inside the run (`IN_RUN`), and each round's prompts are new to every tier (`fresh_rounds`).
    prelude_turns: int | None = None

    def sessions_for(self, concurrency: int) -> int:
        return level_count(self.min_sessions, self.sessions_per_concurrency, concurrency)

    @property
    def in_run(self) -> bool:
        """Every turn of a conversation measured, its first included: nothing is stored before the cell."""
        return self.reuse and self.prelude_turns == 0

    @property
    def fresh_rounds(self) -> bool:
        """Each round's prompts must be new to every tier: a round must not find what an earlier one saved,
        where the cell's reuse is meant to come from the cell itself (or there is none)."""
        return not self.reuse or self.in_run


CONTEXT = ChatBench(
    name="context",
    system_tokens=0,
    history_tokens=2048,  # 8 chunks of 256: the stored context
    user_tokens=32,  # below one chunk: a measured request saves nothing new, so every round finds the same tier
    output_tokens=4,
    measured_turns=1,
    think_s=0.0,
    jitter=0.0,
    min_sessions=2,
    sessions_per_concurrency=2.0,  # two requests per client, each its own context
)
"""The whitepaper's R2 request at this machine's scale: R2 reuses 98.6% of a 17,408-token context and adds 243
tokens and a 64-token answer; here 2048 + 32 tokens (98.4%) and 4 answer tokens. The answer is shortened with
the context, so that its decode stays as small a part of a request as R2's 64 tokens were of its (a CPU decodes
relatively far slower than it prefills). With the engine batching 4 requests (`CONTEXT_MAX_NUM_SEQS`), levels
8/16/32 queue as R2's did."""

CONTEXT_MAX_NUM_SEQS = 4

IN_RUN = ChatBench(prelude_turns=0, measured_turns=4)
"""Multi-turn chat whose reuse stays inside the cell (the engine-memory sweep, `--engine-kv`): every
conversation's turns run one after another in the cell, the first included, so a turn's prefix is what its
own conversation computed seconds before. vLLM alone keeps it in its KV cache if the cache holds every
active conversation, and recomputes it if not; kvprefetch loads it from its tiers. Four turns: three of them
reuse, as in the whitepaper's R5 multi-turn load."""


def chat_workload(spec: ChatBench, concurrencies: list[int], vocab_size: int) -> BenchWorkload:
    counts = [spec.sessions_for(c) for c in concurrencies]
    turns = 1 if not spec.reuse else spec.measured_turns if spec.in_run else spec.measured_turns + 1
    base = ChatWorkload(
        sessions=sum(counts),
        turns=turns,
        system_tokens=spec.system_tokens if spec.reuse else 0,
        first_user_tokens=spec.history_tokens,
        user_tokens=spec.user_tokens,
        output_tokens=spec.output_tokens,
        think_s=spec.think_s,
        arrival="concurrency",
        concurrency=max(concurrencies),
        jitter=spec.jitter,
        seed=spec.seed,
    )
    by_session: dict[int, list] = {}
    for r in generate_chat(base):
        by_session.setdefault(r.session_id, []).append(r)
    prelude: list[Session] = []
    levels: dict[int, list[Session]] = {}
    sid = 0
    for c, n in zip(concurrencies, counts, strict=True):
        sessions = []
        for _ in range(n):
            reqs = sorted(by_session[sid], key=lambda r: r.turn)
            if spec.reuse and not spec.in_run:
                upto = len(reqs) - 1 if spec.prelude_turns is None else min(spec.prelude_turns, len(reqs) - 1)
                history = [Turn(r.token_ids(vocab_size).tolist(), 1) for r in reqs[:upto]]
                prelude.append(Session(f"p{sid}", 0.0, history))
                reqs = reqs[1:]
            prev = {r.turn: r for r in by_session[sid]}
            # what a client knows of a turn when the one before it finished: that prompt and its answer
            measured = [Turn(r.token_ids(vocab_size).tolist(), r.output_len, r.think_s,
                             known_tokens=(p.input_len + p.output_len) if (p := prev.get(r.turn - 1)) else 0)
                        for r in reqs]  # fmt: skip
            sessions.append(Session(f"c{c}-s{sid}", 0.0, measured))
            sid += 1
        levels[c] = sessions
    declared = {
        "kind": spec.name,
        **asdict(spec),
        "fresh_rounds": spec.fresh_rounds,
        "sessions_per_level": {str(c): n for c, n in zip(concurrencies, counts, strict=True)},
    }
    return BenchWorkload(spec.name, declared, prelude, levels)


@dataclass(frozen=True)
class TraceBench:
    """The bench's trace replay (`kvprefetch.workload.sampling`): whole conversations from the trace's window,
    with their past as the prelude; every knob is declared with the results."""

    path: str = str(DEFAULT_TRACE)
    length_scale: float | None = None  # None: one chunk per 512-token trace block (chunk_tokens / 512)
    chunk_tokens: int = 128
    time_scale: float = 1.0  # trace times x this (with use_timestamps)
    use_timestamps: bool = False  # False: each level's conversations in order, as fast as the concurrency allows
    # With use_timestamps: trace times are scaled so that recomputing a level's prompts at the engine's measured
    # prefill speed would keep it this busy (applied once the speed is measured; None: time_scale as declared)
    utilisation: float | None = 0.8
    window_start: float = 0.3  # the measured window opens at this share of the trace's time span
    max_prompt_tokens: int = 2048  # conversations with a longer (scaled) prompt are left out whole
    level_tokens: int = 48_000  # prompt tokens each level measures at least: enough conversations to keep the reuse
    strata: int = 3
    engine_kv_tokens: int | None = None  # the engine's KV cache; None: the bench's default for max_prompt_tokens
    min_requests: int = 8
    requests_per_concurrency: float = 2.0
    # answers are capped: the replay measures prompt reuse, and on a CPU engine decoding would take most of its time
    max_output_tokens: int = 16
    seed: int = 0

    def requests_for(self, concurrency: int) -> int:
        return level_count(self.min_requests, self.requests_per_concurrency, concurrency)


KV_MARGIN = 1.5
"""A level's prompt tokens are at least this many times the engine's KV cache, so the engine cannot hold it."""


def default_engine_kv_tokens(longest: int, requests: int = 4) -> int:
    """The engine's KV cache by default: room for `requests` (four) of the longest requests (prompt and answer)."""
    return requests * -(-longest // 256) * 256


def find_trace(path: str | Path) -> Path:
    """The trace file; the default relative path is tried against the cwd and the repository root."""
    p = Path(path)
    if p.exists():
        return p
    if not p.is_absolute():
        repo = Path(__file__).resolve().parents[3]  # src/kvprefetch/workload/ -> the repository root
        if (repo / p).exists():
            return repo / p
    raise FileNotFoundError(f"trace not found: {path}")


def trace_workload(spec: TraceBench, concurrencies: list[int], vocab_size: int) -> BenchWorkload:
    path = find_trace(spec.path)
    scale, note = fit_block_tokens(spec.length_scale, spec.chunk_tokens)
    scaling = TraceScaling(scale, spec.time_scale)
    reqs = read_mooncake_trace(path, scaling, seed=spec.seed)
    kv = spec.engine_kv_tokens or default_engine_kv_tokens(spec.max_prompt_tokens + spec.max_output_tokens)
    level_tokens = max(spec.level_tokens, math.ceil(KV_MARGIN * kv))
    needs = [LevelNeed(spec.requests_for(c), level_tokens) for c in concurrencies]
    rule = SampleRule(spec.window_start, spec.max_prompt_tokens, strata=spec.strata, seed=spec.seed)
    sample = sample_conversations(reqs, needs, rule)
    prelude = [Session(f"p{k}", 0.0, [Turn(r.token_ids(vocab_size).tolist(), 1)]) for k, r in enumerate(sample.prelude)]
    levels: dict[int, list[Session]] = {}
    for c, convs in zip(concurrencies, sample.levels, strict=True):
        levels[c] = _conversation_sessions(c, convs, spec, vocab_size) if spec.use_timestamps else [
            Session(f"c{c}-r{r.session_id}", 0.0, [Turn(r.token_ids(vocab_size).tolist(),
                                                          min(r.output_len, spec.max_output_tokens))])
            for r in spaced_order(convs, kv)
        ]  # fmt: skip
    declared = {
        "kind": "trace",
        **asdict(spec),
        "path": str(path),
        "length_scale_replayed": scale,
        "length_scale_note": note,
        "block_tokens": scaling.block_tokens,
        "level_min_prompt_tokens": level_tokens,
        "sample": sample.summary(),
        "requests_per_level": {str(c): n for c, n in zip(concurrencies, map(_requests, sample.levels), strict=True)},
    }
    return BenchWorkload(f"trace:{path.name}", declared, prelude, levels)


def workload_from_declared(declared: dict, concurrencies: list[int], vocab_size: int) -> BenchWorkload:
    """A run's workload regenerated from what it declared (results.json's `workload`): the generators are
    deterministic, so this is token for token what the run replayed."""
    trace = declared.get("kind") == "trace"  # else a chat-shaped workload: "chat", or its variants ("context")
    spec_cls, build = (TraceBench, trace_workload) if trace else (ChatBench, chat_workload)
    spec = spec_cls(**{f.name: declared[f.name] for f in fields(spec_cls) if f.name in declared})
    return build(spec, list(concurrencies), vocab_size)


def _conversation_sessions(c: int, convs: list[list], spec: TraceBench, vocab_size: int) -> list[Session]:
    """With timestamps: one session a conversation, arriving when it does in the trace (relative to the level's
    first); a later turn waits for the one before it, then for the trace's gap between their arrivals."""
    t0 = min(conv[0].arrival_s for conv in convs)
    return [
        Session(f"c{c}-g{conv[0].session_id}", conv[0].arrival_s - t0,
                [Turn(r.token_ids(vocab_size).tolist(), min(r.output_len, spec.max_output_tokens),
                      r.arrival_s - prev.arrival_s if prev is not None else 0.0)
                 for prev, r in zip([None, *conv], conv, strict=False)])
        for conv in convs
    ]  # fmt: skip


def _requests(conversations: list[list]) -> int:
    return sum(map(len, conversations))


def apply_utilisation(w: BenchWorkload, prefill_tokens_per_s: float, target: float) -> float | None:
    """Scale a trace replay's times so that recomputing its levels' prompts at the measured prefill speed would
    keep the engine `target` busy over their arrival spans; returns the factor applied (also declared)."""
    span = work = 0.0
    for sessions in w.levels.values():
        span += max((s.arrival_s + sum(t.think_s for t in s.turns[1:]) for s in sessions), default=0.0)
        work += sum(len(t.tokens) for s in sessions for t in s.turns) / prefill_tokens_per_s
    factor = utilisation_time_factor(span, work, target)
    if factor is None:
        return None
    for sessions in w.levels.values():
        for s in sessions:
            s.arrival_s *= factor
            for t in s.turns:
                t.think_s *= factor
    w.declared["time_scale"] = w.declared.get("time_scale", 1.0) * factor
    w.declared["utilisation_time_factor"] = factor
    return factor


def reuse_summary(w: BenchWorkload, chunk_tokens: int) -> dict:
    """Share of measured prompt tokens that the prelude (or an earlier request) holds as whole chunks: the
    prefix-cache model (`workload.prefix_cache`) on the replayed tokens' chunks, with an unbounded cache."""

    def chunk_ids(tokens: list[int]) -> list[bytes]:
        arr = np.asarray(tokens, dtype=np.int64)
        out, h = [], b""
        for k in range(len(arr) // chunk_tokens):
            h = hashlib.blake2b(h + arr[k * chunk_tokens : (k + 1) * chunk_tokens].tobytes(), digest_size=16).digest()
            out.append(h)
        return out

    prelude = [t.tokens for s in w.prelude for t in s.turns]
    measured = [t.tokens for c in w.levels for s in w.levels[c] for t in s.turns]
    hits = prefix_hits(chunk_ids(t) for t in [*prelude, *measured])[len(prelude) :]
    reusable = chunk_tokens * sum(hits)
    total = sum(map(len, measured))
    return {"prompt_tokens": total, "reusable_tokens": reusable, "reusable_share": reusable / total if total else 0.0}
