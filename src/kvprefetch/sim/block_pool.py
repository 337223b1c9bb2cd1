"""The engine's KV as vLLM's block pool keeps it: a prefix cache that lives in the free blocks.

vLLM sets no room aside for its prefix cache. A finished request's blocks go to the tail of one free queue,
its last block first, and keep their contents until an allocation takes them from the head. So what survives
is decided by how much KV the running requests take meanwhile, not by a fixed cache size: with a small KV
(our CPU engine holds five prompts) a session's previous turn is gone by its next turn once a dozen others
run. Blocks in use are hits too (a shared system prompt), and are never evicted.

The simulator's blocks (`block_tokens`, the store's chunks) are larger than the engine's, so sizes are kept in
tokens: a request holds its prompt and answer rounded up to whole engine blocks.
"""

from __future__ import annotations

import itertools
from collections import Counter, OrderedDict


class BlockPool:
    """Cached block ids in use (with their holders' count) and the free queue, oldest-freed first."""

    def __init__(self, capacity_tokens: int, block_tokens: int):
        self.capacity = capacity_tokens
        self.block_tokens = block_tokens
        self.refs: Counter[int] = Counter()  # cached blocks held by running requests
        self.anonymous = 0  # tokens held without a cached id: partial blocks, answers, duplicates
        self.free_queue: OrderedDict[object, int] = OrderedDict()  # cached id or empty run -> its tokens
        self.queued = 0  # tokens in the free queue
        self._empty = itertools.count()

    def __contains__(self, block: int) -> bool:
        return block in self.refs or block in self.free_queue

    @property
    def free(self) -> int:
        """Tokens not held by a running request (cached or never used)."""
        return self.capacity - self.anonymous - len(self.refs) * self.block_tokens

    def cached_prefix(self, blocks) -> int:
        """How many of `blocks`, from the first, are cached (in use or free)."""
        n = 0
        for b in blocks:
            if b not in self:
                break
            n += 1
        return n

    def can_take(self, hits, tokens: int) -> bool:
        """Whether a request holding `tokens`, whose cached blocks are `hits`, fits in the free KV now."""
        in_use = sum(1 for b in hits if b in self.refs)
        return tokens - in_use * self.block_tokens <= self.free

    def take(self, prompt: list[int], hits: int, tokens: int, cache: bool = True) -> tuple[list[int], int]:
        """Hold a request's KV as the scheduler admits it: the first `hits` of its prompt's full blocks are
        cached; the rest of its `tokens` are allocated. Unless `cache` is False (an asynchronous load: vLLM
        caches those blocks once they have arrived, `cache_prompt`), its prompt blocks are cached from now on,
        as vLLM caches blocks when it schedules them. Returns what the request holds: (cached ids, other tokens)."""
        held = list(prompt[:hits])
        for b in held:
            if b not in self.refs:
                self._unqueue(b)
            self.refs[b] += 1
        new = tokens - hits * self.block_tokens
        self._evict_for(new)
        self.anonymous += new
        return self.cache_prompt((held, new), prompt) if cache else (held, new)

    def cache_prompt(self, held: tuple[list[int], int], prompt: list[int]) -> tuple[list[int], int]:
        """Cache the prompt blocks of a request holding `held` that are not cached yet; returns its new holding.
        A block whose content is cached already (in use or free) stays an anonymous copy, as in vLLM."""
        ids, anonymous = list(held[0]), held[1]
        for b in prompt:
            if b not in self:  # (what it holds is cached already)
                self.refs[b] = 1
                self.anonymous -= self.block_tokens
                anonymous -= self.block_tokens
                ids.append(b)
        return ids, anonymous

    def release(self, held: list[int], anonymous: int) -> None:
        """A request finished: its KV joins the free queue's tail in reverse (its answer first, its prompt's
        first block last), so a prompt's tail is evicted before its head; blocks others hold stay in use."""
        self.anonymous -= anonymous
        if anonymous > 0:
            self._enqueue(("empty", next(self._empty)), anonymous)
        for b in reversed(held):
            self.refs[b] -= 1
            if self.refs[b] <= 0:
                del self.refs[b]
                self._enqueue(b, self.block_tokens)

    def _evict_for(self, tokens: int) -> None:
        """Make `tokens` allocatable: never-used KV first, then the free queue's head (freed longest ago)."""
        short = tokens - (self.free - self.queued)
        while short > 0 and self.free_queue:  # an empty queue: a lone request larger than the KV, admitted
            _, size = self.free_queue.popitem(last=False)
            self.queued -= size
            short -= size

    def _enqueue(self, key: object, tokens: int) -> None:
        self.free_queue[key] = tokens
        self.queued += tokens

    def _unqueue(self, key: object) -> None:
        self.queued -= self.free_queue.pop(key)
