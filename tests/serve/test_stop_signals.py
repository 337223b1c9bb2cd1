"""However a `kvprefetch serve` is stopped, it leaves no DRAM pool (keep_idle_s 0), no process, and every chunk it
saved on disk.

Four servers (each in its own session, as a service or a terminal runs it) serve one completion each and are
stopped four ways: SIGINT to the process group (Ctrl-C), SIGTERM to the main process (`kill PID`, Kubernetes),
SIGTERM to the process group (`systemctl stop`'s default, `kill -TERM -PGID`) and SIGTERM to the engine-core
process alone. The third used to leave the pool in /dev/shm: vLLM's engine core resets its signal handlers
before its own shutdown, so the second SIGTERM of that stop (its API server's) killed it before the connector
detached; the pool's watcher (`kvprefetch.tiers.pool_watch`) is the last one out now.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import urllib.request
import uuid
from dataclasses import dataclass
from pathlib import Path

import pytest

pytest.importorskip("vllm")

from kvprefetch.bench.server import free_port, metric_sum, parse_metrics, tiny_model_dir
from kvprefetch.config import default_cache_dir
from kvprefetch.tiers.dram import SHM_DIR

pytestmark = pytest.mark.slow

WAYS = ("sigint-group", "sigterm-main", "sigterm-group", "sigterm-engine-core")
PROMPT = " ".join(f"w{5 + i % 4000}" for i in range(700))


@dataclass
class Stopped:
    way: str
    pool: Path
    disk: Path
    saved_chunks: float
    exit_code: int
    seconds: float
    left: list[str]  # processes of its group still alive after the main one exited (and a grace)
    log: Path


def _get(url: str, timeout: float = 5) -> bytes:
    with urllib.request.urlopen(url, timeout=timeout) as r:
        return r.read()


def _complete(port: int) -> None:
    body = json.dumps({"model": "tiny", "prompt": PROMPT, "max_tokens": 4}).encode()
    req = urllib.request.Request(f"http://127.0.0.1:{port}/v1/completions", body, {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=300) as r:
        assert json.loads(r.read())["choices"][0]["text"]


def _group(pgid: int) -> list[str]:
    out = subprocess.run(["pgrep", "-a", "-g", str(pgid)], capture_output=True, text=True).stdout
    return out.splitlines()


def _engine_core(pid: int) -> int:
    out = subprocess.run(["pgrep", "-P", str(pid)], capture_output=True, text=True).stdout.split()
    for child in out:
        comm = Path(f"/proc/{child}/comm").read_text().strip()
        if comm.startswith("VLLM::EngineCor"):
            return int(child)
    raise AssertionError(f"no engine-core process under {pid}: {out}")


def _stop(way: str, proc: subprocess.Popen) -> None:
    if way == "sigint-group":
        os.killpg(proc.pid, signal.SIGINT)
    elif way == "sigterm-main":
        proc.send_signal(signal.SIGTERM)
    elif way == "sigterm-group":
        os.killpg(proc.pid, signal.SIGTERM)
    else:
        os.kill(_engine_core(proc.pid), signal.SIGTERM)


@pytest.fixture(scope="module")
def stopped(tmp_path_factory) -> dict[str, Stopped]:
    work = tmp_path_factory.mktemp("stops")
    tiny_model_dir(default_cache_dir() / "tiny-llama")  # made once here, not by four servers at once
    servers = {}
    try:
        for way in WAYS:
            pool, port = f"kvpt-stop-{uuid.uuid4().hex[:8]}", free_port()
            disk, log = work / way / "disk", work / f"{way}.log"
            argv = [sys.executable, "-m", "kvprefetch.cli", "serve", "kvprefetch-tiny",
                    "--set", f"dram.pool_name={pool}", "--set", "dram.capacity_bytes=64MiB",
                    "--set", f"disk.path={disk}", "--set", "log_interval_s=0",
                    "--port", str(port), "--host", "127.0.0.1", "--served-model-name", "tiny",
                    "--kv-cache-memory-bytes", str(48 << 20), "--max-model-len", "4096"]  # fmt: skip
            with open(log, "w") as out:
                proc = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, start_new_session=True,
                                        env=dict(os.environ, PYTHONUNBUFFERED="1"))  # fmt: skip
            servers[way] = (proc, port, SHM_DIR / f"kvprefetch-{pool}.pool", disk, log)
        deadline = time.monotonic() + 900
        for way, (proc, port, *_rest) in servers.items():
            while True:
                assert proc.poll() is None, f"{way}: server exited; see {servers[way][-1]}"
                assert time.monotonic() < deadline, f"{way}: not ready"
                try:
                    _get(f"http://127.0.0.1:{port}/health")
                    break
                except OSError:
                    time.sleep(0.5)
        results = {}
        for way, (proc, port, pool, disk, log) in servers.items():
            _complete(port)
            time.sleep(0.5)  # the worker reports its saves with the step after
            saved = metric_sum(parse_metrics(_get(f"http://127.0.0.1:{port}/metrics").decode()),
                               "vllm:kvprefetch_saved_chunks_total")  # fmt: skip
            assert pool.exists(), f"{way}: the server's DRAM pool"
            t0 = time.monotonic()
            _stop(way, proc)
            rc = proc.wait(timeout=120)
            seconds = time.monotonic() - t0
            end = time.monotonic() + 15  # what the main process left behind has this long to go
            while _group(proc.pid) and time.monotonic() < end:
                time.sleep(0.2)
            results[way] = Stopped(way, pool, disk, saved, rc, seconds, _group(proc.pid), log)
        yield results
    finally:
        for proc, _port, pool, _disk, _log in servers.values():
            if proc.poll() is None or _group(proc.pid):
                subprocess.run(["kill", "-9", f"-{proc.pid}"], capture_output=True, check=False)
            pool.unlink(missing_ok=True)


def _gone_within(path: Path, seconds: float) -> bool:
    deadline = time.monotonic() + seconds
    while path.exists() and time.monotonic() < deadline:
        time.sleep(0.1)
    return not path.exists()


@pytest.mark.parametrize("way", WAYS)
def test_a_stopped_server_leaves_no_pool_no_process_and_every_saved_chunk_on_disk(stopped, way):
    s = stopped[way]
    assert s.exit_code in (0, -signal.SIGTERM, -signal.SIGINT, 1), (way, s.exit_code)
    assert s.left == [], f"{way}: processes left in the server's group: {s.left}"
    assert _gone_within(s.pool, 5), f"{way}: {s.pool} still held after the stop"
    watchers = subprocess.run(["pgrep", "-af", "pool_watch"], capture_output=True, text=True).stdout
    assert str(s.pool) not in watchers, "the pool's watcher exits with its pool"
    on_disk = len(list(s.disk.rglob("*.kv")))
    assert s.saved_chunks > 0 and on_disk == s.saved_chunks, (way, on_disk, s.saved_chunks, s.log)
