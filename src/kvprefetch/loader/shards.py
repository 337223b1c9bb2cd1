"""A checkpoint's safetensors shards, every one verified before a single byte of weights is used.

Why verify up front: vLLM copies tensors into the model as the loader yields them, so a problem found halfway
(a truncated shard, a header that does not add up, a shard of another model) would leave a half-loaded model.
Every shard's header is read and checked against its file size and against the checkpoint's index first; the
load starts only when the whole checkpoint adds up, and every error names the file and what is wrong.

The safetensors layout: 8 bytes little-endian header length N, N bytes of JSON header
({name: {dtype, shape, data_offsets: [begin, end]}, "__metadata__": {...}}), then the data region, whose
offsets the header gives relative to its start (8 + N).
"""

from __future__ import annotations

import json
import math
import os
import struct
from dataclasses import dataclass
from pathlib import Path

INDEX_NAME = "model.safetensors.index.json"
MAX_HEADER_BYTES = 100 << 20  # the safetensors library's own limit

# safetensors dtype name -> bytes per element
DTYPE_BYTES = {
    "BOOL": 1, "U8": 1, "I8": 1, "F8_E5M2": 1, "F8_E4M3": 1, "F8_E8M0": 1,
    "I16": 2, "U16": 2, "F16": 2, "BF16": 2,
    "I32": 4, "U32": 4, "F32": 4,
    "I64": 8, "U64": 8, "F64": 8,
}  # fmt: skip


class CheckpointError(ValueError):
    """A checkpoint file is missing, damaged or foreign; the message names the file and what is wrong."""

    def __init__(self, path: str | os.PathLike, problem: str):
        self.path, self.problem = str(path), problem
        super().__init__(f"{path}: {problem}")


@dataclass(frozen=True)
class TensorEntry:
    name: str
    dtype: str
    shape: tuple[int, ...]
    begin: int  # absolute byte offsets in the file
    end: int


@dataclass(frozen=True)
class Shard:
    """One verified safetensors file: its header bytes (the prefix up to the data) and its tensors in file order."""

    path: Path
    size: int
    mtime_ns: int
    header: bytes  # the file's first data_start bytes: length prefix + JSON header
    tensors: tuple[TensorEntry, ...]

    @property
    def data_start(self) -> int:
        return len(self.header)

    @property
    def tensor_bytes(self) -> int:
        return sum(t.end - t.begin for t in self.tensors)


def read_shard(path: str | os.PathLike) -> Shard:
    """Read and check one shard's header against its file; raise CheckpointError naming the file otherwise."""
    path = Path(path)
    try:
        with open(path, "rb") as f:
            st = os.fstat(f.fileno())
            prefix = f.read(8)
            if len(prefix) < 8:
                raise CheckpointError(path, f"truncated: {st.st_size} bytes, not even the 8-byte header length")
            (n,) = struct.unpack("<Q", prefix)
            if n > MAX_HEADER_BYTES or 8 + n > st.st_size:
                raise CheckpointError(
                    path, f"corrupted header: declares {n} header bytes but the file has {st.st_size} bytes"
                )
            raw = f.read(n)
    except FileNotFoundError:
        raise CheckpointError(path, "missing: the checkpoint names this shard but the file does not exist") from None
    except IsADirectoryError:
        raise CheckpointError(path, "is a directory, not a safetensors file") from None
    try:
        doc = json.loads(raw)
        if not isinstance(doc, dict):
            raise ValueError("not a JSON object")
    except (UnicodeDecodeError, ValueError) as err:
        raise CheckpointError(path, f"corrupted header: not valid safetensors JSON ({err})") from None
    data_start = 8 + n
    tensors = sorted((_entry(path, name, meta, data_start) for name, meta in doc.items() if name != "__metadata__"),
                     key=lambda t: t.begin)  # fmt: skip
    cursor = data_start
    for t in tensors:
        if t.begin != cursor:
            raise CheckpointError(path, f"corrupted header: tensor {t.name!r} starts at {t.begin}, expected {cursor}")
        cursor = t.end
    if cursor != st.st_size:
        what = "truncated" if cursor > st.st_size else "corrupted"
        raise CheckpointError(path, f"{what}: the header's tensors end at byte {cursor}, the file has {st.st_size}")
    return Shard(path, st.st_size, st.st_mtime_ns, prefix + raw, tuple(tensors))


