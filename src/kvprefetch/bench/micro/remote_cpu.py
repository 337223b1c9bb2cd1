"""CPU a node spends per MiB it receives from and sends to the shared pool, next to the limits it is judged by.

A node that reads KV from the pool pays for it on the same cores that run the model (issue 63: 1.15-1.19 ms per
MiB with redis-py), so the figure here is process CPU time over bytes, which a shared machine disturbs far less
than wall clock. Every path moves the same values, one per round trip, between preallocated "slots" (one per
value, as the DRAM pool's, so none is cache-hot) and a server in another process on loopback (loopback charges the
kernel's transmit and delivery to the sender, so only the receiver's own work is counted on either side):

- `memcpy`: one copy of each value between two buffers (what a single pass over the bytes costs here);
- `xxh3`: the payload checksum the remote tier computes over each value it reads (`chunk_format`);
- `socket floor`: a plain `recv_into` / `sendall` loop against a peer process that sends / swallows N bytes per
  request: the least a node can pay to move bytes through the kernel's TCP; the backends are judged against it;
- `framed floor`: the same loop, the peer framing each value as a RESP bulk reply (`$n\r\n` value `\r\n`), the
  client reading the 4 + digits bytes before the value apart. Any Redis client receives that framing, and it costs:
  the header shifts the value against the page the kernel copies it from, so its copy into a page-aligned slot is
  a misaligned one (on this machine's AMD EPYC, `rep movsb` then runs ~2.5x slower at 1 MiB);
- `redis`: kvprefetch's Redis backend (`read_into` / `write_from` on the slots), one value per call as the store
  asks for them (`batch_size` 1), and `redis x8`: eight per call, pipelined on one connection;
- `redis-py`: redis-py's own GET/SET and a copy into the slot, i.e. the backend before issue 63 (for comparison);
- `redis TLS`, `redis-py TLS`: both over TLS to the same server (when openssl is installed to make a certificate):
  TLS receives each record into OpenSSL's buffer and decrypts it there, then copies it out, so over TLS the
  backend's path still saves redis-py's copies but not that one;
- `mooncake`: kvprefetch's Mooncake backend, its values held by a client in another process.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import socket
import statistics
import subprocess
import sys
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

from kvprefetch.tiers.chunk_format import payload_checksum
from kvprefetch.tiers.memory import copy_bytes

MiB = 1 << 20
RECV, SEND = "recv", "send"
FLOOR, FRAMED = "socket floor", "framed floor"
LOCAL = ("memcpy", "xxh3")  # no socket: no ratio to a floor

# The floors' peer: one connection; b"S"+n asks it to send n bytes, b"F"+n the same bytes framed as a RESP bulk reply
# (`$n\r\n` before, `\r\n` after), b"R"+n to swallow n bytes and answer b"k".
_PEER = r"""
import socket, sys
srv = socket.create_server((sys.argv[2], 0))
print(srv.getsockname()[1], flush=True)
conn, _ = srv.accept()
conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
view = memoryview(bytearray(int(sys.argv[1])))
def fill(buf):
    got = 0
    while got < len(buf):
        n = conn.recv_into(buf[got:])
        if n == 0:
            sys.exit(0)
        got += n
head = memoryview(bytearray(9))
while True:
    fill(head)
    n = int.from_bytes(head[1:], "little")
    if head[0] == ord("S"):
        conn.sendall(view[:n])
    elif head[0] == ord("F"):
        conn.sendall(b"$%d\r\n" % n + bytes(view[:n]) + b"\r\n")
    else:
        fill(view[:n])
        conn.sendall(b"k")
