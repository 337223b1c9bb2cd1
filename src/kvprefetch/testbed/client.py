"""Start an engine process (`engine_proc`) and talk to it in its protocol (`kvprefetch.testbed.protocol`): the
bench's engines and the tests' are these."""

from __future__ import annotations

import contextlib
import json
import os
import queue
import signal
import subprocess
import sys
import tempfile
import threading
from pathlib import Path
from typing import Any

import psutil

from kvprefetch.testbed import protocol as P
from kvprefetch.testbed.zygote import ENV as ZYGOTE_ENV  # its socket: engines forked from it

RPC_ENV = "VLLM_RPC_BASE_PATH"
SOCKET_PATH_MAX = 107 - 37  # a UNIX socket's path is at most 107 bytes; vLLM names its sockets "/<uuid4>" in the folder


class EngineError(RuntimeError):
    pass


def own_socket_folder() -> str | None:
    """Give the vLLM engines this process starts from now on a ZeroMQ socket folder of their own (in the
    environment they inherit); the folder, for the caller to remove when they are gone, or None where the caller set
    one or the temp folder's path is too long for a socket under it (vLLM's default is left: no engine could start).

    vLLM names its sockets in VLLM_RPC_BASE_PATH (/tmp by default) and leaves those of every engine killed or
    stopped uncleanly (one `make bench` left 32 in /tmp, the 900 s soak 56, an hour of tests some 300)."""
    if RPC_ENV in os.environ:
        return None
    folder = tempfile.mkdtemp(prefix="kvp-rpc-")
    if len(os.fsencode(folder)) > SOCKET_PATH_MAX:
        os.rmdir(folder)
        return None
    os.environ[RPC_ENV] = folder
    return folder


VLLM_SHM = ("/dev/shm/psm_", "/dev/shm/vllm_")
"""vLLM's shared memory: its message queues (Python's `multiprocessing.shared_memory`, psm_*) and its own segments
(vllm_*, e.g. the CPU build's tensor-parallel buffers)."""


def shm_mapped_by_group(pgid: int) -> set[Path]:
    """The shared-memory segments of vLLM's (`VLLM_SHM`) that the processes of a process group map: an engine's
    and its workers' message queues (~400 MB an engine), which only the executor's shutdown unlinks, so a killed
    engine leaves them in RAM until the next reboot. (Never the connector's DRAM pool: it outlives its processes
    by design.)"""
    found: set[Path] = set()
    for proc in psutil.process_iter():
        try:
            if os.getpgid(proc.pid) != pgid:
                continue
            found |= {Path(m.path) for m in proc.memory_maps() if m.path.startswith(VLLM_SHM)}
        except (psutil.Error, ProcessLookupError):
            continue  # gone meanwhile, or not ours to read
    return found


def unlink_all(paths: set[Path]) -> int:
    """Unlink shared-memory segments (`shm_mapped_by_group`'s) a killed group left; how many were still there."""
    n = 0
    for path in paths:
        with contextlib.suppress(FileNotFoundError):
            path.unlink()
            n += 1
    return n


class ForkedProcess:
    """An engine process forked by the zygote (`kvprefetch.testbed.zygote`), with what `EngineProcess` uses of a
    `Popen`: text pipes to its stdin and from its stdout, `poll`, `wait`, `kill`. It is not this process's
    child: its end is seen through a pidfd, and its exit code is unknown (reported as 0; a kill as -9)."""

    def __init__(self, zygote: str, spec_json: str, env: dict[str, str], stderr) -> None:
        import socket

        stdin_r, stdin_w = os.pipe()
        stdout_r, stdout_w = os.pipe()
        try:
            with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
                s.connect(zygote)
                req = {"spec": spec_json, "env": env, "cwd": os.getcwd()}
                socket.send_fds(s, [json.dumps(req).encode()], [stdin_r, stdout_w, stderr.fileno()])
                self.pid = int(s.recv(64))
        finally:
            os.close(stdin_r)
            os.close(stdout_w)
        self.stdin = open(stdin_w, "w")  # noqa: SIM115  (closed with the process)
        self.stdout = open(stdout_r)  # noqa: SIM115
        self._pidfd = os.pidfd_open(self.pid)
        self.returncode: int | None = None

    def _ended(self, timeout: float | None) -> bool:
        """Whether the process ended within `timeout` seconds (None: however long it takes)."""
        import select

        if self.returncode is None and select.select([self._pidfd], [], [], timeout)[0]:
            self.returncode = 0
        return self.returncode is not None

    def poll(self) -> int | None:
        return self.returncode if self._ended(0) else None

    def wait(self, timeout: float | None = None) -> int:
        if not self._ended(timeout):
            raise subprocess.TimeoutExpired("engine_proc", timeout or 0)
        assert self.returncode is not None
        return self.returncode

    def kill(self) -> None:
        if self.returncode is not None:  # ended (and its pid maybe reused)
            return
        with contextlib.suppress(ProcessLookupError):
            os.kill(self.pid, signal.SIGKILL)
        self.wait()
        self.returncode = -signal.SIGKILL