def _entry(path: Path, name: str, meta, data_start: int) -> TensorEntry:
    try:
        dtype, shape, (b, e) = meta["dtype"], tuple(int(d) for d in meta["shape"]), meta["data_offsets"]
        b, e = int(b), int(e)
    except (KeyError, TypeError, ValueError):
        raise CheckpointError(path, f"corrupted header: entry {name!r} lacks dtype/shape/data_offsets") from None
    if dtype not in DTYPE_BYTES:
        raise CheckpointError(path, f"corrupted header: tensor {name!r} has unknown dtype {dtype!r}")
    if any(d < 0 for d in shape) or e - b != math.prod(shape) * DTYPE_BYTES[dtype] or b < 0:
        raise CheckpointError(path, f"corrupted header: tensor {name!r} offsets [{b}, {e}] do not fit {dtype}{shape}")
    return TensorEntry(name, dtype, shape, data_start + b, data_start + e)


@dataclass(frozen=True)
class Checkpoint:
    """All shards of a model directory, verified together."""

    directory: Path
    shards: tuple[Shard, ...]

    @property
    def total_bytes(self) -> int:
        return sum(s.size for s in self.shards)


def open_checkpoint(directory: str | os.PathLike) -> Checkpoint:
    """Verify every shard, and with an index that each shard holds exactly the tensors the index maps to it.

    The index check is what catches a shard of another model put in place of one of ours: it has other tensor
    names, or the same names with other shapes (then the index's total_size, when present, disagrees).
    """
    directory = Path(directory)
    if not directory.is_dir():
        raise CheckpointError(directory, "not a directory (the kvprefetch loader reads local checkpoint directories)")
    index_path = directory / INDEX_NAME
    if not index_path.exists():
        files = sorted(directory.glob("*.safetensors"))
        if not files:
            raise CheckpointError(directory, "no *.safetensors files and no index")
        return Checkpoint(directory, tuple(read_shard(f) for f in files))
    try:
        index = json.loads(index_path.read_text())
        weight_map: dict[str, str] = index["weight_map"]
        declared_total = (index.get("metadata") or {}).get("total_size")
    except (OSError, ValueError, KeyError, TypeError) as err:
        raise CheckpointError(index_path, f"unreadable index ({err})") from None
    expected: dict[str, set[str]] = {}
    for tensor, file in weight_map.items():
        expected.setdefault(file, set()).add(tensor)
    shards = tuple(read_shard(directory / file) for file in sorted(expected))
    for shard in shards:
        have, want = {t.name for t in shard.tensors}, expected[shard.path.name]
        if have != want:
            extra, lacking = sorted(have - want), sorted(want - have)
            raise CheckpointError(
                shard.path,
                "not this model's shard (another model's?): it "
                + "; ".join(p for p in (f"holds {len(extra)} tensors the index does not map to it (e.g. {extra[:2]})"
                                        if extra else "", f"lacks {len(lacking)} tensors the index maps to it "
                                        f"(e.g. {lacking[:2]})" if lacking else "") if p),
            )  # fmt: skip
    total = sum(s.tensor_bytes for s in shards)
    if declared_total is not None and int(declared_total) != total:
        _blame_foreign_shard(directory, shards)
        sizes = ", ".join(f"{s.path.name}: {s.tensor_bytes}" for s in shards)
        raise CheckpointError(
            index_path, f"shards hold {total} tensor bytes, the index declares {declared_total} ({sizes}): "
                        "a shard of another model or a damaged index",
        )  # fmt: skip
    return Checkpoint(directory, shards)


def _blame_foreign_shard(directory: Path, shards: tuple[Shard, ...]) -> None:
    """With the right tensor names but the wrong total size, name the shard that does not fit config.json's
    hidden_size, if one does not (a shard of a same-architecture model of another width); else return."""
    try:
        hidden = int(json.loads((directory / "config.json").read_text())["hidden_size"])
    except (OSError, ValueError, KeyError, TypeError):
        return
    for shard in shards:
        matrices = [t for t in shard.tensors if len(t.shape) >= 2]
        if matrices and not any(hidden in t.shape for t in matrices):
            raise CheckpointError(
                shard.path, f"not this model's shard (another model's?): none of its {len(matrices)} matrices has "
                            f"the model's hidden_size {hidden} (config.json) as a dimension",
            )  # fmt: skip
