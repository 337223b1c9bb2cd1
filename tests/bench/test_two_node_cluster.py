"""The two-node scenario's cluster (`kvprefetch.testbed.cluster`): a real pool namespace with redis-server, node
namespaces on shaped veth links, its fault verbs, and nothing left behind: on exit, on SIGTERM, on a failed start."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest

from kvprefetch.testbed import netns
from kvprefetch.testbed.cluster import TwoNodeCluster

pytestmark = pytest.mark.skipif(netns.available() is not None, reason=str(netns.available()))

PING = textwrap.dedent("""
    import sys, redis
    r = redis.Redis.from_url(sys.argv[1], socket_timeout=1, socket_connect_timeout=1)
    try:
        if sys.argv[2] == "set":
            r.set("k", b"v")
        print("found" if r.get("k") == b"v" else "empty")
    except redis.ConnectionError as err:
        print("unreachable", err)
""")


def _ask(c: TwoNodeCluster, node: int, what: str = "get") -> str:
    url = c.remote_section(node, "kvprefetch:", 1.0)["redis"]["url"]
    out = subprocess.run(c.fabric.exec_argv(c.node_ns(node), [sys.executable, "-c", PING, url, what]),
                         capture_output=True, text=True, timeout=30)  # fmt: skip
    return out.stdout.strip() or out.stderr.strip()


def _ours(tag: str) -> list[str]:
    return [ns for ns in netns.namespaces() if ns.startswith(f"{netns.PREFIX}{tag}-")]


def test_nodes_reach_the_pool_over_their_links_and_faults_cut_it(tmp_path):
    with TwoNodeCluster(tmp_path, rate_bps=200_000_000) as c:
        assert _ask(c, 0, "set") == "found"
        assert _ask(c, 1) == "found"  # node-b reads what node-a wrote: one pool, over its own link
        c.set_links(False)
        assert _ask(c, 1).startswith("unreachable")
        c.set_links(True)
        assert _ask(c, 1) == "found"
        c.kill_pool()
        assert _ask(c, 0).startswith("unreachable")
        c.restart_pool()
        assert _ask(c, 0) == "empty"  # back on the same port, without what it held
        assert c.leftovers()  # everything is there while the cluster lives
    assert c.leftovers() == []


def test_a_failed_start_leaves_nothing(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("")
    c = TwoNodeCluster(blocker / "pool", rate_bps=None)  # its server's directory cannot be made
    with pytest.raises(OSError), c:
        pass
    assert c.leftovers() == [] and _ours(c.fabric.tag) == []


CLUSTER = textwrap.dedent("""
    import sys, time
    from pathlib import Path
    from kvprefetch.testbed.cluster import TwoNodeCluster
    from kvprefetch.cli import exit_on_sigterm
    exit_on_sigterm()
    with TwoNodeCluster(Path(sys.argv[1]), 100_000_000) as c:
        print(c.server.proc.pid, flush=True)
        time.sleep(120)
""")


def test_sigterm_removes_the_cluster(tmp_path):
    proc = subprocess.Popen([sys.executable, "-c", CLUSTER, str(tmp_path)], stdout=subprocess.PIPE, text=True)
    try:
        redis_pid = int(proc.stdout.readline())
        tag = f"{proc.pid:x}"
        assert len(_ours(tag)) == 3
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=30) == 128 + signal.SIGTERM
    finally:
        if proc.poll() is None:
            proc.kill()
    assert _ours(tag) == []
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline and os.path.exists(f"/proc/{redis_pid}"):
        time.sleep(0.05)
    assert not os.path.exists(f"/proc/{redis_pid}")
    links = subprocess.run(["ip", "-o", "link", "show"], capture_output=True, text=True).stdout
    assert f"k{tag}x" not in links
