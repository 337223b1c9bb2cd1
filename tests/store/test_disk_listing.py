"""The disk tier lists and copies its own chunks: nobody else needs to know its file layout."""

from __future__ import annotations

import os

from kvprefetch.tiers.chunk_format import HEADER_BYTES, image_bytes, write_header
from kvprefetch.tiers.disk import DiskTier, aligned_buffer, chunk_files, chunk_keys, link_tree

from .conftest import CHUNK_BYTES, chunk_payload


def _write(disk: DiskTier, key: bytes) -> None:
    image = aligned_buffer(image_bytes(CHUNK_BYTES))
    image[HEADER_BYTES : HEADER_BYTES + CHUNK_BYTES] = chunk_payload(key).tobytes()
    write_header(image, key, CHUNK_BYTES)
    disk.write(key, image)


def test_the_tier_lists_its_keys_and_a_clone_reads_the_same_chunks(tmp_path):
    disk = DiskTier(tmp_path / "a", 1 << 30, direct_io=False, fsync=False)
    keys = [os.urandom(32) for _ in range(5)]
    for key in keys:
        _write(disk, key)
    (tmp_path / "a" / keys[0].hex()[:2] / "notes.txt").write_text("not a chunk")  # a stranger's file
    assert sorted(disk.keys()) == sorted(keys)
    assert chunk_keys(tmp_path / "a") == sorted(keys)  # read from the directory alone, in key order
    assert [f.name for _, f in chunk_files(tmp_path / "a")] == [f"{k.hex()}.kv" for k in sorted(keys)]
    assert chunk_keys(tmp_path / "missing") == []

    assert link_tree(tmp_path / "a", tmp_path / "b") == 5
    clone = DiskTier(tmp_path / "b", 1 << 30, direct_io=False, fsync=False)
    assert sorted(clone.keys()) == sorted(keys)
    out = aligned_buffer(image_bytes(CHUNK_BYTES))
    clone.read_into(keys[1], out)
    assert bytes(out[HEADER_BYTES : HEADER_BYTES + CHUNK_BYTES]) == chunk_payload(keys[1]).tobytes()
    clone.delete(keys[1])  # the clone diverges; the original keeps its chunk
    assert keys[1] in chunk_keys(tmp_path / "a") and keys[1] not in chunk_keys(tmp_path / "b")
