"""What a remote backend must do: batched existence checks, reads into and writes from caller memory."""

from __future__ import annotations

from abc import ABC, abstractmethod


class RemoteUnavailable(ConnectionError):
    """The remote store cannot be reached (down, timing out, or still connecting)."""


class RemoteRejected(Exception):
    """The remote store is up but refused a write (full, or the object is busy): not a reason to stop using it."""


class RemoteBackend(ABC):
    """A key-value store holding whole chunk images under string names. Values are opaque bytes: nothing
    read from a shared tier is ever deserialised beyond our fixed binary header, which is verified."""

    name: str = "remote"
    batch_size: int = 16  # chunks per round trip (see `kvprefetch remotebench` for the measured choice)

    @abstractmethod
    def exists(self, names: list[str]) -> list[bool]:
        """One round trip for many names."""

    @abstractmethod
    def read_into(self, names: list[str], views: list[memoryview]) -> list[int]:
        """Read each value into its view; return bytes read, or -1 where the name is missing."""

    @abstractmethod
    def write_from(self, names: list[str], views: list[memoryview]) -> None:
        """Store each view's bytes under its name, replacing what was there."""

    @abstractmethod
    def delete(self, names: list[str]) -> None:
        """Remove names (used to drop a value found damaged)."""

    def register_memory(self, view: memoryview) -> None:  # noqa: B027 - optional hook
        """Let the backend transfer straight into/out of this region (e.g. RDMA/TCP registration)."""

    def close(self) -> None:  # noqa: B027 - optional hook
        """Release connections."""
