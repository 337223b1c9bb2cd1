"""Reader for Mooncake-format traces, with declared scaling of lengths and time."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

from kvprefetch.workload.request import BLOCK_TOKENS, Request, TokenRecipe

DEFAULT_TRACE = Path("../shared/data/mooncake/synthetic_trace.jsonl")
"""Where CI keeps the FAST'25 synthetic trace, relative to the repository root (never copied in)."""


@dataclass(frozen=True)
class TraceScaling:
    """How a trace is shrunk to fit a machine; reported next to any result that used it.

    `length_scale` shrinks every 512-token block to `512 * length_scale` tokens, so the prefix-sharing
    structure (which hash ids repeat, and where) is kept exactly. `time_scale` multiplies arrival times
    (2.0 = half the rate). `max_requests` keeps the first N requests.
    """

    length_scale: float = 1.0
    time_scale: float = 1.0
    max_requests: int | None = None

    @property
    def block_tokens(self) -> int:
        size = BLOCK_TOKENS * self.length_scale
        if size < 1 or abs(size - round(size)) > 1e-9:
            raise ValueError(f"512 * length_scale must be a whole number >= 1, got {size}")
        return round(size)


def read_mooncake_trace(path: str | Path, scaling: TraceScaling | None = None, seed: int = 0) -> list[Request]:
    """Requests of a Mooncake JSON-lines trace (`timestamp` ms, lengths, 512-token prefix `hash_ids`).

    Each line is one independent request (session_id = line number, turn 0): the trace does not say
    which requests belong to one conversation, only which prefix blocks they share.
    """
    scaling = scaling or TraceScaling()
    size = scaling.block_tokens
    recipe = TokenRecipe("trace", seed, size)
    out: list[Request] = []
    with Path(path).open() as fh:
        for lineno, line in enumerate(fh, start=1):
            if not line.strip():
                continue
            if scaling.max_requests is not None and len(out) >= scaling.max_requests:
                break
            try:
                row = json.loads(line)
                ids = tuple(int(h) for h in row["hash_ids"])
                in_len = max(1, math.ceil(int(row["input_length"]) * scaling.length_scale))
                out_len = max(1, math.ceil(int(row["output_length"]) * scaling.length_scale))
                arrival = float(row["timestamp"]) / 1000.0 * scaling.time_scale
                if not ids:
                    raise ValueError("no hash_ids")
            except (ValueError, KeyError, TypeError) as err:
                what = f"missing {err}" if isinstance(err, KeyError) else str(err)
                raise ValueError(
                    f"{path}:{lineno}: not a Mooncake trace line ({what}); each line is a JSON object with "
                    "timestamp (ms), input_length, output_length and hash_ids"
                ) from None
            in_len = min(in_len, len(ids) * size)
            out.append(Request(arrival, len(out), 0, in_len, out_len, ids, recipe))
    return out
