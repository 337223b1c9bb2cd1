"""A per-request timeline of the connector, for finding out where a request waited.

Off unless ``KVPREFETCH_TIMELINE`` names a file. Then both halves of the connector (the scheduler's process and
every worker) append one JSON line per event to it: when a request arrived, was reached and what the rule
planned, when its reads started and each landed, when the worker started its async load and copied each chunk,
and when vLLM was told it finished. Lines carry ``time.monotonic()`` (one clock for every process of the node)
and the pid, so the halves merge into one timeline. Aggregates (counters, step logs) say *that* a round was
slow; only a per-request timeline says which wait made it slow (issue 48: a parked request waited 10-20 s).
"""

from __future__ import annotations

import json
import os
import threading
import time
from typing import Any

ENV = "KVPREFETCH_TIMELINE"


class Timeline:
    def __init__(self, path: str | None = None):
        path = path if path is not None else os.environ.get(ENV)
        self._file = open(path, "a", buffering=1) if path else None  # noqa: SIM115 (lives as long as the process)
        self._lock = threading.Lock()

    def __bool__(self) -> bool:
        return self._file is not None

    def event(self, ev: str, req: str | None = None, **fields: Any) -> None:
        if self._file is None:
            return
        line = json.dumps({"t": round(time.monotonic(), 4), "pid": os.getpid(), "ev": ev, "req": req} | fields)
        with self._lock:
            self._file.write(line + "\n")


_TIMELINE: Timeline | None = None


def timeline() -> Timeline:
    """This process's timeline (opened on first use)."""
    global _TIMELINE
    if _TIMELINE is None:
        _TIMELINE = Timeline()
    return _TIMELINE
