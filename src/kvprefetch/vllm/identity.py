"""A request's identity beyond its tokens, carried into its chunk keys as vLLM carries it into its block hashes.

A chunk's KV depends on more than its tokens and the tokens before it. vLLM's prefix cache hashes every block as
``hash(parent, tokens, extra_keys)``, the extra keys coming from `generate_block_hash_extra_keys`: the LoRA adapter
(its k/v projections differ from the base model's), each multimodal item whose placeholder tokens fall in the
block (the same placeholder tokens stand for any image), the cache salt (first block only, so the whole chain
differs: a tenant must not learn another's prompts by timing hits) and a digest of the block's prompt embeddings
(whose token ids are all 0). KV computed under one identity is a wrong answer under another, so each chunk key
carries the same things (`Identity.chunk_extras`, passed to `ChunkKeyer.keys`), with two changes that make them
hold across processes, restarts and nodes:

* the adapter is named by its name and a fingerprint of its files (`adapter_fingerprint`), never by vLLM's
  per-process integer id nor by its path alone: a name rebound to other weights misses, on any node;
* a multimodal item is its content hash (vLLM's ``identifier``) and its offset from the chunk's first token.

One function builds the identity of a request (`request_identity`); the scheduler side keys every rank's chunks
with it, and the warm-up API builds the same `Identity` from what a completion would name (`Identity` fields).
A request whose identity this module cannot establish (an adapter whose files the scheduler's process cannot
read; something vLLM folds into its hashes that this module does not know) is `Untiered`: served without the
tiers (no load, no save, no warm-up), counted by reason. Never loaded on a guess.
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import blake3

log = logging.getLogger("kvprefetch.vllm")

# Why a request is served without the tiers (`Untiered.reason`; the label of
# ``vllm:kvprefetch_untiered_requests_total{reason}``).
UNTIERED_REASONS: dict[str, str] = {
    "adapter_unreadable": "its LoRA adapter's files cannot be read here, so they cannot be fingerprinted",
    "unknown_extra_key": "vLLM folds something into its block hashes that kvprefetch does not know how to key",
    "mm_unhashed": "a multimodal item has no content hash",
}
# The extra keys vLLM's prefix cache folds into a block's hash (vLLM 0.32), by their tag.
KNOWN_EXTRA_KEYS = frozenset({"lora", "mm", "cache_salt", "prompt_embeds"})
# The files of a LoRA adapter vLLM reads (`LoRAModel.from_local_checkpoint`): its config, weights, new embeddings.
ADAPTER_FILE_PREFIXES = ("adapter_", "new_embeddings")


@dataclass(frozen=True)
class Adapter:
    """A LoRA adapter as chunk keys name it: its name and a fingerprint of its files."""

    name: str
    fingerprint: str


@dataclass(frozen=True)
class MMItem:
    """A multimodal item: vLLM's content hash of it and where its placeholder tokens are in the prompt."""

    identifier: str
    offset: int
    length: int


@dataclass(frozen=True)
class Untiered:
    """A request served without the tiers, and why (a key of `UNTIERED_REASONS`)."""

    reason: str
    detail: str = ""


@dataclass(frozen=True, eq=False)
class Identity:
    """What a request's KV depends on beyond its tokens. The default (all empty) is a plain token prompt of the
    base model: its chunk keys are the tokens' alone."""

    adapter: Adapter | None = None
    cache_salt: str | None = None
    mm: tuple[MMItem, ...] = ()
    prompt_embeds: Any = None  # torch.Tensor [tokens, hidden]: the prompt's embeddings (their token ids are 0)
    embeds_mask: Any = None  # torch.Tensor [tokens] of bool: positions given as token ids (mixed prompts)

    @property
    def plain(self) -> bool:
        return self.adapter is None and not self.cache_salt and not self.mm and self.prompt_embeds is None

    def chunk_extras(self, first: int, end: int, chunk_tokens: int) -> list[bytes]:
        """One digest per chunk in [first, end) of what its KV depends on beyond its tokens (b"": nothing)."""
        return [self._chunk_extra(i, chunk_tokens) for i in range(first, end)]

    def _chunk_extra(self, i: int, chunk_tokens: int) -> bytes:
        start, end = i * chunk_tokens, (i + 1) * chunk_tokens
        parts: list[tuple[Any, ...]] = []
        if self.adapter is not None:
            parts.append(("lora", self.adapter.name, self.adapter.fingerprint))
        if i == 0 and self.cache_salt:
            parts.append(("cache_salt", self.cache_salt))
        parts.extend(("mm", m.identifier, m.offset - start) for m in self.mm if _overlaps(m, start, end))
        if self.prompt_embeds is not None and start < len(self.prompt_embeds):
            parts.append(("prompt_embeds", _tensor_digest(self.prompt_embeds[start:end]),
                          _tensor_digest(self.embeds_mask[start:end]) if self.embeds_mask is not None else b""))
        # repr of tuples of str, int and bytes is canonical: the same on every process and node
        return blake3.blake3(repr(tuple(parts)).encode()).digest() if parts else b""


def _overlaps(item: MMItem, start: int, end: int) -> bool:
    return item.offset < end and start < item.offset + item.length


def _tensor_digest(t: Any) -> bytes:
    """blake3 of a tensor's dtype, shape and bytes."""
    from vllm.v1.utils import tensor_data

    t = t.detach().cpu().contiguous()
    h = blake3.blake3(f"{t.dtype}:{tuple(t.shape)}".encode())
    h.update(tensor_data(t))
    return h.digest()


