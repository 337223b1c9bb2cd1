"""Chained prefix keys: key_i = H(key_{i-1}, tokens of chunk i, extra_i).

Equal keys mean an equal whole prefix (not just an equal chunk), which is what makes a chunk's KV reusable:
attention KV depends on every token before it. Tokens are not always all a chunk's KV depends on: a LoRA adapter,
an image behind placeholder tokens, prompt embeddings, a tenant's cache salt change it too. The caller that knows
a request's identity (`kvprefetch.vllm.identity`) passes one digest per chunk, ``extra_i``; it enters the chain, so
it separates that chunk and every later one. A chunk with nothing beyond its tokens passes b"" (its key is then the
tokens' alone: the token bytes are fixed-length, so the extra digest after them is never ambiguous).
"""

from __future__ import annotations

from collections.abc import Sequence

import blake3
import numpy as np

from kvprefetch.keys.namespace import KVNamespace

KEY_BYTES = 32


class ChunkKeyer:
    """Turns token ids into the keys of their whole chunks."""

    def __init__(self, namespace: KVNamespace, chunk_tokens: int = 256):
        if chunk_tokens <= 0:
            raise ValueError(f"chunk_tokens must be positive, got {chunk_tokens}")
        self.namespace = namespace
        self.chunk_tokens = chunk_tokens
        self._root = blake3.blake3(namespace.digest + chunk_tokens.to_bytes(4, "little")).digest()

    def for_rank(self, tp_rank: int) -> ChunkKeyer:
        """The keyer of another tensor-parallel rank (same chunking, that rank's namespace)."""
        return ChunkKeyer(self.namespace.for_rank(tp_rank), self.chunk_tokens)

    def rank_keyers(self) -> list[ChunkKeyer]:
        """One keyer per tensor-parallel rank of the namespace's deployment, rank order."""
        return [self if r == self.namespace.tp_rank else self.for_rank(r) for r in range(self.namespace.tp_size)]

    def num_chunks(self, num_tokens: int) -> int:
        """Whole chunks in a prompt of num_tokens (a trailing partial chunk has no key)."""
        return num_tokens // self.chunk_tokens

    def keys(
        self,
        token_ids: Sequence[int] | np.ndarray,
        max_chunks: int | None = None,
        extras: Sequence[bytes] | None = None,
    ) -> list[bytes]:
        """Keys of the leading whole chunks of token_ids; ``extras[i]``: what else chunk i's KV depends on (a
        digest, b"" for nothing; None: nothing for any chunk). Raises if extras is shorter than the chunks keyed:
        a chunk keyed without its identity is the one mistake these keys exist to prevent."""
        tokens = np.asarray(token_ids, dtype=np.int64)
        n = self.num_chunks(len(tokens))
        if max_chunks is not None:
            n = min(n, max_chunks)
        if extras is not None and len(extras) < n:
            raise ValueError(f"{len(extras)} chunk extras for {n} chunks")
        keys: list[bytes] = []
        parent = self._root
        for i in range(n):
            chunk = tokens[i * self.chunk_tokens : (i + 1) * self.chunk_tokens]
            extra = extras[i] if extras is not None else b""
            parent = blake3.blake3(parent + chunk.astype("<i8").tobytes() + extra).digest()
            keys.append(parent)
        return keys
