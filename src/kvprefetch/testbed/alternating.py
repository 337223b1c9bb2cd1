"""A client of several engines at once (the bench's two-instance and two-node scenarios): each session's turns
routed between the engines, turn k only after turn k-1 finished on whichever engine served it."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable

from kvprefetch.testbed import protocol as P
from kvprefetch.testbed.client import EngineError
from kvprefetch.testbed.sessions import SessionSchedule
from kvprefetch.testbed.snapshots import merge_snapshots


def session_plan(sessions: list) -> list[dict]:
    """What the coordinator schedules of a level's sessions (`workload.replay.Session`): each one's arrival and
    its turns' think times (the engines read the tokens from the workload file)."""
    return [{"arrival_s": s.arrival_s, "turns": [{"think_s": t.think_s} for t in s.turns]} for s in sessions]


def drive_alternating(engines: list, sessions: list[dict], concurrency: int, timeout_s: float, tag: str, *,
                      file: str, level: int, clock: Callable[[], float] = time.monotonic,
                      idle_s: float = 0.001, route: Callable[[int, int], int] | None = None) -> dict:  # fmt: skip
    """Sessions start as the single-engine driver starts them (arrival order, at most `concurrency` at once), and
    turn k of every session goes to engine k mod n (they alternate) or `route(session, k)`, only after turn k-1
    finished (on whichever engine served it) plus its think time. Engines run the
    `serve` protocol of `engine_proc`; times are seconds since t0 on the machine's monotonic clock, shared by all
    processes. Returns what one engine's `run` returns (records, wall_s, errors, before/after counters summed),
    and t0."""
    t0 = clock()
    for eng in engines:
        eng.call(P.Serve(file=file, level=level, tag=tag, t0=t0))
    schedule = SessionSchedule(sessions, concurrency)
    inflight = 0
    recs: list[dict] = []
    errors: list[str] = []

    def on_done(rec: dict, now: float) -> None:
        nonlocal inflight
        inflight -= 1
        i, k = int(rec.pop("session")), int(rec["turn"])
        recs.append(rec)
        schedule.turn_done(i, k, now, ok=rec.get("error") is None)

    deadline = t0 + timeout_s
    try:
        while schedule.waiting() or inflight:
            now = clock() - t0
            schedule.start_sessions(now)
            for arrival, i, k in schedule.pop_due(now):
                e = route(i, k) if route is not None else k % len(engines)
                engines[e].send(P.Add(i=i, k=k, arrival=arrival))
                inflight += 1
            got = False
            for e, eng in enumerate(engines):
                while (msg := eng.poll()) is not None:
                    if isinstance(m := P.serve_message(msg), P.Done):
                        got = True
                        on_done(m.rec | {"engine": e}, clock() - t0)
            if clock() > deadline:
                errors.append(f"cell timed out after {timeout_s:.0f}s")
                break
            if not got:
                time.sleep(idle_s)
    except BaseException:  # an engine failed (or this process was interrupted): end every engine's serve loop
        _abandon(engines)
        raise
    wall = clock() - t0
    finals = [_end(eng, e, recs) for e, eng in enumerate(engines)]
    foreign = [f.foreign_cpu_cores for f in finals if f.foreign_cpu_cores is not None]
    return {
        "records": recs,
        "t0": t0,
        "wall_s": wall,
        "errors": errors,
        # each engine counts the other as foreign: the smaller of the two is the closest to "the rest"
        "foreign_cpu_cores": min(foreign) if foreign else None,
        "before": merge_snapshots([f.before for f in finals]),
        "after": merge_snapshots([f.after for f in finals]),
    }


def _abandon(engines: list, timeout_s: float = 30.0) -> None:
    """Every engine told `End` and its serve loop's remaining messages read (up to its `Served`, its error, or
    `timeout_s`), so that the next request to it gets its own answer and not a stale event; an engine whose loop
    failed still reads stdin until `End`, which this sends it too."""
    for eng in engines:
        with contextlib.suppress(Exception):
            eng.send(P.End())
    for eng in engines:
        deadline = time.monotonic() + timeout_s
        with contextlib.suppress(Exception):
            while (left := deadline - time.monotonic()) > 0:
                msg = eng.poll(timeout=left)
                if msg is None or isinstance(P.serve_message(msg), P.Served):
                    break


def _end(eng, e: int, recs: list[dict]) -> P.Served:
    """Engine e told `End`: the records of the requests it aborted (the cell timed out) added to `recs`, then
    its last message."""
    eng.send(P.End())
    while True:
        msg = eng.poll(timeout=600)
        if msg is None:
            raise EngineError(f"engine {e} did not finish serving")
        m = P.serve_message(msg)
        if isinstance(m, P.Served):
            return m
        recs.append({k: v for k, v in m.rec.items() if k != "session"} | {"engine": e})