# ---- from a vLLM request ---------------------------------------------------------------------------------------
def request_identity(request: Any, block_size: int) -> Identity | Untiered:
    """The identity of a vLLM `Request` (scheduler side). ``block_size``: vLLM's hash block size, with which vLLM's
    own extra keys of the request's first block are read to check that this module knows every kind of them."""
    unknown = _unknown_extra_keys(request, block_size)
    if unknown:
        return Untiered("unknown_extra_key", ", ".join(sorted(unknown)))
    lora = request.lora_request
    mm = mm_items(request.mm_features or ())
    named = named_identity(lora.lora_name if lora else None, lora.lora_path if lora else None, request.cache_salt, mm)
    if isinstance(named, Untiered) or request.prompt_embeds is None:
        return named
    mask = request.prompt_is_token_ids
    return Identity(named.adapter, named.cache_salt, named.mm, request.prompt_embeds,
                    None if mask is None else _as_tensor(mask))  # fmt: skip


def named_identity(
    lora_name: str | None = None,
    lora_path: str | None = None,
    cache_salt: str | None = None,
    mm: tuple[MMItem, ...] = (),
) -> Identity | Untiered:
    """The identity of a prompt named by what a completion names (the adapter vLLM resolved its model name to, its
    cache salt, its multimodal items): what `request_identity` gives the request, and what the warm-up API keys."""
    if any(not m.identifier for m in mm):
        return Untiered("mm_unhashed", ", ".join(f"item at {m.offset}" for m in mm if not m.identifier))
    adapter: Adapter | None = None
    if lora_name is not None:
        fingerprint = adapter_fingerprint(lora_path) if lora_path else None
        if fingerprint is None:
            return Untiered("adapter_unreadable", f"{lora_name}: {lora_path}")
        adapter = Adapter(lora_name, fingerprint)
    return Identity(adapter, cache_salt or None, mm)


def _as_tensor(mask: Any) -> Any:
    import torch

    return mask if isinstance(mask, torch.Tensor) else torch.tensor(list(mask), dtype=torch.bool)


def _unknown_extra_keys(request: Any, block_size: int) -> set[str]:
    """Tags of the extra keys vLLM folds into the hash of the request's first block that this module does not
    know (empty: none, or the prompt has no whole block). Reads vLLM's cached per-block embedding digests, so it
    computes nothing vLLM did not."""
    if request.num_tokens < block_size:
        return set()
    from vllm.v1.core.kv_cache_utils import generate_block_hash_extra_keys

    extra, _ = generate_block_hash_extra_keys(request, 0, block_size, 0)
    return {str(key[0]) if isinstance(key, tuple) and key else repr(key) for key in extra or ()} - KNOWN_EXTRA_KEYS


def mm_items(features: Iterable[Any]) -> tuple[MMItem, ...]:
    """vLLM's multimodal features (``Request.mm_features``) as chunk keys name them (an item without a content hash
    has identifier "": `named_identity` refuses it)."""
    items = [MMItem(str(f.identifier or ""), int(f.mm_position.offset), int(f.mm_position.length)) for f in features]
    return tuple(sorted(items, key=lambda m: m.offset))


# ---- an adapter's fingerprint -----------------------------------------------------------------------------------
_fingerprints: dict[str, tuple[tuple, str]] = {}  # path -> (its files' stat signature, fingerprint)
_fingerprint_lock = threading.Lock()


def adapter_fingerprint(path: str | os.PathLike) -> str | None:
    """blake3 of a LoRA adapter's files (names and bytes of its ``adapter_*`` and ``new_embeddings*`` files), or None
    when the directory or its weights cannot be read. Cached per path while the files' inode, size and mtime stay
    the same: an adapter rewritten in place gets a new fingerprint, so what was saved under the old weights misses."""
    files = _adapter_files(Path(path))
    if files is None:
        return None
    signature = tuple((f.name, st.st_ino, st.st_size, st.st_mtime_ns) for f, st in files)
    with _fingerprint_lock:
        cached = _fingerprints.get(str(path))
    if cached is not None and cached[0] == signature:
        return cached[1]
    # (memory-mapped, on every core: a large adapter's first request waits for this once per process)
    h = blake3.blake3(b"kvprefetch-lora-v1\0", max_threads=blake3.blake3.AUTO)
    try:
        for f, _ in files:
            h.update(f.name.encode() + b"\0")
            h.update_mmap(f)
    except OSError as err:
        log.warning("kvprefetch: LoRA adapter %s cannot be read (%s)", path, err)
        return None
    fingerprint = h.hexdigest()
    with _fingerprint_lock:
        _fingerprints[str(path)] = (signature, fingerprint)
    return fingerprint


def _adapter_files(path: Path) -> list[tuple[Path, os.stat_result]] | None:
    """The adapter's files with their stat, by name (None: no such directory, or no weights in it)."""
    try:
        files = sorted((p, p.stat()) for p in path.iterdir() if p.name.startswith(ADAPTER_FILE_PREFIXES))
    except OSError:
        return None
    files = [(p, st) for p, st in files if p.is_file()]
    if not any(p.name.startswith("adapter_model") for p, _ in files):
        return None
    return files


def event_extra_keys(request: Any, first_block: int, end_block: int, block_size: int) -> list[Any] | None:
    """vLLM's extra keys of blocks [first_block, end_block) as its KV events publish them (`to_event_extra_keys`):
    what a router that hashes blocks itself needs to reproduce their hashes."""
    from vllm.v1.core.kv_cache_utils import generate_block_hash_extra_keys, to_event_extra_keys

    keys, mm_idx = [], 0
    for b in range(first_block, end_block):
        extra, mm_idx = generate_block_hash_extra_keys(request, b * block_size, (b + 1) * block_size, mm_idx)
        keys.append(extra)
    return to_event_extra_keys(keys)

