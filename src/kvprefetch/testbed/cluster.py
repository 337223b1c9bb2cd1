"""The two-node scenario's cluster on one machine (issue 41): a pool namespace holding the shared tier's server
(the whitepaper's array) and a namespace per node, each node joined to the pool by a veth link shaped to the
declared rate (`kvprefetch.bench.two_node.link_rate`). The engines run in the node namespaces (their
`EngineSpec.netns`), the bench's client outside, talking to them over pipes as on one node.

The faults the scenario injects are verbs here: every node's link to the pool down and up, the pool's server
SIGKILLed and restarted (empty, on the same port: what a node sees of a pool that lost its memory).

The pool's server is redis-server (databases; each node reaches it at the pool's end of its own link) or a Mooncake
Store (`kvprefetch.testbed.mooncake_pool`: mooncake_master and a process holding the pool's memory, bound to the
pool's service address `POOL_ADDRESS` on its loopback, which each node routes to over its own link: Mooncake
publishes one address per segment, and every node must reach it). Its fault is the master SIGKILLed and restarted.
"""

from __future__ import annotations

import os
import subprocess
from dataclasses import dataclass
from pathlib import Path

from kvprefetch.testbed.local_servers import RedisServer
from kvprefetch.testbed.mooncake_pool import MooncakePool
from kvprefetch.testbed.netns import PREFIX, SUBNET, Fabric, Link, namespaces, sweep
from kvprefetch.testbed.protocol import Placement

NODES = ("node-a", "node-b")
BACKENDS = ("redis", "mooncake")
POOL_ADDRESS = f"{SUBNET}.0.1"  # the pool namespace's own address (Mooncake's master and segment bind it)
MOONCAKE_SEGMENT_BYTES = 1 << 30  # the pool's memory when the caller names none


