"""The self-describing chunk image, identical in a DRAM slot and in a disk file.

    [4 KiB header: magic, version, key, payload size, payload checksum, header checksum][payload][pad to 4 KiB]

One format for both tiers means promotion and write-back are a single aligned read or write with no
re-encoding, and every reader can prove that what it got is the whole chunk it asked for.
"""

from __future__ import annotations

import struct
import time
from dataclasses import dataclass

import xxhash

HEADER_BYTES = 4096
ALIGN = 4096
MAGIC = b"KVPFCHK1"
VERSION = 1
_FIELDS = struct.Struct("<8sII32sQQQ")  # magic, version, header_bytes, key, payload_nbytes, checksum, created_ns
_CHECK = struct.Struct("<Q")


class CorruptChunk(Exception):
    """A chunk image failed validation (torn, truncated, flipped, foreign, or another key's)."""


@dataclass(frozen=True)
class ChunkHeader:
    key: bytes
    payload_nbytes: int
    checksum: int
    created_ns: int


def align_up(n: int, align: int = ALIGN) -> int:
    return (n + align - 1) // align * align


def image_bytes(payload_nbytes: int) -> int:
    """Bytes of a whole chunk image (header + payload padded to the O_DIRECT alignment)."""
    return HEADER_BYTES + align_up(payload_nbytes)


def payload_checksum(payload) -> int:
    return xxhash.xxh3_64_intdigest(payload)


def write_header(image: memoryview, key: bytes, payload_nbytes: int) -> None:
    """Fill the header of an image whose payload is already in place."""
    checksum = payload_checksum(image[HEADER_BYTES : HEADER_BYTES + payload_nbytes])
    fields = _FIELDS.pack(MAGIC, VERSION, HEADER_BYTES, key, payload_nbytes, checksum, time.time_ns())
    image[: len(fields)] = fields
    _CHECK.pack_into(image, len(fields), xxhash.xxh3_64_intdigest(fields))


def read_header(image: memoryview) -> ChunkHeader:
    """Parse and check a header; raise CorruptChunk if it is not one of ours or is damaged."""
    if len(image) < HEADER_BYTES:
        raise CorruptChunk(f"image of {len(image)} bytes is shorter than a header")
    fields = bytes(image[: _FIELDS.size])
    magic, version, header_bytes, key, nbytes, checksum, created = _FIELDS.unpack(fields)
    if magic != MAGIC:
        raise CorruptChunk("bad magic: not a kvprefetch chunk")
    (stored,) = _CHECK.unpack_from(image, _FIELDS.size)
    if stored != xxhash.xxh3_64_intdigest(fields):
        raise CorruptChunk("header checksum mismatch")
    if version != VERSION or header_bytes != HEADER_BYTES:
        raise CorruptChunk(f"unsupported chunk format version {version}")
    return ChunkHeader(key=key, payload_nbytes=nbytes, checksum=checksum, created_ns=created)


def verify_image(image: memoryview, expected_key: bytes, verify_payload: bool = True) -> ChunkHeader:
    """Check that image holds exactly the chunk for expected_key, whole and undamaged."""
    header = read_header(image)
    if header.key != expected_key:
        raise CorruptChunk("image holds another key")
    if len(image) < image_bytes(header.payload_nbytes):
        raise CorruptChunk(f"truncated: {len(image)} bytes, need {image_bytes(header.payload_nbytes)}")
    if verify_payload:
        payload = image[HEADER_BYTES : HEADER_BYTES + header.payload_nbytes]
        if payload_checksum(payload) != header.checksum:
            raise CorruptChunk("payload checksum mismatch")
    return header
