"""`kvprefetch bench` stopped with SIGTERM cleans up as on a normal exit: its engines end, its pools leave /dev/shm,
its engines' vLLM sockets leave the temp folder."""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from kvprefetch.testbed.client import RPC_ENV, ZYGOTE_ENV
from kvprefetch.tiers.dram import SHM_DIR, pid_alive

pytest.importorskip("vllm")

pytestmark = [pytest.mark.slow, pytest.mark.engine]

_POOL = re.compile(r"(/\S*/kvprefetch-kvb-[0-9a-f]+-\S+\.pool)")


def descendants(pid: int) -> set[int]:
    out: set[int] = set()
    todo = [pid]
    while todo:
        p = todo.pop()
        for task in Path(f"/proc/{p}/task").glob("*"):
            try:
                kids = {int(c) for c in (task / "children").read_text().split()}
            except OSError:
                continue
            todo += list(kids - out)
            out |= kids
    return out


def mapped_pools(pids: set[int]) -> set[Path]:
    found: set[Path] = set()
    for p in pids:
        try:
            found |= {Path(m.group(1)) for m in _POOL.finditer(Path(f"/proc/{p}/maps").read_text())}
        except OSError:
            continue
    return found


def running(pid: int) -> bool:
    try:
        return pid_alive(pid) and Path(f"/proc/{pid}/stat").read_text().split(") ")[1][0] != "Z"
    except (OSError, IndexError):
        return False


def test_a_bench_stopped_with_sigterm_leaves_no_pool_and_no_engine(tmp_path, request):
    cmd = [sys.executable, "-m", "kvprefetch.cli", "bench", "--mode", "prefetch", "--concurrency", "1",
           "--out", str(tmp_path / "out"), "--cache-dir", str(tmp_path / "cache")]  # fmt: skip
    # as a user runs it: its engines its own children (not forked by the test suite's zygote), vLLM's sockets in the
    # temp folder (vLLM's default; here one of the test's own, short: a socket's path is at most 107 bytes)
    tmp = Path(tempfile.mkdtemp(prefix="kvpt-", dir="/tmp"))
    request.addfinalizer(lambda: shutil.rmtree(tmp, ignore_errors=True))
    env = {k: v for k, v in os.environ.items() if k not in (ZYGOTE_ENV, RPC_ENV)} | {"TMPDIR": str(tmp)}
    shm_before = set(Path("/dev/shm").glob("psm_*"))
    with open(tmp_path / "bench.log", "w") as log:
        bench = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env)
    try:
        deadline = time.monotonic() + 600
        pools: set[Path] = set()
        while not pools and bench.poll() is None and time.monotonic() < deadline:
            time.sleep(0.5)
            engines = descendants(bench.pid)
            pools = mapped_pools(engines)
        assert pools, f"the bench never mapped a pool; log:\n{(tmp_path / 'bench.log').read_text()[-3000:]}"
        assert all(p.parent == SHM_DIR for p in pools)
        engines = descendants(bench.pid)
        assert [s for s in tmp.glob("kvp-rpc-*/*") if s.is_socket()], "the engines' sockets are in its folder"
        bench.send_signal(signal.SIGTERM)
        assert bench.wait(timeout=180) == 128 + signal.SIGTERM
    finally:  # a failed assertion above stops the bench as the test would have (SIGKILL would leave its engines)
        if bench.poll() is None:
            bench.terminate()
            try:
                bench.wait(timeout=180)
            except subprocess.TimeoutExpired:
                bench.kill()
    assert not [p for p in pools if p.exists()], "the bench's pools are removed"
    run = pools.pop().name.split("-")[2]
    assert not list(SHM_DIR.glob(f"kvprefetch-kvb-{run}-*")), "and so is every other pool of that run"
    left = [p for p in engines if running(p)]
    assert not left, f"engine processes outlived the bench: {left}"
    # vLLM's message queues of the engines it killed (unlinked only by an executor's shutdown): ~400 MB each
    assert not set(Path("/dev/shm").glob("psm_*")) - shm_before, "the killed engines' shared memory is freed"
    assert not [s for s in tmp.rglob("*") if s.is_socket()] and not list(tmp.glob("kvp-rpc-*")), \
        "nor are vLLM's sockets left in the temp folder"
