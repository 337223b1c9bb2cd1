"""A parent for engine processes that has imported torch and vLLM once: each engine process is forked from it
instead of starting a Python that imports them again (~7 s of an engine's ~8 s start on a 2-core machine).

    python -m kvprefetch.testbed.zygote SOCKET        # serves until killed

`EngineProcess` uses it when ``KVPREFETCH_ENGINE_ZYGOTE`` names its socket (the test suite starts one for its
~35 engines); otherwise it starts `engine_proc` as a new process, as a deployment does. A request passes the
engine's stdin, stdout and stderr as file descriptors (SCM_RIGHTS) with its spec, environment and working
directory; the zygote forks, the child starts a session of its own (its process group is the engine's, as with
``start_new_session``), takes those descriptors as 0, 1 and 2 and runs `engine_proc.main`. The zygote answers the
child's pid and reaps its children; an engine's exit code is not known to its caller.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import sys

ENV = "KVPREFETCH_ENGINE_ZYGOTE"  # names the socket; `EngineProcess` forks through it when set


def _reap(_signum: int, _frame: object) -> None:
    with contextlib.suppress(ChildProcessError):
        while os.waitpid(-1, os.WNOHANG)[0] > 0:
            pass


def _child(listener: socket.socket, conn: socket.socket, req: dict, fds: list[int], led: int) -> None:
    """In the forked child: become the engine process the request describes (never returns). `led` is written
    once the child leads its own session, so its pid is answered only when its group is its own."""
    try:
        listener.close()
        conn.close()
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)
        os.setsid()
        os.write(led, b"1")
        os.close(led)
        for target, fd in enumerate(fds):
            os.dup2(fd, target)
            os.close(fd)
        os.chdir(req["cwd"])
        os.environ.clear()
        os.environ.update(req["env"])
        sys.argv = ["kvprefetch.testbed.engine_proc", req["spec"]]
        from kvprefetch.testbed import engine_proc

        engine_proc.main()
    finally:
        os._exit(1)


def serve(path: str) -> None:
    import torch  # noqa: F401  (what every engine imports: loaded once, here)
    import vllm.v1.engine.core  # noqa: F401

    import kvprefetch.testbed.engine_proc
    import kvprefetch.vllm.connector  # noqa: F401
    from vllm import EngineArgs, LLMEngine  # noqa: F401

    signal.signal(signal.SIGCHLD, _reap)
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(path)
    listener.listen(16)
    print("ready", flush=True)
    while True:
        try:
            conn, _ = listener.accept()
        except InterruptedError:
            continue
        with conn:
            msg, fds, _flags, _addr = socket.recv_fds(conn, 1 << 20, 3)
            req = json.loads(msg)
            sys.stdout.flush()
            sys.stderr.flush()
            led_r, led_w = os.pipe()
            pid = os.fork()
            if pid == 0:
                os.close(led_r)
                _child(listener, conn, req, fds, led_w)
            for fd in (*fds, led_w):
                os.close(fd)
            os.read(led_r, 1)  # (empty if the child died first)
            os.close(led_r)
            conn.sendall(str(pid).encode())


if __name__ == "__main__":
    serve(sys.argv[1])
