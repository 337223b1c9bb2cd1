"""Nodes on one machine: Linux network namespaces joined by point-to-point veth links, each end's egress shaped to a
declared rate (tbf), for benchmarks that need a pool and the nodes that read it over a real, finite link.

Everything a `Fabric` makes is named after the process that made it (`kvp<pid hex>-<role>` namespaces, `k<pid
hex>x<n>` interfaces), removed when the fabric closes (deleting a namespace deletes its interfaces and their
qdiscs), and `sweep()` removes what a process that died without closing left behind (SIGKILL): never anything
another live process made. Needs root (CAP_NET_ADMIN) and iproute2; `available()` says whether this machine can.
There is no added delay (netem is not available here): a link has a rate, not a distance.
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import subprocess
from dataclasses import dataclass, field

from kvprefetch.tiers.pool_watch import pid_alive

PREFIX = "kvp"
_NS = re.compile(rf"^{PREFIX}([0-9a-f]+)-[a-z0-9-]+$")
CLONE_NEWNET = 0x40000000
SUBNET = "10.231"  # links are 10.231.<n>.1 <-> 10.231.<n>.2 (/30), inside the namespaces only; 10.231.0.x: `address`


class NetnsUnavailable(RuntimeError):
    """This machine (or user) cannot make network namespaces: not root, or no iproute2."""


def available() -> str | None:
    """None when namespaces can be made here, else why not."""
    if os.geteuid() != 0:
        return "network namespaces need root (CAP_NET_ADMIN)"
    if shutil.which("ip") is None or shutil.which("tc") is None:
        return "network namespaces need iproute2 (the ip and tc commands)"
    return None


def _run(*argv: str) -> str:
    out = subprocess.run(argv, capture_output=True, text=True)
    if out.returncode:
        raise RuntimeError(f"{' '.join(argv)}: {out.stderr.strip() or out.stdout.strip()}")
    return out.stdout


def namespaces() -> list[str]:
    """Every network namespace on the machine (`ip netns list`, names only)."""
    return [line.split()[0] for line in _run("ip", "netns", "list").splitlines() if line.strip()]


HOST = ""  # an `End.ns` on the machine's own network namespace (where the bench's client and a router run)


def _in(ns: str, *argv: str) -> list[str]:
    """argv run in namespace ns, or on the machine's own (`HOST`)."""
    return list(argv) if ns == HOST else ["ip", "netns", "exec", ns, *argv]


@dataclass(frozen=True)
class End:
    ns: str
    dev: str
    ip: str


@dataclass(frozen=True)
class Link:
    """A veth pair between two namespaces; `rate_bps` (bits/s) shapes each end's egress, None: unshaped."""

    a: End
    b: End
    rate_bps: int | None


