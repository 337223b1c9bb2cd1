"""The serving soak's load: conversations that grow turn by turn, sent through vLLM's OpenAI completions API.

The tiny model's tokenizer is one word a token (w0 .. w<vocab>), so a prompt is random words and equal text is
equal tokens.
"""

from __future__ import annotations

import json
import random
import time
from typing import Any

WORDS = 4000  # the tiny model's vocabulary is w0..w<vocab>: prompts use words under this
MAX_TOKENS = 8


def prompt_words(rng: random.Random, n: int) -> str:
    return " ".join(f"w{rng.randrange(5, WORDS)}" for _ in range(n))


class Conversation:
    """One session: a head of `head` words, then turns of `turn` words, each appending the last answer; a new
    conversation once it would pass `max_words` (~1.5 tokens a word: under the server's 4096-token context)."""

    def __init__(self, seed: int, head: int = 600, turn: int = 40, max_words: int = 2000):
        self.rng = random.Random(seed)
        self.head, self.turn, self.max_words = head, turn, max_words
        self.text = prompt_words(self.rng, head)

    def next_prompt(self) -> str:
        if len(self.text.split()) + self.turn > self.max_words:
            self.text = prompt_words(self.rng, self.head)  # a new conversation on the same session
        self.text += " " + prompt_words(self.rng, self.turn)
        return self.text

    def answered(self, answer: str) -> None:
        self.text += " " + answer.strip()


def _body(prompt: str, max_tokens: int, stream: bool) -> dict:
    return {"model": "tiny", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "stream": stream}


class Unfinished(RuntimeError):
    """A stream that ended without its answer: the server aborted the request (vLLM does so to the requests it
    holds when it shuts down) or sent an error. A failed request, not a wrong answer: its text is only a part."""


async def complete(client: Any, url: str, prompt: str, max_tokens: int = MAX_TOKENS) -> tuple[str, float]:
    """Stream one greedy completion (an httpx.AsyncClient); (its text, TTFT: the first chunk's arrival). Raises
    `Unfinished` unless the stream ends with the answer whole (finish_reason "length" or "stop")."""
    t0 = time.monotonic()
    ttft, text, finish = None, [], None
    async with client.stream("POST", f"{url}/v1/completions", json=_body(prompt, max_tokens, True)) as r:
        r.raise_for_status()
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            if ttft is None:
                ttft = time.monotonic() - t0
            event = json.loads(line[6:])
            if "error" in event:
                raise Unfinished(f"error in the stream: {event['error']}")
            choice = event["choices"][0]
            text.append(choice["text"])
            finish = choice.get("finish_reason") or finish
    if finish not in ("length", "stop"):
        raise Unfinished(f"the stream ended with finish_reason={finish!r} after {len(''.join(text))} characters")
    return "".join(text), ttft if ttft is not None else time.monotonic() - t0


def complete_sync(url: str, prompt: str, max_tokens: int = MAX_TOKENS, timeout: float = 120) -> str:
    import httpx

    r = httpx.post(f"{url}/v1/completions", json=_body(prompt, max_tokens, False), timeout=timeout)
    r.raise_for_status()
    return r.json()["choices"][0]["text"]
