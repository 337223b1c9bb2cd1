"""Argument parsers the command lines share (the top-level CLI and each subcommand's module)."""

from __future__ import annotations

import typer
from pydantic import ByteSize, TypeAdapter, ValidationError


def parse_size(text: str) -> int:
    """'1GiB', '512MiB', '4194304' -> bytes; a clear error otherwise."""
    try:
        size = int(TypeAdapter(ByteSize).validate_python(text))
    except ValidationError:
        raise typer.BadParameter(f"not a size: {text!r} (use e.g. 4MiB, 1GiB or a number of bytes)") from None
    if size <= 0:
        raise typer.BadParameter(f"size must be positive, got {text!r}")
    return size
