"""A Mooncake Store pool in a network namespace of its own, for nodes in other namespaces (issue 63).

A Mooncake Store keeps values in the segments its clients mount, and every client reads a value straight from the
segment that holds it (the master only says where). A pool the nodes share therefore needs, in the pool's
namespace: `mooncake_master` (with its HTTP metadata server) and a process that mounts the memory (this module's
`holder`: a client that sets up with a large `global_segment_size` and stays up). Both bind one address that
every node can route to (the pool's service address; a node reaches it over its own link), because the holder
publishes that address in the metadata and each node connects to it to move bytes. The nodes are clients with
`segment_bytes: 0` (their segments take no puts, so every value lives in the pool) and `local_hostname` their own
address. Mooncake's master keeps its objects and metadata in memory: a master SIGKILLed and restarted is an empty
pool; the holder mounts its segment again with the new master on its own (its ping thread), the nodes reconnect.

    python -m kvprefetch.testbed.mooncake_pool HOST METADATA_SERVER MASTER SEGMENT_BYTES

runs the holder: it prints `ready` once mounted, then answers `clear` lines on stdin (every value removed, forced:
`removed N`) until stdin closes.
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
from pathlib import Path

from kvprefetch.testbed.local_servers import MooncakeMaster


class MooncakePool:
    """mooncake_master and a segment holder of `segment_bytes`, in namespace `netns` (None: this one) at `host`.
    `kill()`/`start()` SIGKILL and restart the master (the holder stays, and mounts its segment again)."""

    def __init__(self, workdir: Path, segment_bytes: int, netns: str | None = None, host: str = "127.0.0.1",
                 ready_timeout_s: float = 60.0):  # fmt: skip
        self.workdir, self.segment_bytes, self.netns, self.host = workdir, segment_bytes, netns, host
        self.master = MooncakeMaster(workdir, netns=netns, host=host)
        self.holder: subprocess.Popen | None = None
        try:
            self._start_holder(ready_timeout_s)
        except BaseException:
            self.close()
            raise

    @property
    def proc(self) -> subprocess.Popen | None:
        """The master's process (None while it is killed)."""
        return self.master.proc

    @property
    def procs(self) -> list[subprocess.Popen]:
        return [p for p in (self.master.proc, self.holder) if p is not None and p.poll() is None]

    def _start_holder(self, timeout_s: float) -> None:
        argv = [sys.executable, "-m", __name__, self.host, self.master.metadata_server, self.master.master,
                str(self.segment_bytes)]  # fmt: skip
        if self.netns is not None:
            argv = ["ip", "netns", "exec", self.netns, *argv]
        log = open(self.workdir / "mooncake_holder.log", "ab")  # noqa: SIM115 - lives as long as the process
        env = os.environ | {"MC_TCP_BIND_ADDRESS": self.host}
        self.holder = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=log, text=True,
                                       env=env)  # fmt: skip
        line = _readline(self.holder, timeout_s)
        if line != "ready":
            raise RuntimeError(f"the Mooncake segment holder did not start ({line!r}; see {log.name})")

    def clear(self, timeout_s: float = 60.0) -> int:
        """Every value removed (forced: leases and replication ignored); how many."""
        assert self.holder is not None and self.holder.stdin is not None
        self.holder.stdin.write("clear\n")
        self.holder.stdin.flush()
        line = _readline(self.holder, timeout_s)
        if not line.startswith("removed "):
            raise RuntimeError(f"the Mooncake segment holder could not clear the pool: {line!r}")
        return int(line.split()[1])

    def kill(self) -> None:
        """The master SIGKILLed: every object's record is gone (the bytes in the holder's segment are unreachable)."""
        self.master.kill()

    def start(self) -> None:
        """The master started again, empty, on the same ports."""
        self.master.start()

    def close(self) -> None:
        """The holder SIGKILLed (its segment goes with it; a clean close would wait on the master), then the master."""
        if self.holder is not None:
            with contextlib.suppress(ProcessLookupError):
                self.holder.kill()
            self.holder.wait()
            for f in (self.holder.stdin, self.holder.stdout):
                with contextlib.suppress(OSError):
                    f.close()
            self.holder = None
        self.master.kill()


def _readline(proc: subprocess.Popen, timeout_s: float) -> str:
    """One line of proc's stdout within timeout_s ('' if it exited or said nothing in time)."""
    import selectors

    assert proc.stdout is not None
    with selectors.DefaultSelector() as sel:
        sel.register(proc.stdout, selectors.EVENT_READ)
        if not sel.select(timeout_s):
            return ""
    return proc.stdout.readline().strip()


def holder(host: str, metadata_server: str, master: str, segment_bytes: int) -> None:
    """The segment-holding client: mounts `segment_bytes` of this process's memory in the pool and stays up."""
    os.environ.setdefault("MC_TCP_BIND_ADDRESS", host)
    from mooncake.store import MooncakeDistributedStore

    store = MooncakeDistributedStore()
    rc = store.setup(host, metadata_server, segment_bytes, 16 << 20, "tcp", "", master)
    print("ready" if rc == 0 else f"setup returned {rc}", flush=True)
    if rc != 0:
        os._exit(1)
    for line in sys.stdin:
        if line.strip() == "clear":
            print(f"removed {store.remove_all(True)}", flush=True)
    os._exit(0)  # no close(): with the master gone it waits for it; the segment goes with the process


if __name__ == "__main__":
    holder(sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4]))