"""


@dataclass
class CpuRow:
    """One path moving values of one size in one direction: medians over the rounds."""

    path: str
    direction: str
    value_bytes: int
    bytes_per_round: int
    cpu_ms_per_mib: float
    gbps: float
    over_floor: float | None = None  # cpu_ms_per_mib / the socket floor's, same size and direction
    over_framed: float | None = None  # ... / the framed floor's (receives only)

    def to_json(self) -> dict:
        return asdict(self)


class FloorPeer:
    """The floors: the peer process above, and the client's plain recv_into / sendall loops."""

    def __init__(self, max_bytes: int, wrap: list[str] | None = None, bind: str = "127.0.0.1", host: str = "127.0.0.1"):
        """`wrap` runs the peer's process elsewhere (e.g. `ip netns exec POOL`), listening on `bind`; this process
        reaches it at `host`."""
        argv = [*(wrap or []), sys.executable, "-c", _PEER, str(max_bytes), bind]
        self.proc = subprocess.Popen(argv, stdout=subprocess.PIPE, text=True)
        port = int(self.proc.stdout.readline())
        self.sock = socket.create_connection((host, port))
        self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self._frame = memoryview(bytearray(32))

    def _exact(self, view: memoryview) -> None:
        got = 0
        while got < len(view):
            n = self.sock.recv_into(view[got:])
            if n == 0:
                raise ConnectionError("floor peer closed")
            got += n

    def recv_value(self, view: memoryview) -> None:
        self.sock.sendall(b"S" + len(view).to_bytes(8, "little"))
        self._exact(view)

    def recv_framed(self, view: memoryview) -> None:
        """Receive a value framed as a RESP bulk reply; the frame's bytes go apart (the client knows their size)."""
        self.sock.sendall(b"F" + len(view).to_bytes(8, "little"))
        self._exact(self._frame[: len(b"$%d\r\n" % len(view))])
        self._exact(view)
        self._exact(self._frame[:2])

    def send_value(self, view: memoryview) -> None:
        self.sock.sendall(b"R" + len(view).to_bytes(8, "little"))
        self.sock.sendall(view)
        if self.sock.recv(1) != b"k":
            raise ConnectionError("floor peer closed")

    def close(self) -> None:
        self.sock.close()
        self.proc.wait(10)


def _slots(count: int, size: int) -> tuple[memoryview, list[memoryview]]:
    """One region of `count` distinct slot views of `size` bytes, faulted in (a DRAM pool's slots are)."""
    region = np.empty(count * size, np.uint8)
    region.fill(1)
    flat = memoryview(region).cast("B")
    return flat, [flat[i * size : (i + 1) * size] for i in range(count)]


Move = Callable[[list[memoryview]], None]  # moves every slot once, one way
Path_ = dict[str, Move]  # direction -> its move


def _measure(move: Move, slots: list[memoryview]) -> tuple[float, float]:
    """(process CPU ms per MiB, wall GB/s) of one move over every slot."""
    nbytes = sum(len(s) for s in slots)
    c0, w0 = time.process_time(), time.perf_counter()
    move(slots)
    cpu, wall = time.process_time() - c0, time.perf_counter() - w0
    return cpu * 1e3 / (nbytes / MiB), nbytes / wall / 1e9


def _local_paths(sources: list[memoryview]) -> dict[str, Path_]:
    """memcpy and the checksum: a pass over each slot on this core, no socket."""

    def memcpy(slots: list[memoryview]) -> None:
        for dst, src in zip(slots, sources, strict=True):
            copy_bytes(dst, src)

    def checksum(slots: list[memoryview]) -> None:
        for slot in slots:
            payload_checksum(slot)

    return {"memcpy": {RECV: memcpy}, "xxh3": {RECV: checksum}}


def _floor_paths(peer: FloorPeer) -> dict[str, Path_]:
    def each(fn) -> Move:
        def move(slots: list[memoryview]) -> None:
            for slot in slots:
                fn(slot)

        return move

    return {FLOOR: {RECV: each(peer.recv_value), SEND: each(peer.send_value)}, FRAMED: {RECV: each(peer.recv_framed)}}


