"""`kvprefetch serve` nodes as a router sees them (issue 61): each node's OpenAI server in the node's network
namespace, reached at its front address (`netns.Fabric.link_host`), publishing its KV events there, and the verbs
a run needs of a node from outside: empty its caches, SIGKILL it, start it again as it was.

A node's server runs as an operator runs it: `kvprefetch serve MODEL` (or `--no-connector`: vLLM alone) with vLLM's
arguments, on the node's cores (`taskset`, vLLM's OpenMP threads bound to them), in a process group of its own (a
SIGKILL takes the API server and its engine core together, as a node that dies does). Two additions for the run:

- ``VLLM_SERVER_DEV_MODE=1``: vLLM's ``POST /reset_prefix_cache?reset_external=true``, which empties the engine's
  prefix cache and, through the connector's ``reset_cache``, the node's DRAM pool and disk tier (`reset`);
- `node_header.NodeHeader`: every response says which node served it (``x-kvprefetch-node``), through the router.
"""

from __future__ import annotations

import contextlib
import os
import signal
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

from kvprefetch.testbed.client import shm_mapped_by_group, unlink_all
from kvprefetch.testbed.node_header import ENV as NODE_ENV
from kvprefetch.testbed.router import KvEventsPorts
from kvprefetch.testbed.server import OpenAIServer, parse_metrics

NODE_MIDDLEWARE = ("--middleware", "kvprefetch.testbed.node_header.NodeHeader")
GROUP_EXIT_S = 15.0
"""How long a stopped server's other processes get to exit on their own before they are SIGKILLed: one killed
mid-exit leaves vLLM's shared-memory segments (``/dev/shm/psm_*``) behind."""


@dataclass(frozen=True)
class NodeServerSpec:
    """One node's server: its command (`kvprefetch serve ...` without host and port), where it runs and is
    reached, its port, its KV events' ports (None: it publishes none), its cores."""

    name: str
    argv: tuple[str, ...]
    port: int
    log_dir: Path
    netns: str | None = None
    reach: str = "127.0.0.1"
    events: KvEventsPorts | None = None
    cpus: tuple[int, ...] = ()
    env: dict[str, str] = field(default_factory=dict)

    def command(self) -> list[str]:
        pin = ["taskset", "-c", ",".join(map(str, self.cpus))] if self.cpus else []
        return [*pin, *self.argv]

    def environment(self) -> dict[str, str]:
        bind = {"VLLM_CPU_OMP_THREADS_BIND": ",".join(map(str, self.cpus))} if self.cpus else {}
        return {"VLLM_SERVER_DEV_MODE": "1", NODE_ENV: self.name} | bind | self.env


class NodeServer:
    """A node's server across its lives: `start`, `wait_ready`, `reset`, `kill`, `start` again, `stop`."""

    def __init__(self, spec: NodeServerSpec):
        self.spec = spec
        self.server: OpenAIServer | None = None
        self.lives = 0  # how many times it was started

    @property
    def name(self) -> str:
        return self.spec.name

    @property
    def url(self) -> str:
        return f"http://{self.spec.reach}:{self.spec.port}"

    def start(self) -> NodeServer:
        """Started (not yet ready): its log is `<name>.log`, then `<name>-2.log` for a second life, ..."""
        self.lives += 1
        s = self.spec
        log = s.log_dir / (f"{s.name}.log" if self.lives == 1 else f"{s.name}-{self.lives}.log")
        self.server = OpenAIServer(s.command(), log, s.port, env=s.environment(), new_session=True, netns=s.netns,
                                   reach=s.reach)  # fmt: skip
        return self

    def wait_ready(self, timeout: float = 600) -> NodeServer:
        assert self.server is not None
        self.server.wait_ready(timeout)
        return self

    @property
    def alive(self) -> bool:
        return self.server is not None and self.server.proc.poll() is None

    def reset(self, timeout: float = 60) -> bool:
        """The engine's prefix cache and the node's DRAM pool and disk tier emptied (vLLM's reset with the
        connector's); False when vLLM refused (a request still running) or the node did not answer."""
        req = urllib.request.Request(self.url + "/reset_prefix_cache?reset_external=true", b"", method="POST")
        try:
            with urllib.request.urlopen(req, timeout=timeout) as r:
                return r.status == 200
        except (urllib.error.URLError, OSError):
            return False

    def metrics(self) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
        """Its /metrics, {} when it does not answer (a node that died)."""
        if self.server is None:
            return {}
        try:
            return parse_metrics(self.server.metrics_text())
        except (urllib.error.URLError, OSError):
            return {}

    def tail(self, n: int = 40) -> str:
        return self.server.tail(n) if self.server is not None else ""

    def kill(self) -> None:
        """SIGKILL to its whole process group: the node dies as a machine does, nothing drained. What a dead
        machine loses with it goes too: vLLM's shared-memory segments its processes had mapped (`shm_mapped_by_group`),
        which only their clean exit unlinks. The DRAM pool stays: it outlives its processes by design (the
        restarted server attaches to it again)."""
        if self.server is None:
            return
        pgid = self.server.proc.pid
        segments = shm_mapped_by_group(pgid)
        with contextlib.suppress(ProcessLookupError):
            os.killpg(pgid, signal.SIGKILL)
        self.server.proc.wait()
        self.server.stop(0)  # closes its log
        unlink_all(segments)

    def stop(self, timeout: float = 60) -> None:
        """SIGTERM (the connector drains); the rest of its group (vLLM's engine core and worker, which unlink their
        shared memory as they exit) given `GROUP_EXIT_S` to follow; whatever still outlives that SIGKILLed.
        Idempotent."""
        if self.server is None:
            return
        self.server.stop(timeout)
        pgid = self.server.proc.pid
        deadline = time.monotonic() + GROUP_EXIT_S
        while _group_alive(pgid) and time.monotonic() < deadline:
            time.sleep(0.2)
        with contextlib.suppress(ProcessLookupError):
            os.killpg(pgid, signal.SIGKILL)


def _group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
