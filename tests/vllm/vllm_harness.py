"""Start and talk to `engine_runner.py` processes."""

from __future__ import annotations

import contextlib
import json
import os
import queue
import subprocess
import sys
import threading
from pathlib import Path

RUNNER = Path(__file__).with_name("vllm_engine_runner.py")
MARK = "@@KVP "


class Engine:
    def __init__(self, spec: dict, log_path: Path, timeout: float = 300):
        self.spec = spec
        self.log_path = log_path
        env = dict(os.environ)
        env.setdefault("VLLM_LOGGING_LEVEL", "INFO")
        env["PYTHONUNBUFFERED"] = "1"
        self._log = open(log_path, "w")  # noqa: SIM115  (closed in close())
        self.proc = subprocess.Popen(
            [sys.executable, str(RUNNER), json.dumps(spec)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self._log,
            text=True,
            env=env,
        )
        self._q: queue.Queue = queue.Queue()
        threading.Thread(target=self._pump, daemon=True).start()
        self._wait(timeout)

    def _pump(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            if line.startswith(MARK):
                self._q.put(json.loads(line[len(MARK) :]))
            else:
                self._log.write(line)
        self._q.put(None)

    def _wait(self, timeout: float) -> dict:
        try:
            msg = self._q.get(timeout=timeout)
        except queue.Empty:
            raise TimeoutError(f"engine did not answer in {timeout}s; log: {self.log_path}") from None
        if msg is None:
            raise RuntimeError(f"engine exited; log tail:\n{self.tail()}")
        return msg

    def tail(self, n: int = 60) -> str:
        self._log.flush()
        try:
            return "".join(self.log_path.read_text().splitlines(True)[-n:])
        except OSError:
            return ""

    def call(self, timeout: float = 300, **cmd) -> dict:
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps(cmd) + "\n")
        self.proc.stdin.flush()
        return self._wait(timeout)

    def generate(self, prompts, max_tokens: int = 8, **kw) -> list[dict]:
        return self.call(op="generate", prompts=prompts, max_tokens=max_tokens, **kw)["outputs"]

    def counters(self) -> dict:
        return self.call(op="counters")

    def flush(self) -> bool:
        return self.call(op="flush")["flushed"]

    def close(self) -> None:
        if self.proc.poll() is None:
            with contextlib.suppress(Exception):
                self.call(op="exit", timeout=60)
            try:
                self.proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._log.close()


def connector_config(extra: dict) -> dict:
    return {
        "kv_connector": "KVPrefetchConnector",
        "kv_connector_module_path": "kvprefetch.vllm",
        "kv_role": "kv_both",
        "kv_connector_extra_config": extra,
    }