def _backend_path(backend, names: list[str], per_call: int = 1) -> Path_:
    """A RemoteBackend moving `per_call` values per call (the store's I/O threads ask for `batch_size`)."""

    def recv(slots: list[memoryview]) -> None:
        for i in range(0, len(slots), per_call):
            views = slots[i : i + per_call]
            if backend.read_into(names[i : i + per_call], views) != [len(v) for v in views]:
                raise RuntimeError(f"{backend.name}: {names[i]}... did not read back whole")

    def send(slots: list[memoryview]) -> None:
        for i in range(0, len(slots), per_call):
            backend.write_from(names[i : i + per_call], slots[i : i + per_call])

    return {RECV: recv, SEND: send}


def _redis_py_path(client, names: list[str]) -> Path_:
    """redis-py's GET (hiredis) then a copy into the slot, and SET of the slot's bytes: the backend before issue 63."""

    def recv(slots: list[memoryview]) -> None:
        for name, slot in zip(names, slots, strict=True):
            pipe = client.pipeline(transaction=False)
            pipe.get(name)
            (value,) = pipe.execute()
            copy_bytes(slot, memoryview(value)[: len(slot)])

    def send(slots: list[memoryview]) -> None:
        for name, slot in zip(names, slots, strict=True):
            pipe = client.pipeline(transaction=False)
            pipe.set(name, bytes(slot))
            pipe.execute()

    return {RECV: recv, SEND: send}


@contextlib.contextmanager
def _servers(backends: list[str], workdir: Path, max_bytes: int) -> Iterator[dict]:
    """Start the floors' peer and each backend's server and client; yield them by path name."""
    with contextlib.ExitStack() as stack:
        found: dict = {"peer": FloorPeer(max_bytes)}
        stack.callback(found["peer"].close)
        if "redis" in backends:
            found |= _redis_clients(stack, workdir)
        if "mooncake" in backends:
            found["mooncake"] = stack.enter_context(_mooncake_holder(workdir, max_bytes))
        yield found


def _redis_clients(stack: contextlib.ExitStack, workdir: Path) -> dict:
    """One redis-server (also on a TLS port when openssl can make it a certificate); the backend and redis-py on
    each of its ports, by path name."""
    import redis

    from kvprefetch.testbed.local_servers import RedisServer, free_port, tls_args, tls_files, wait_port
    from kvprefetch.tiers.remote.redis_backend import RedisBackend

    tls = None
    if shutil.which("openssl"):
        tls = (free_port(), *tls_files(workdir))
    server = RedisServer(workdir, *(tls_args(*tls) if tls else ()))
    stack.callback(server.kill)
    urls = {"": (server.url, None)}
    if tls:
        wait_port(tls[0])
        urls[" TLS"] = (f"rediss://127.0.0.1:{tls[0]}/0", str(tls[1]))
    found: dict = {}
    for suffix, (url, ca) in urls.items():
        found["redis" + suffix] = RedisBackend(url, False, 30.0, None, None, None, ca)
        found["redis-py" + suffix] = redis.Redis.from_url(url, **({"ssl_ca_certs": ca} if ca else {}))
    for client in found.values():
        stack.callback(client.close)
    return found


def _paths(servers: dict, sources: list[memoryview], names: list[str]) -> dict[str, Path_]:
    paths = _local_paths(sources) | _floor_paths(servers["peer"])
    for name in ("redis", "redis TLS", "mooncake"):
        if name in servers:
            paths[name] = _backend_path(servers[name], names)
    if "redis" in servers:
        paths["redis x8"] = _backend_path(servers["redis"], names, per_call=8)
    for name in ("redis-py", "redis-py TLS"):
        if name in servers:
            paths[name] = _redis_py_path(servers[name], names)
    return paths


def run_cpu(backends: list[str], sizes: list[int], bytes_per_round: int, repeats: int,
            progress: Callable[[str], None] = lambda s: None) -> list[CpuRow]:  # fmt: skip
    """Every path at every size, the paths interleaved within each round; sends first (they store the values the
    receives then read). Returns medians, each path's ratio to the floors beside it."""
    import tempfile

    with tempfile.TemporaryDirectory(prefix="kvprefetch-remotecpu-") as tmp, \
            _servers(backends, Path(tmp), max(sizes)) as servers:  # fmt: skip
        return measure(servers, sizes, bytes_per_round, repeats, progress)