def burst_bytes(rate_bps: int) -> int:
    """tbf's bucket: at least what the rate moves in one 4 ms tick (HZ 250) and a few full-size frames."""
    return max(rate_bps // 8 // 250, 64 * 1024)


@dataclass
class Fabric:
    """Namespaces and links made on this process's behalf; a context manager that removes them all on exit."""

    tag: str = field(default_factory=lambda: f"{os.getpid():x}")
    made: list[str] = field(default_factory=list)
    links: list[Link] = field(default_factory=list)
    routes: list[tuple[str, str, str]] = field(default_factory=list)  # (ns, destination, gateway)

    def __enter__(self) -> Fabric:
        why = available()
        if why is not None:
            raise NetnsUnavailable(why)
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def ns(self, role: str) -> str:
        """Make namespace `role` (loopback up); its full name."""
        if not re.fullmatch(r"[a-z0-9-]{1,20}", role):
            raise ValueError(f"namespace role {role!r}: lowercase letters, digits and '-' only")
        name = f"{PREFIX}{self.tag}-{role}"
        _run("ip", "netns", "add", name)
        self.made.append(name)
        _run("ip", "-n", name, "link", "set", "lo", "up")
        return name

    def link(self, a_ns: str, b_ns: str, rate_bps: int | None = None) -> Link:
        """Join two of this fabric's namespaces by a veth pair, a /30 of their own, each end shaped to rate_bps."""
        n = len(self.links) + 1
        if n > 250:
            raise ValueError("a fabric has at most 250 links")
        a = End(a_ns, f"k{self.tag}x{n}a", f"{SUBNET}.{n}.1")
        b = End(b_ns, f"k{self.tag}x{n}b", f"{SUBNET}.{n}.2")
        a_where = [] if a.ns == HOST else ["netns", a.ns]
        _run("ip", "link", "add", a.dev, *a_where, "type", "veth", "peer", "name", b.dev, "netns", b.ns)
        link = Link(a, b, rate_bps)
        self.links.append(link)
        for end in (a, b):
            _run(*_in(end.ns, "ip", "addr", "add", f"{end.ip}/30", "dev", end.dev))
            _run(*_in(end.ns, "ip", "link", "set", end.dev, "up"))
        if rate_bps is not None:
            self.shape(link, rate_bps)
        return link

    def link_host(self, ns: str, rate_bps: int | None = None) -> Link:
        """Join one of this fabric's namespaces to the machine's own (`HOST`, end a): a node's front-end port, which
        a client or a router on the machine reaches at `link.b.ip`. Deleting the namespace deletes both ends."""
        return self.link(HOST, ns, rate_bps)

    def shape(self, link: Link, rate_bps: int) -> None:
        """(Re)shape both ends' egress to rate_bps."""
        for end in (link.a, link.b):
            _run(*_in(end.ns, "tc", "qdisc", "replace", "dev", end.dev, "root", "tbf", "rate", f"{rate_bps}bit",
                      "burst", str(burst_bytes(rate_bps)), "latency", "200ms"))  # fmt: skip

    def set_up(self, link: Link, up: bool) -> None:
        """Take a link down (both ends: nothing crosses it) or bring it back up, with the routes through it (the
        kernel drops a route whose gateway's link goes down, and does not bring it back)."""
        for end in (link.a, link.b):
            _run(*_in(end.ns, "ip", "link", "set", end.dev, "up" if up else "down"))
        if up:
            for ns, dst, via in self.routes:
                if (ns, via) in ((link.a.ns, link.b.ip), (link.b.ns, link.a.ip)):
                    _run(*_in(ns, "ip", "route", "replace", f"{dst}/32", "via", via))

    def address(self, ns: str, ip: str) -> None:
        """Give namespace ns an address of its own on its loopback (a service address that other namespaces reach
        through `route`, whichever link they come over)."""
        _run(*_in(ns, "ip", "addr", "add", f"{ip}/32", "dev", "lo"))

    def route(self, ns: str, dst: str, via: str) -> None:
        """Namespace ns reaches address dst through gateway `via` (the far end of one of its links); kept across
        the link going down and up (`set_up`)."""
        _run(*_in(ns, "ip", "route", "replace", f"{dst}/32", "via", via))
        self.routes.append((ns, dst, via))

    @staticmethod
    def exec_argv(ns: str, argv: list[str]) -> list[str]:
        """argv run inside namespace ns (`ip netns exec`: its own /etc/netns view, the machine's filesystem)."""
        return ["ip", "netns", "exec", ns, *argv]

    def close(self) -> None:
        """Remove every namespace this fabric made (their links and qdiscs go with them) and its links' ends on the
        machine (the kernel frees a deleted namespace's devices later, in the background); idempotent."""
        for link in self.links:
            if link.a.ns == HOST:
                with contextlib.suppress(RuntimeError):
                    _run("ip", "link", "del", link.a.dev)
        for name in reversed(self.made):
            _kill_inside(name)
            with contextlib.suppress(RuntimeError):
                _run("ip", "netns", "del", name)
        self.made.clear()
        self.links.clear()
        self.routes.clear()


def join(ns: str) -> None:
    """Move this process into network namespace ns (as `ip netns exec` would, without exec): its sockets from
    now on, and the processes it starts, are on that namespace's links. Called first thing by a process that must
    run there but is started by other means (a forked engine)."""
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)
    fd = os.open(f"/run/netns/{ns}", os.O_RDONLY | os.O_CLOEXEC)
    try:
        if libc.setns(fd, CLONE_NEWNET) != 0:
            err = ctypes.get_errno()
            raise OSError(err, f"setns into network namespace {ns}: {os.strerror(err)}")
    finally:
        os.close(fd)


def _kill_inside(ns: str) -> None:
    """SIGKILL what still runs in namespace ns (a namespace whose processes live on is not freed by `del`)."""
    with contextlib.suppress(RuntimeError):
        for pid in _run("ip", "netns", "pids", ns).split():
            with contextlib.suppress(ProcessLookupError, ValueError):
                os.kill(int(pid), 9)


_HOST_END = re.compile(r"^\d+: (k([0-9a-f]+)x\d+a)[@:]")


def sweep() -> list[str]:
    """Remove the namespaces of fabrics whose process is gone, and their links' ends on the machine; the names
    removed."""
    gone = []
    for line in _run("ip", "-o", "link", "show").splitlines():
        m = _HOST_END.match(line)
        if m is not None and not pid_alive(int(m.group(2), 16)):
            with contextlib.suppress(RuntimeError):
                _run("ip", "link", "del", m.group(1))
                gone.append(m.group(1))
    for name in namespaces():
        m = _NS.match(name)
        if m is None or pid_alive(int(m.group(1), 16)):
            continue
        _kill_inside(name)
        with contextlib.suppress(RuntimeError):
            _run("ip", "netns", "del", name)
            gone.append(name)
    return gone
