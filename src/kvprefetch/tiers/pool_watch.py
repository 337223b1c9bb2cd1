"""The last one out of a DRAM pool, when the last process attached to it dies without detaching.

A process that detaches (`SharedChunkPool.close`) and finds no live process left applies the pool's policy
(`keep_idle_s` 0: the pool is removed). A process that dies without detaching cannot: SIGKILL, the OOM killer, or
a server stopped by SIGTERM to its whole process group, where vLLM's engine-core process resets its signal
handlers to the default before its own shutdown and the second SIGTERM of that stop (its API server's) kills it
there, before the connector's shutdown detaches. Without a watcher such a pool keeps its RAM until some later
process attaches to the name or `kvprefetch status` looks at it.

So every member that attaches to a pool whose keep_idle_s is 0 (the default: "free the RAM when the last user
is gone") makes sure one watcher process exists for it (`ensure_watcher`): a small daemon, out of the attaching
process's session and process tree (a double fork, so a stop that kills the server's process group or tree does
not reach it), which polls the pool's process table and, once no attached process is alive, does what the last
detach would have done: removes the pool. It then exits; it also exits when the pool is gone or its policy now
keeps it idle (a process declared another keep_idle_s since: the next attach or `kvprefetch status` expires such
a pool, as before), and a SIGTERM (systemd stops every process of a unit's cgroup) makes it finish within
`TERM_GRACE_S`.

One watcher per pool file: it holds an abstract unix socket named after the file, which the kernel frees when
it exits (nothing on disk to clean up). This module runs as a script (``python -I pool_watch.py ...``) and
imports only the standard library, so a watcher starts in milliseconds and costs a few MB; the pool's layout
(where its process table and lifecycle record lie) is handed to it on its command line by `tiers.dram`.
"""

from __future__ import annotations

import fcntl
import hashlib
import os
import signal
import socket
import struct
import subprocess
import sys
import time

POLL_S = 0.25  # how soon a pool whose last user died is removed
TERM_GRACE_S = 20.0  # after SIGTERM: how long a watcher still waits for the pool's users to die


def socket_name(path: str) -> bytes:
    """The abstract socket that marks "this pool file has a watcher" (abstract names need no cleanup)."""
    return b"\0kvprefetch-pool-watch-" + hashlib.blake2b(os.fsencode(path), digest_size=12).hexdigest().encode()


def watcher_running(path: str) -> bool:
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as s:
        try:
            s.connect(socket_name(path))
        except OSError:
            return False
    return True


def ensure_watcher(path: str, procs_offset: int, max_procs: int, life_offset: int) -> None:
    """Start the pool's watcher unless one runs already. Returns at once: the watcher detaches itself."""
    if watcher_running(path):
        return
    argv = [sys.executable, "-I", "-S", os.path.abspath(__file__), path, str(procs_offset), str(max_procs),
            str(life_offset)]  # fmt: skip
    # (the child forks again and exits at once; Popen reaps it when the next Popen is made, or at exit)
    subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                     close_fds=True, start_new_session=True)  # fmt: skip


# ---- the watcher process --------------------------------------------------------------------------------------
# The pool's lifecycle record (`tiers.dram` writes it at `_LIFE_OFFSET`): magic, keep_idle_s (-1: forever), last used.
_LIFE = struct.Struct("<8sdd")
_LIFE_MAGIC = b"KVPFLIFE"


def pid_alive(pid: int) -> bool:
    """Whether a process with this pid exists on the node (another user's counts as alive)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


class _Pool:
    """What the watcher reads of one pool file: its live users and its keep_idle_s."""

    def __init__(self, path: str, procs_offset: int, max_procs: int, life_offset: int):
        self.path = path
        self.procs_offset, self.max_procs, self.life_offset = procs_offset, max_procs, life_offset

    def users(self, fd: int) -> list[int]:
        raw = os.pread(fd, self.max_procs * 8, self.procs_offset)
        pids = struct.unpack(f"<{len(raw) // 8}q", raw[: len(raw) // 8 * 8])
        return [p for p in pids if p > 0 and pid_alive(p)]

    def keep_idle_s(self, fd: int) -> float | None:
        raw = os.pread(fd, _LIFE.size, self.life_offset)
        if len(raw) < _LIFE.size:
            return 0.0
        magic, keep, _last = _LIFE.unpack(raw)
        if magic != _LIFE_MAGIC:
            return 0.0
        return None if keep < 0 else keep

    def open(self) -> int | None:
        try:
            return os.open(self.path, os.O_RDONLY | os.O_NOFOLLOW)
        except OSError:
            return None

    def remove_if_unused(self) -> bool:
        """Under the pool's lock (the one its members mutate it under): remove the file if it is still this
        pool's name and no live process is attached. True when removed or gone."""
        fd = self.open()
        if fd is None:
            return True
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            try:
                if os.stat(self.path).st_ino != os.fstat(fd).st_ino:
                    return False  # removed and made anew meanwhile: a new pool, watched anew
            except FileNotFoundError:
                return True
            if self.users(fd) or self.keep_idle_s(fd) != 0:
                return False
            os.unlink(self.path)
            return True
        finally:
            os.close(fd)


def watch(pool: _Pool, stop_at: list[float]) -> None:
    """Poll until the pool is gone, or removed here, or kept idle by its policy; ``stop_at[0]``: a deadline."""
    while time.monotonic() < stop_at[0]:
        time.sleep(POLL_S)
        fd = pool.open()
        if fd is None:
            return  # removed by its last user, or by hand
        try:
            users, keep = pool.users(fd), pool.keep_idle_s(fd)
        finally:
            os.close(fd)
        if users:
            continue
        if keep != 0:
            return  # kept idle by its policy: the next attach or `kvprefetch status` expires it
        if pool.remove_if_unused():
            return


def main(argv: list[str]) -> None:
    path, procs_offset, max_procs, life_offset = argv[0], int(argv[1]), int(argv[2]), int(argv[3])
    if os.fork():  # the first child exits at once: the watcher is nobody's child, out of the server's tree
        os._exit(0)
    marker = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    try:
        marker.bind(socket_name(path))
    except OSError:
        return  # another watcher has this pool
    stop_at = [float("inf")]

    def on_term(_signum: int, _frame: object) -> None:
        stop_at[0] = min(stop_at[0], time.monotonic() + TERM_GRACE_S)

    signal.signal(signal.SIGTERM, on_term)
    signal.signal(signal.SIGINT, on_term)
    signal.signal(signal.SIGHUP, signal.SIG_IGN)
    os.chdir("/")
    watch(_Pool(path, procs_offset, max_procs, life_offset), stop_at)


if __name__ == "__main__":
    main(sys.argv[1:])