def measure(servers: dict, sizes: list[int], bytes_per_round: int, repeats: int,
            progress: Callable[[str], None] = lambda s: None) -> list[CpuRow]:  # fmt: skip
    """run_cpu on servers already running, by path name: "peer" (a FloorPeer), "redis" / "redis TLS" /
    "mooncake" (backends), "redis-py" / "redis-py TLS" (redis-py clients); each one present is measured."""
    rows: list[CpuRow] = []
    for size in sizes:
        count = max(1, bytes_per_round // size)
        (region, slots), (_, sources) = _slots(count, size), _slots(count, size)
        names = [f"cpu{uuid.uuid4().hex[:8]}:{i}" for i in range(count)]
        if "mooncake" in servers:
            servers["mooncake"].register_memory(region)
        paths = _paths(servers, sources, names)
        samples: dict[tuple[str, str], list[tuple[float, float]]] = {}
        for r in range(repeats):
            progress(f"CPU per MiB: {size / MiB:g} MiB values, round {r + 1}/{repeats}")
            for direction in (SEND, RECV):
                for path, moves in paths.items():
                    if direction in moves:
                        samples.setdefault((path, direction), []).append(_measure(moves[direction], slots))
        rows += _rows(samples, size, count * size)
        _forget(servers, names)
    return rows


def _rows(samples: dict, size: int, nbytes: int) -> list[CpuRow]:
    rows = [CpuRow(path, direction, size, nbytes, statistics.median(s[0] for s in got),
                   statistics.median(s[1] for s in got)) for (path, direction), got in samples.items()]  # fmt: skip
    floors = {(r.path, r.direction): r.cpu_ms_per_mib for r in rows if r.path in (FLOOR, FRAMED)}
    for row in rows:
        if row.path not in LOCAL:
            row.over_floor = _ratio(row.cpu_ms_per_mib, floors.get((FLOOR, row.direction)))
            row.over_framed = _ratio(row.cpu_ms_per_mib, floors.get((FRAMED, row.direction)))
    return rows


def _ratio(value: float, floor: float | None) -> float | None:
    return value / floor if floor else None


def _forget(servers: dict, names: list[str]) -> None:
    """Drop a size's values so the next size's do not pile up in the servers."""
    if "redis-py" in servers:
        servers["redis-py"].delete(*names)
    if "mooncake" in servers:
        servers["mooncake"].delete(names)


_HOLDER = r"""
import sys
from mooncake.store import MooncakeDistributedStore
store = MooncakeDistributedStore()
rc = store.setup("127.0.0.1", sys.argv[1], int(sys.argv[2]), 16 << 20, "tcp", "", sys.argv[3])
print(rc, flush=True)
sys.stdin.read()
store.close()
"""


@contextlib.contextmanager
def _mooncake_holder(workdir: Path, max_bytes: int) -> Iterator:
    """A Mooncake master and a client process that holds the values (its segment), so the measured client
    (no segment of its own) receives and sends every byte over TCP, as a node reading a pool elsewhere."""
    from kvprefetch.testbed.local_servers import MooncakeMaster
    from kvprefetch.tiers.remote.mooncake_backend import MooncakeBackend

    master = MooncakeMaster(workdir)
    segment = 2 * max(max_bytes, 256 * MiB)
    holder = subprocess.Popen([sys.executable, "-c", _HOLDER, master.metadata_server, str(segment), master.master],
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                              env=os.environ | {"MC_TCP_BIND_ADDRESS": "127.0.0.1"})  # fmt: skip
    try:
        if holder.stdout.readline().strip() != "0":
            raise RuntimeError("the Mooncake holder process failed to set up")
        backend = MooncakeBackend(master.master, master.metadata_server, "127.0.0.1", "tcp", 0, 16 << 20, 60.0)
        try:
            yield backend
        finally:
            backend.close()
    finally:
        holder.stdin.close()
        holder.wait(30)
        master.kill()