def node_placement(node: int, nodes: int, cores: list[int] | None = None) -> Placement:
    """Node `node`'s cores: the machine's cores split evenly between the nodes, a node's engine (model, scheduler,
    connector threads) on its share only, so one node's work never runs on another's cores. A share of one core
    (a 2-core machine) runs the model in the engine's own process (`Placement.inproc`); a larger share splits as
    the gpu-node topology does, a quarter of it for the host side."""
    cores = sorted(cores if cores is not None else os.sched_getaffinity(0))
    if len(cores) < nodes:
        raise ValueError(f"{nodes} nodes need {nodes} cores, this process has {len(cores)}")
    share = len(cores) // nodes
    mine = cores[node * share : (node + 1) * share]
    if share == 1:
        return Placement(model_cpus=mine, host_cpus=mine, inproc=True)
    host = max(1, share // 4)
    return Placement(model_cpus=mine[:-host], host_cpus=mine[-host:])


@dataclass(frozen=True)
class PoolReach:
    """How a node reaches the pool: over its own link, at the pool end's address."""

    node: int
    ns: str
    link: Link

    @property
    def pool_ip(self) -> str:
        return self.link.a.ip


class TwoNodeCluster:
    """Three namespaces (pool, node-a, node-b), a shaped link from each node to the pool, the pool's server.
    A context manager: everything is removed on exit, also when the run fails or is interrupted (the bench turns
    SIGTERM into an exception); `netns.sweep()` removes what a SIGKILLed run left."""

    def __init__(self, workdir: Path, rate_bps: int | None, backend: str = "redis", nodes: int = 2,
                 segment_bytes: int = MOONCAKE_SEGMENT_BYTES):  # fmt: skip
        """`segment_bytes`: the Mooncake pool's memory (its holder's segment); Redis takes what it needs."""
        if backend not in BACKENDS:
            raise ValueError(f"the two-node scenario's pool runs {' or '.join(BACKENDS)}, not {backend!r}")
        if nodes > len(NODES):
            raise ValueError(f"at most {len(NODES)} nodes")
        self.workdir, self.rate_bps, self.backend, self.n = workdir, rate_bps, backend, nodes
        self.segment_bytes = segment_bytes
        self.fabric = Fabric()
        self.reach: list[PoolReach] = []
        self.server: RedisServer | MooncakePool | None = None
        self.pool_ns = ""
        self.swept: list[str] = []

    def __enter__(self) -> TwoNodeCluster:
        self.fabric.__enter__()
        self.swept = sweep()  # what an earlier run killed outright left (never a live process's)
        try:
            self.pool_ns = self.fabric.ns("pool")
            for e in range(self.n):
                ns = self.fabric.ns(NODES[e])
                self.reach.append(PoolReach(e, ns, self.fabric.link(self.pool_ns, ns, self.rate_bps)))
            self.workdir.mkdir(parents=True, exist_ok=True)
            if self.backend == "redis":
                self.server = RedisServer(self.workdir, netns=self.pool_ns)
            else:
                self.fabric.address(self.pool_ns, POOL_ADDRESS)
                for r in self.reach:
                    self.fabric.route(r.ns, POOL_ADDRESS, r.pool_ip)
                self.server = MooncakePool(self.workdir, self.segment_bytes, netns=self.pool_ns, host=POOL_ADDRESS)
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def node_ns(self, node: int) -> str:
        return self.reach[node].ns

    def remote_section(self, node: int, key_prefix: str, retry_after_s: float, timeout_s: float = 2.0,
                       db: int = 0) -> dict:  # fmt: skip
        """The store's `remote` section of node `node`. Redis: database `db` of the pool's server at its end of that
        node's link. Mooncake (one namespace of keys: `db` is ignored): a client of the pool's master that
        contributes no memory, at the node's own address."""
        assert self.server is not None
        section = {"backend": self.backend, "key_prefix": key_prefix, "retry_after_s": retry_after_s,
                   "timeout_s": timeout_s}  # fmt: skip
        if isinstance(self.server, RedisServer):
            return section | {"redis": {"url": self.server.url_at(self.reach[node].pool_ip, db)}}
        m = self.server.master
        return section | {"mooncake": {"master": m.master, "metadata_server": m.metadata_server,
                                       "local_hostname": self.reach[node].link.b.ip, "segment_bytes": 0,
                                       "buffer_bytes": 16 << 20, "connect_timeout_s": 30.0}}  # fmt: skip

    def pool_procs(self) -> list:
        """The pool's server processes that run now."""
        if isinstance(self.server, MooncakePool):
            return self.server.procs
        proc = self.server.proc if self.server is not None else None
        return [proc] if proc is not None and proc.poll() is None else []

    def pool_down(self) -> bool:
        """Whether the pool's server is killed (`kill_pool`) and not restarted yet."""
        return self.server is not None and self.server.proc is None

    def empty_pool(self, db: int = 0) -> None:
        """Every value in the pool removed (Redis: database `db`'s), from inside the pool's namespace."""
        assert self.server is not None
        if isinstance(self.server, MooncakePool):
            self.server.clear()
            return
        argv = ["redis-cli", "-p", str(self.server.port), "-n", str(db), "FLUSHDB"]
        subprocess.run(self.fabric.exec_argv(self.pool_ns, argv), check=True, capture_output=True, timeout=60)

    def pool_cpu_s(self) -> float | None:
        """CPU seconds the pool's server has used (user + system; Mooncake's master and holder together), None when
        it is not running: on this machine it shares the nodes' cores, which a real array does not."""
        import psutil

        procs = self.pool_procs()
        if not procs or self.pool_down():
            return None
        try:
            return sum(sum(psutil.Process(p.pid).cpu_times()[:2]) for p in procs)
        except psutil.Error:
            return None

    # -- faults ------------------------------------------------------------------------------------------------
    def set_links(self, up: bool) -> None:
        """Every node's link to the pool down (nothing crosses it) or back up."""
        for r in self.reach:
            self.fabric.set_up(r.link, up)

    def kill_pool(self) -> None:
        """The pool's server SIGKILLed: what it held is gone."""
        assert self.server is not None
        self.server.kill()

    def restart_pool(self) -> None:
        """The pool's server started again, empty, on the same port."""
        assert self.server is not None
        self.server.start()

    # -- the end -----------------------------------------------------------------------------------------------
    def close(self) -> None:
        if isinstance(self.server, MooncakePool):
            self.server.close()
        elif self.server is not None:
            self.server.kill()
        self.fabric.close()

    def leftovers(self) -> list[str]:
        """What this cluster made that is still there (its namespaces, their interfaces, its server): empty once
        it closed."""
        tag = f"{PREFIX}{self.fabric.tag}-"
        left = [f"namespace {ns}" for ns in namespaces() if ns.startswith(tag)]
        devs = subprocess.run(["ip", "-o", "link", "show"], capture_output=True, text=True).stdout
        left += [f"interface {line.split(':')[1].strip()}" for line in devs.splitlines()
                 if f"k{self.fabric.tag}x" in line]  # fmt: skip
        left += [f"{self.backend} pool process pid {p.pid}" for p in self.pool_procs()]
        return left