class EngineProcess:
    """An engine process and its protocol. Constructed, it has started and answered that it is ready; with
    `wait=False` it is only launched, so that several engines can start at once (their start is mostly vLLM's
    worker importing torch and vLLM), and `wait_ready()` waits for it."""

    def __init__(self, spec: P.EngineSpec, log_path: Path, start_timeout: float = 900, log_level: str = "WARNING",
                 wait: bool = True):  # fmt: skip
        self.spec = spec
        self.ready: dict | None = None
        self.log_path = log_path
        env = dict(os.environ)
        env.setdefault("VLLM_LOGGING_LEVEL", log_level)
        env["PYTHONUNBUFFERED"] = "1"
        self._log = open(log_path, "w")  # noqa: SIM115  (closed in close())
        zygote = os.environ.get(ZYGOTE_ENV)
        self.proc: subprocess.Popen | ForkedProcess
        if zygote:
            self.proc = ForkedProcess(zygote, spec.model_dump_json(), env, self._log)
        else:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "kvprefetch.testbed.engine_proc", spec.model_dump_json()],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=self._log,
                text=True,
                env=env,
                start_new_session=True,  # its own process group: its vLLM workers end with it (`_end_group`)
            )
        self._q: queue.Queue = queue.Queue()
        self._lock = threading.Lock()
        threading.Thread(target=self._pump, daemon=True).start()
        if wait:
            self.wait_ready(start_timeout)

    def wait_ready(self, timeout: float = 900) -> dict:
        """The engine's ready message, once it has sent it; a failed start kills what is left of it."""
        if self.ready is None:
            try:
                self.ready = self._wait(timeout)
            except BaseException:  # a failed start, or this process interrupted (SIGINT/SIGTERM) while waiting
                self.kill()
                raise
        return self.ready

    def _pump(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            if line.startswith(P.MARK):
                self._q.put(json.loads(line[len(P.MARK) :]))
            else:
                with self._lock:
                    self._log.write(line)
        self._q.put(None)

    def _wait(self, timeout: float) -> dict:
        try:
            msg = self._q.get(timeout=timeout)
        except queue.Empty:
            raise EngineError(f"engine did not answer in {timeout:.0f}s; log: {self.log_path}") from None
        if msg is None:
            raise EngineError(f"engine exited (code {self.proc.wait()}); log tail:\n{self.tail()}")
        if "error" in msg:
            raise EngineError(msg["error"] + ("\n" + msg["trace"] if msg.get("trace") else ""))
        return msg

    def tail(self, n: int = 40) -> str:
        with self._lock:
            self._log.flush()
        try:
            return "".join(self.log_path.read_text(errors="replace").splitlines(True)[-n:])
        except OSError:
            return ""

    def call(self, req: P.Request, timeout: float = 1800) -> Any:
        """Send a request and wait for its answer: the request's reply model, or the dict the engine sent where
        the request names none."""
        self.send(req)
        msg = self._wait(timeout)
        return req.reply.model_validate(msg) if req.reply is not None else msg

    def send(self, req: P.Request) -> None:
        """Write a request without waiting for an answer (the serve protocol streams them)."""
        assert self.proc.stdin is not None
        try:
            self.proc.stdin.write(P.encode(req) + "\n")
            self.proc.stdin.flush()
        except BrokenPipeError:
            raise EngineError(f"engine is gone; log tail:\n{self.tail()}") from None

    def poll(self, timeout: float = 0.0) -> dict | None:
        """The next message if one comes within timeout (None if not); EngineError if the engine is gone."""
        try:
            msg = self._q.get(timeout=timeout) if timeout > 0 else self._q.get_nowait()
        except queue.Empty:
            return None
        if msg is None:
            self._q.put(None)
            raise EngineError(f"engine exited (code {self.proc.wait()}); log tail:\n{self.tail()}")
        if "error" in msg:
            raise EngineError(msg["error"] + ("\n" + msg["trace"] if msg.get("trace") else ""))
        return msg

    def kill(self) -> None:
        """End the engine now (SIGKILL), as when this process is interrupted: no graceful exit to wait for. What
        vLLM's executor would have unlinked at its shutdown (its message queues' shared memory) goes with it."""
        segments = shm_mapped_by_group(self.proc.pid) if self.proc.poll() is None else set()
        self.proc.kill()
        self.proc.wait()
        self._end_group()
        unlink_all(segments)
        self._log.close()

    def _end_group(self) -> None:
        """SIGKILL whatever the engine started and left behind (vLLM's worker processes, which otherwise notice
        their parent's end only later, holding the model's memory and cores meanwhile)."""
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.proc.pid, signal.SIGKILL)

    def close(self) -> None:
        """Ask the engine to exit and wait for it (a minute); one still starting is killed (it would answer only
        once started)."""
        if self.ready is None:
            self.kill()
            return
        if self.proc.poll() is None:
            with contextlib.suppress(Exception):
                self.call(P.Exit(), timeout=60)
            try:
                self.proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                self.kill()
                return
        self._end_group()
        self._log.close()
