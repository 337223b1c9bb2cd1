"""The model's KV cache groups, as the connector serves them (issue 62: hybrid models).

vLLM's hybrid KV cache manager splits a model's attention layers into groups of one kind each (full attention,
sliding window, MLA, ...); each group has its own block table over one shared block pool, so a token's KV sits in
a different block in each group. A chunk holds every layer of every group for its tokens, group after group
(`KVGroups.layer_names`); its block ids, in a `LoadJob`/`SaveJob`, are each group's ``blocks_per_chunk`` ids in
the same order (`KVGroups.chunk_ids`). One group, the only layout before hybrid models, is the same chunk as
before, byte for byte, under the same keys.

What a group needs of a prefix is its kind's: a full-attention group every block before the prefix's end; a
sliding-window group only the blocks inside the window before that end (vLLM frees the others as the request
advances, `SlidingWindowManager.remove_skipped_blocks`, and replaces them in the request's table by its null
block). Two invariants follow:

* **A chunk is saved only with every group's window tail resident** (`KVGroups.save_ids`): the blocks a hit
  ending at the chunk's end would need. A chunk saved in the step that computes its last token always has them
  (vLLM freed only blocks before the window of the step's *first* token); one whose save comes later (its tokens
  came from vLLM's own prefix cache, which keeps no block outside the window) may not, and is then not saved: a
  hit ending there would load pages vLLM no longer had. Its pages outside the window are saved as the null
  block's (never loaded).
* **A load writes only what vLLM allocated and needs** (`KVGroups.load_ids`): a windowed group's blocks inside
  the window before the hit's end, none of vLLM's null blocks.

Kinds the connector cannot serve (state-space/linear attention keeps one state per request, not per token;
chunked local attention) are refused at start-up, naming the group's kind (`served_group`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

NULL_BLOCK = 0  # vLLM's null block (`BlockPool.null_block`: the pool's first block, never a request's own KV)
SKIP = -1  # a block id a load leaves alone (`PagedKV.scatter_*`: already on the engine, or not needed)

# Kinds whose every block before a position is read by it, and kinds that read only a window before it.
EVERY_BLOCK_KINDS = frozenset({"full_attention", "mla_attention", "sink_full_attention"})
WINDOWED_KINDS = frozenset({"sliding_window", "sliding_window_mla"})
# Kinds whose KV is the same on every tensor-parallel rank: MLA's one latent vector per token, shared by every head
# (vLLM replicates it on each rank). Such a model's chunk is stored once for all ranks (`KVGroups.replicated`).
REPLICATED_KINDS = frozenset({"mla_attention", "sliding_window_mla"})


@dataclass(frozen=True)
class KVGroup:
    """One KV cache group: vLLM's index of it, its kind (as `KVCacheSpecKind` names it), its layers, and for a
    windowed kind how many tokens before a position its attention still reads (``window``; None: all)."""

    index: int
    kind: str
    layer_names: tuple[str, ...]
    window: int | None = None

    def needed_from(self, end: int) -> int:
        """The first token whose KV the token at ``end`` reads (vLLM's ``get_num_skipped_tokens(end)``)."""
        return 0 if self.window is None else max(0, end - self.window)


@dataclass(frozen=True)
class KVGroups:
    """Every group of the model, in vLLM's order, over one block size (a chunk is whole blocks of each)."""

    groups: tuple[KVGroup, ...]
    block_size: int

    @classmethod
    def single(cls, layer_names: Sequence[str], block_size: int, kind: str = "full_attention") -> KVGroups:
        return cls((KVGroup(0, kind, tuple(layer_names)),), block_size)

    @property
    def layer_names(self) -> tuple[str, ...]:
        """Every layer in chunk order: group after group."""
        return tuple(n for g in self.groups for n in g.layer_names)

    @property
    def layer_groups(self) -> tuple[int, ...]:
        """Per layer in chunk order, the position of its group (its block ids' slot in a chunk's ids)."""
        return tuple(i for i, g in enumerate(self.groups) for _ in g.layer_names)

    @property
    def windowed(self) -> bool:
        return any(g.window is not None for g in self.groups)

    @property
    def hybrid(self) -> bool:
        return len(self.groups) > 1

    @property
    def replicated(self) -> bool:
        """Every rank holds the same KV (MLA): one copy serves them all, keyed without the rank."""
        return all(g.kind in REPLICATED_KINDS for g in self.groups)

    def describe(self) -> str:
        """The groups' structure, for the namespace's layout tag (only a hybrid model's tag carries it, so a
        one-group model keeps its keys): which layers a chunk holds in which order, and which pages are valid."""
        return "+".join(f"{g.kind}{'' if g.window is None else f'/w{g.window}'}x{len(g.layer_names)}"
                        for g in self.groups)  # fmt: skip

    def kinds(self) -> tuple[tuple[int, str], ...]:
        """(vLLM's group index, kind) of every group: what the KV events carry."""
        return tuple((g.index, g.kind) for g in self.groups)

    # ---- a chunk's block ids --------------------------------------------------------------------------------
    def tables(self, block_ids: Sequence[int] | Sequence[Sequence[int]]) -> tuple[list[int], ...]:
        """A request's block ids as one list per group (`per_group`), a group vLLM gave none for as empty."""
        tables = per_group(block_ids)
        return tables + ([],) * (len(self.groups) - len(tables))

    def _block(self, ids: Sequence[int], b: int) -> int:
        return int(ids[b]) if b < len(ids) else NULL_BLOCK

    def load_ids(self, tables: Sequence[Sequence[int]], c: int, per: int, start_tok: int, end_tok: int) -> list[int]:
        """Chunk c's block ids for a load ending at token ``end_tok`` (the hit's end), group after group:
        `SKIP` for a block before ``start_tok`` (the engine's own already), outside a group's window before the
        hit's end, or vLLM's null block there."""
        out: list[int] = []
        for g, ids in zip(self.groups, tables, strict=True):
            first = g.needed_from(end_tok)
            for b in range(c * per, (c + 1) * per):
                bid = self._block(ids, b)
                needed = b * self.block_size >= start_tok and (b + 1) * self.block_size > first
                out.append(bid if needed and bid != NULL_BLOCK else SKIP)
        return out

    def save_ids(self, tables: Sequence[Sequence[int]], c: int, per: int) -> list[int] | None:
        """Chunk c's block ids to save, group after group, or None when a block a hit ending at the chunk's end
        needs is no longer resident (vLLM's null block there); a windowed group's blocks before its window are
        saved as the null block's page (never loaded)."""
        end = (c + 1) * per * self.block_size
        out: list[int] = []
        for g, ids in zip(self.groups, tables, strict=True):
            first = g.needed_from(end)
            for b in range(c * per, (c + 1) * per):
                bid = self._block(ids, b)
                if (b + 1) * self.block_size <= first:
                    out.append(NULL_BLOCK)
                elif bid == NULL_BLOCK:
                    return None
                else:
                    out.append(bid)
        return out


def per_group(block_ids: Sequence[int] | Sequence[Sequence[int]]) -> tuple[list[int], ...]:
    """Block ids as one list per group; a flat list is the only group's (vLLM hands a tuple of lists per group)."""
    if block_ids and isinstance(block_ids[0], int):
        return (list(block_ids),)  # type: ignore[arg-type]
    return tuple(list(ids) for ids in block_ids)  # type: ignore[union-attr]


def window_of(spec: Any) -> int | None:
    """Tokens before a position that a windowed spec's attention (and vLLM's retention) reads: the tokens vLLM
    keeps below the next one, ``sliding_window - 1 + extra_retained_tokens``."""
    sw = getattr(spec, "sliding_window", None)
    if sw is None:
        return None
    return int(sw) - 1 + int(getattr(spec, "extra_retained_tokens", 0) or 0)


def served_group(index: int, kind: str, spec: Any, layer_names: Sequence[str], hybrid: bool) -> KVGroup:
    """The connector's view of vLLM's group ``index``; raises, naming the group's kind, for a kind it cannot serve.
    (A lone group of an unlisted kind is served as every-block, as before hybrid models: vLLM with its hybrid
    manager off turns every attention layer into full attention.)"""
    if kind in WINDOWED_KINDS:
        return KVGroup(index, kind, tuple(layer_names), window_of(spec))
    if kind in EVERY_BLOCK_KINDS or (not hybrid and kind != "mamba"):
        return KVGroup(index, kind, tuple(layer_names))
    raise NotImplementedError(
        f"KVPrefetchConnector cannot serve KV cache group {index} of kind {kind!r} "
        f"({len(layer_names)} layer{'' if len(layer_names) == 1 else 's'}, e.g. "
        f"{layer_names[0] if layer_names else '?'}): it serves "
        f"{', '.join(sorted(EVERY_BLOCK_KINDS | WINDOWED_KINDS))} groups; state-space/linear-attention and chunked "
        "local attention layers keep state the chunks do not hold"
    )
