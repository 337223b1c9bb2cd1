"""RESP on a raw socket for the bulk path: GET replies land in the caller's view, SET values leave from it.

redis-py (with hiredis) moves a value through the process three times on a read (the kernel's bytes into hiredis'
buffer, then into a Python `bytes`, then our copy into the DRAM slot) and once more on a write (`bytes(view)`).
Here the bulk of each value goes from the socket straight into its slot with `recv_into` (one copy, the kernel's)
and out of it with `sendmsg`/`sendall`; only a reply's header line and its first few bytes pass through a small
buffer. Everything else about a connection (connecting, AUTH, SELECT, HELLO, TLS) stays redis-py's.

Only the replies GET and SET give are understood: a bulk string (`$n`), a RESP2 or RESP3 null, `+OK`, and an error
line. Anything else, or a connection that ends mid-reply, raises `ProtocolError`/`ConnectionError`: the caller must
then drop the connection, since it is no longer at a reply boundary.
"""

from __future__ import annotations

import socket
import ssl

_HEAD_BYTES = 4096  # a reply's header line and whatever came with it; the rest goes straight into the view
_MAX_LINE = 1024  # a status or error line longer than this is not a reply to GET/SET
_WAKE_BYTES = 256 << 10  # wake the reader once this much of a value is queued (SO_RCVLOWAT), not per packet


class ProtocolError(Exception):
    """The bytes on the wire are not the reply expected: the connection is out of step and must be dropped."""


class ServerError(Exception):
    """The server answered a command with an error line (the connection stays at a reply boundary)."""

    def __init__(self, line: str):
        super().__init__(line)
        self.line = line


def _bulk(arg: bytes) -> bytes:
    return b"$%d\r\n%s\r\n" % (len(arg), arg)


def get_request(names: list[bytes]) -> bytes:
    """Pipelined GETs for names (one write for the whole batch)."""
    return b"".join(b"*2\r\n$3\r\nGET\r\n" + _bulk(n) for n in names)


def set_request(name: bytes, nbytes: int, ttl_s: int | None) -> tuple[bytes, bytes]:
    """What goes before and after a SET's value of nbytes (`SET name value [EX ttl]`), so the value itself is sent
    from its own buffer."""
    argc = 3 if ttl_s is None else 5
    head = b"*%d\r\n$3\r\nSET\r\n%s$%d\r\n" % (argc, _bulk(name), nbytes)
    tail = b"\r\n" if ttl_s is None else b"\r\n" + _bulk(b"EX") + _bulk(str(int(ttl_s)).encode())
    return head, tail


def send_parts(sock: socket.socket, parts: list) -> None:
    """Send buffers in order without joining them: one `sendmsg` gathers them on a plain socket (resumed where a
    partial send stopped); a TLS socket has no `sendmsg`, so each goes through `sendall` (TLS encrypts into its own
    records anyway)."""
    if isinstance(sock, ssl.SSLSocket):
        for part in parts:
            sock.sendall(part)
        return
    views = [memoryview(p).cast("B") for p in parts if len(p)]
    while views:
        sent = sock.sendmsg(views)
        while views and sent >= len(views[0]):
            sent -= len(views[0])
            views.pop(0)
        if views and sent:
            views[0] = views[0][sent:]


class ReplyReader:
    """Reads replies from one socket: header lines through a small buffer, bulk bodies into caller views."""

    def __init__(self, sock: socket.socket):
        self.sock = sock
        self._buf = bytearray(_HEAD_BYTES)
        self._view = memoryview(self._buf)
        self._start = self._end = 0

    @property
    def buffered(self) -> int:
        """Bytes received past the replies read so far (0 at a reply boundary with nothing more sent)."""
        return self._end - self._start

    def _fill(self) -> None:
        if self._start == self._end:
            self._start = self._end = 0
        elif self._end == len(self._buf):
            n = self._end - self._start
            self._buf[:n] = self._buf[self._start : self._end]
            self._start, self._end = 0, n
        n = self.sock.recv_into(self._view[self._end :])
        if n == 0:
            raise ConnectionError("the server closed the connection mid-reply")
        self._end += n

    def _line(self) -> bytes:
        while True:
            at = self._buf.find(b"\r\n", self._start, self._end)
            if at >= 0:
                line = bytes(self._view[self._start : at])
                self._start = at + 2
                return line
            if self._end - self._start > _MAX_LINE:
                raise ProtocolError("reply line too long")
            self._fill()

    def _into(self, view: memoryview) -> None:
        """Fill view exactly: what the buffer already holds first, the rest from the socket straight into it."""
        have = min(self._end - self._start, len(view))
        view[:have] = self._view[self._start : self._start + have]
        self._start += have
        if have < len(view):
            self._recv_exact(view[have:])

    def _recv_exact(self, view: memoryview) -> None:
        """recv_into until view is full. On a plain socket the kernel is asked (SO_RCVLOWAT) to wake us only once
        a good part of what is still due has arrived: over a link that paces the bytes, each wakeup costs more than
        copying what it brought (issue 63: 0.98 -> 0.77 ms per MiB over a shaped veth link). Never over TLS: there
        OpenSSL may already hold some of the bytes, and the socket would wait for ones that never come."""
        lowat = 1
        plain = not isinstance(self.sock, ssl.SSLSocket)
        got = 0
        try:
            while got < len(view):
                want = min(len(view) - got, _WAKE_BYTES)
                if plain and want != lowat:
                    self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVLOWAT, want)
                    lowat = want
                n = self.sock.recv_into(view[got:])
                if n == 0:
                    raise ConnectionError("the server closed the connection mid-value")
                got += n
        finally:
            if lowat != 1:
                self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVLOWAT, 1)

    def _skip(self, n: int) -> None:
        """Consume n bytes nobody wants (the part of a value that does not fit its view)."""
        while n:
            if self._start == self._end:
                self._fill()
            take = min(n, self._end - self._start)
            self._start += take
            n -= take

    def _crlf(self) -> None:
        while self._end - self._start < 2:
            self._fill()
        if self._view[self._start : self._start + 2] != b"\r\n":
            raise ProtocolError("bulk value not followed by CRLF")
        self._start += 2

    def bulk_into(self, view: memoryview) -> int:
        """Read one GET reply into view; return the value's size (which may exceed the view's: the rest is
        discarded), or -1 for a missing key. Raises ServerError for an error reply."""
        line = self._line()
        kind = line[:1]
        if kind == b"$":
            size = _int(line)
            if size < 0:
                return -1
            take = min(size, len(view))
            self._into(view[:take])
            self._skip(size - take)
            self._crlf()
            return size
        if line == b"_":  # RESP3 null
            return -1
        return self._not_ours(line)

    def ok(self) -> None:
        """Read one SET reply (`+OK`). Raises ServerError for an error reply."""
        line = self._line()
        if line != b"+OK":
            self._not_ours(line)

    @staticmethod
    def _not_ours(line: bytes):
        if line[:1] == b"-":
            raise ServerError(line[1:].decode("utf-8", "replace"))
        raise ProtocolError(f"unexpected reply {line[:40]!r}")


def _int(line: bytes) -> int:
    try:
        return int(line[1:])
    except ValueError:
        raise ProtocolError(f"bad length in {line[:40]!r}") from None
