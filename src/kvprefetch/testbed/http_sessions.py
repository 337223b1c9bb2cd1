"""A level's sessions sent over HTTP to an OpenAI server, or to a router in front of several, as a user's client
sends them: each turn a streamed `/v1/completions` request whose prompt is the turn's token ids (a router that
routes on KV for HTTP workers needs token ids: it does not tokenize), greedy, `ignore_eos` so every answer has the
workload's length.

Sessions are admitted as the engine process's driver admits them (`kvprefetch.testbed.sessions.SessionSchedule`):
arrival order, at most `concurrency` at once, turn k+1 `think_s` after turn k finished. Each request's record has
what `kvprefetch.bench.stats.cell_metrics` reads of an engine's (times in seconds since t0 on this process's
monotonic clock): its due time (`arrival`), its first streamed token, its end, its prompt and answer tokens, the
prompt tokens the server found cached (its `usage.prompt_tokens_details`, with `--enable-prompt-tokens-details`),
its answer's text (a run compares answers across modes by it: a request with vLLM's ``return_token_ids`` is not
routed on KV by vllm-router 0.1.17, so the client does not ask for ids), the node that served it (the
``x-kvprefetch-node`` header its server adds, `kvprefetch.testbed.node_header`; None without one), and its error,
if any.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from kvprefetch.testbed.node_header import HEADER as NODE_HEADER
from kvprefetch.testbed.sessions import SessionSchedule

TIMEOUT_S = 300.0  # one request's


@dataclass(frozen=True)
class HttpTurn:
    """One turn as the client sends it."""

    tokens: list[int]
    max_tokens: int
    think_s: float = 0.0


@dataclass(frozen=True)
class HttpSession:
    sid: str
    arrival_s: float
    turns: list[HttpTurn] = field(default_factory=list)


def sessions_of(level: list[Any]) -> list[HttpSession]:
    """A workload level's sessions (`kvprefetch.workload.replay.Session`) as the client sends them."""
    return [HttpSession(s.sid, s.arrival_s, [HttpTurn(list(t.tokens), t.max_tokens, t.think_s) for t in s.turns])
            for s in level]  # fmt: skip


def body(model: str, tokens: list[int], max_tokens: int, extra: dict[str, Any] | None = None) -> dict[str, Any]:
    """A greedy streamed completion of `max_tokens` tokens whatever the model says (ignore_eos), with its usage;
    `extra`: more fields (a request's ``kv_transfer_params``)."""
    return {"model": model, "prompt": tokens, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
            "stream": True, "stream_options": {"include_usage": True}} | (extra or {})


@dataclass(frozen=True)
class Target:
    """Where a turn goes and what its request carries besides the prompt."""

    url: str
    model: str = "tiny"
    extra: dict[str, Any] | None = None


async def send_turn(client: Any, target: Target, turn: HttpTurn, t0: float) -> dict[str, Any]:
    """One streamed request (an httpx.AsyncClient); its record (times since t0), an error recorded, not raised."""
    rec: dict[str, Any] = {"prompt_tokens": len(turn.tokens), "output_tokens": 0, "first_token": None,
                           "output_text": "", "node": None}  # fmt: skip
    try:
        async with client.stream("POST", f"{target.url}/v1/completions", timeout=TIMEOUT_S,
                                 json=body(target.model, turn.tokens, turn.max_tokens, target.extra)) as r:  # fmt: skip
            rec["node"] = r.headers.get(NODE_HEADER)
            if r.status_code != 200:
                await r.aread()
                return rec | {"error": f"HTTP {r.status_code}: {r.text[:200]}", "finish": time.monotonic() - t0}
            async for line in r.aiter_lines():
                rec |= _event(line, t0, rec)
    except Exception as err:  # a dropped connection, a timeout: the request failed, the run goes on
        return rec | {"error": f"{type(err).__name__}: {err}"[:300], "finish": time.monotonic() - t0}
    done = rec.get("finish_reason") in ("length", "stop")
    return rec | {"finish": time.monotonic() - t0, "error": None if done else "the stream ended without its answer"}


def _event(line: str, t0: float, rec: dict[str, Any]) -> dict[str, Any]:
    """What one server-sent event adds to the request's record."""
    if not line.startswith("data: ") or line == "data: [DONE]":
        return {}
    event = json.loads(line[6:])
    if "error" in event:
        return {"error": str(event["error"])[:300]}
    out: dict[str, Any] = {}
    for choice in event.get("choices") or []:
        text = choice.get("text")
        if text and rec.get("first_token") is None:
            out["first_token"] = time.monotonic() - t0
        out["output_text"] = rec.get("output_text", "") + (text or "")
        out["output_tokens"] = rec.get("output_tokens", 0) + (1 if text is not None else 0)
        if choice.get("finish_reason"):
            out["finish_reason"] = choice["finish_reason"]
    if usage := event.get("usage"):
        details = usage.get("prompt_tokens_details") or {}
        out |= {"prompt_tokens": usage.get("prompt_tokens", rec.get("prompt_tokens")),
                "output_tokens": usage.get("completion_tokens", out.get("output_tokens")),
                "cached_tokens": details.get("cached_tokens")}  # fmt: skip
    return out


Route = Callable[[int, int], Target]
"""Session i's turn k -> where it goes (a router's URL for every turn, or a node's: a client that pins sessions)."""


def drive_http(url: str | Route, sessions: list[HttpSession], concurrency: int, timeout_s: float,
               model: str = "tiny") -> dict[str, Any]:  # fmt: skip
    """Every session's turns sent to `url` (or where `url(i, k)` says; see the module's docstring); what an
    engine's `run` returns: records, wall_s, errors (a cell that timed out says so), and t0."""
    route: Route = url if callable(url) else (lambda i, k, t=Target(url, model): t)
    return asyncio.run(_drive(route, sessions, concurrency, timeout_s))


async def _drive(route: Route, sessions: list[HttpSession], concurrency: int, timeout_s: float) -> dict[str, Any]:
    import httpx

    plan = [{"arrival_s": s.arrival_s, "turns": [{"think_s": t.think_s} for t in s.turns]} for s in sessions]
    schedule = SessionSchedule(plan, concurrency)
    t0 = time.monotonic()
    inflight: dict[asyncio.Task, tuple[int, int, float]] = {}
    records: list[dict[str, Any]] = []
    errors: list[str] = []
    async with httpx.AsyncClient(limits=httpx.Limits(max_connections=concurrency + 4)) as client:
        while schedule.waiting() or inflight:
            now = time.monotonic() - t0
            if now > timeout_s:
                errors.append(f"cell timed out after {timeout_s:.0f}s")
                break
            schedule.start_sessions(now)
            for arrival, i, k in schedule.pop_due(now):
                task = asyncio.create_task(send_turn(client, route(i, k), sessions[i].turns[k], t0))
                inflight[task] = (i, k, arrival)
            wait = schedule.next_event_s()
            pause = 0.05 if wait is None else min(0.05, max(0.0, wait - (time.monotonic() - t0)))
            if inflight:
                done, _ = await asyncio.wait(list(inflight), timeout=pause)
            else:
                done = set()
                await asyncio.sleep(pause)
            for task in done:
                i, k, arrival = inflight.pop(task)
                rec = {"sid": sessions[i].sid, "turn": k, "arrival": arrival} | task.result()
                records.append(rec)
                schedule.turn_done(i, k, time.monotonic() - t0, ok=rec.get("error") is None)
        for task in inflight:
            task.cancel()
    return {"records": records, "wall_s": time.monotonic() - t0, "errors": errors, "t0": t0}
