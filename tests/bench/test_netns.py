"""Nodes on one machine (`kvprefetch.testbed.netns`): real network namespaces and veth links, a tbf-shaped rate that
holds, a link taken down and brought back, and nothing left behind, also by a process SIGKILLed mid-run."""

from __future__ import annotations

import signal
import subprocess
import sys
import textwrap

import pytest

from kvprefetch.testbed import netns
from kvprefetch.testbed.netns import Fabric

pytestmark = pytest.mark.skipif(netns.available() is not None, reason=str(netns.available()))

SERVER = textwrap.dedent("""
    import socket, sys
    s = socket.create_server((sys.argv[1], 7007))
    print("ready", flush=True)
    while True:
        c, _ = s.accept()
        c.sendall(b"x" * int(sys.argv[2]))
        c.close()
""")
CLIENT = textwrap.dedent("""
    import socket, sys, time
    t0 = time.monotonic()
    n = 0
    with socket.create_connection((sys.argv[1], 7007), timeout=float(sys.argv[2])) as c:
        while chunk := c.recv(1 << 20):
            n += len(chunk)
    print(n, time.monotonic() - t0)
""")


def _fetch(fab: Fabric, ns: str, ip: str, timeout: float = 5.0) -> tuple[int, float]:
    out = subprocess.run(fab.exec_argv(ns, [sys.executable, "-c", CLIENT, ip, str(timeout)]), capture_output=True,
                         text=True, timeout=60)  # fmt: skip
    if out.returncode:
        raise ConnectionError(out.stderr.strip().splitlines()[-1])
    n, seconds = out.stdout.split()
    return int(n), float(seconds)


def test_a_shaped_link_carries_bytes_no_faster_than_its_rate_and_can_be_cut_and_restored():
    nbytes, rate = 4 << 20, 64_000_000  # 4 MiB at 64 Mbit/s: >= 0.52 s
    with Fabric() as fab:
        pool, node = fab.ns("pool"), fab.ns("node-a")
        link = fab.link(pool, node, rate_bps=rate)
        server = subprocess.Popen(fab.exec_argv(pool, [sys.executable, "-c", SERVER, link.a.ip, str(nbytes)]),
                                  stdout=subprocess.PIPE, text=True)  # fmt: skip
        try:
            assert server.stdout.readline().strip() == "ready"
            n, seconds = _fetch(fab, node, link.a.ip)
            assert n == nbytes
            floor = (nbytes - netns.burst_bytes(rate)) * 8 / rate
            assert seconds >= 0.9 * floor, f"{seconds:.2f} s: the link is not shaped to {rate / 1e6:.0f} Mbit/s"
            fab.set_up(link, False)
            with pytest.raises(ConnectionError):
                _fetch(fab, node, link.a.ip, timeout=1.0)
            fab.set_up(link, True)
            assert _fetch(fab, node, link.a.ip)[0] == nbytes
            assert link.a.ip not in subprocess.run(["ip", "addr"], capture_output=True, text=True).stdout, (
                "the link lives inside the namespaces only"
            )
        finally:
            server.kill()
            server.wait()
        names = [pool, node]
    assert not set(names) & set(netns.namespaces()), "closing removes every namespace it made"


MAKER = textwrap.dedent("""
    from kvprefetch.testbed.netns import Fabric
    fab = Fabric().__enter__()
    a, b = fab.ns("pool"), fab.ns("node-a")
    fab.link(a, b, rate_bps=10_000_000)
    front = fab.link_host(b)
    print(a, b, front.a.dev, flush=True)
    import time; time.sleep(60)
""")


def test_sweep_removes_what_a_killed_process_left_and_nothing_a_live_one_holds():
    maker = subprocess.Popen([sys.executable, "-c", MAKER], stdout=subprocess.PIPE, text=True)
    *left, host_end = maker.stdout.readline().split()
    maker.send_signal(signal.SIGKILL)
    maker.wait()
    with Fabric() as mine:
        live = mine.ns("pool")
        assert set(left) <= set(netns.namespaces())
        swept = netns.sweep()
        assert set(left) | {host_end} <= set(swept) and live not in swept
        assert not set(left) & set(netns.namespaces()) and live in netns.namespaces()
        assert host_end not in subprocess.run(["ip", "-o", "link"], capture_output=True, text=True).stdout


def test_bad_roles_are_refused_before_anything_is_made():
    with Fabric() as fab, pytest.raises(ValueError, match="namespace role"):
        fab.ns("Pool A")


JOINER = textwrap.dedent("""
    import socket, sys
    from kvprefetch.testbed.netns import join
    join(sys.argv[1])
    with socket.create_connection((sys.argv[2], 7007), timeout=5) as c:
        n = 0
        while chunk := c.recv(1 << 20):
            n += len(chunk)
    print(n)
""")


def test_a_process_joins_a_namespace_itself_as_a_forked_engine_does():
    with Fabric() as fab:
        pool, node = fab.ns("pool"), fab.ns("node-b")
        link = fab.link(pool, node)
        server = subprocess.Popen(fab.exec_argv(pool, [sys.executable, "-c", SERVER, link.a.ip, "1000"]),
                                  stdout=subprocess.PIPE, text=True)  # fmt: skip
        try:
            assert server.stdout.readline().strip() == "ready"
            got = subprocess.run([sys.executable, "-c", JOINER, node, link.a.ip], capture_output=True, text=True,
                                 timeout=60)  # fmt: skip
            assert got.stdout.strip() == "1000", got.stderr
            outside = subprocess.run([sys.executable, "-c", CLIENT, link.a.ip, "1"], capture_output=True, text=True,
                                     timeout=60)  # fmt: skip
            assert outside.returncode != 0, "outside the namespaces the link does not exist"
        finally:
            server.kill()
            server.wait()


def test_a_redis_in_the_pool_namespace_is_reached_by_a_node_over_its_link_only(tmp_path):
    import redis

    from kvprefetch.testbed.local_servers import RedisServer

    with Fabric() as fab:
        pool, node = fab.ns("pool"), fab.ns("node-a")
        link = fab.link(pool, node, rate_bps=200_000_000)
        server = RedisServer(tmp_path, netns=pool)
        try:
            ping = "import redis, sys; print(redis.Redis.from_url(sys.argv[1], socket_timeout=5).ping())"
            got = subprocess.run(fab.exec_argv(node, [sys.executable, "-c", ping, server.url_at(link.a.ip)]),
                                 capture_output=True, text=True, timeout=60)  # fmt: skip
            assert got.stdout.strip() == "True", got.stderr
            with pytest.raises(redis.exceptions.ConnectionError):
                redis.Redis.from_url(server.url, socket_connect_timeout=1).ping()  # not on this machine's loopback
        finally:
            server.kill()


def test_a_node_s_front_port_is_reached_from_the_machine_and_goes_with_its_namespace():
    """`link_host`: a client (or a router) on the machine reaches a server in a node's namespace at the link's node
    end; the other nodes' links stay inside their namespaces; closing the fabric removes the host's end too."""
    with Fabric() as fab:
        pool, node = fab.ns("pool"), fab.ns("node-a")
        storage = fab.link(pool, node)
        front = fab.link_host(node)
        server = subprocess.Popen(fab.exec_argv(node, [sys.executable, "-c", SERVER, "0.0.0.0", "1000"]),
                                  stdout=subprocess.PIPE, text=True)  # fmt: skip
        try:
            assert server.stdout.readline().strip() == "ready"
            got = subprocess.run([sys.executable, "-c", CLIENT, front.b.ip, "5"], capture_output=True, text=True,
                                 timeout=60)  # fmt: skip
            assert got.stdout.split()[0] == "1000", got.stderr
            assert _fetch(fab, pool, storage.b.ip)[0] == 1000  # the pool reaches it over the storage link
            assert front.a.dev in subprocess.run(["ip", "-o", "link"], capture_output=True, text=True).stdout
        finally:
            server.kill()
            server.wait()
    assert front.a.dev not in subprocess.run(["ip", "-o", "link"], capture_output=True, text=True).stdout


HEALTH = textwrap.dedent("""
    import http.server, sys
    host, port = sys.argv[sys.argv.index("--host") + 1], int(sys.argv[sys.argv.index("--port") + 1])

    class H(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            self.send_response(200 if self.path == "/health" else 404)
            self.end_headers()

    http.server.HTTPServer((host, port), H).serve_forever()
""")


def test_a_server_in_a_node_namespace_is_waited_for_and_stopped_at_its_front_address(tmp_path):
    """`OpenAIServer(netns=..., reach=...)` (what `kvprefetch serve` on a node runs as): started in the node's
    namespace, ready once its /health answers at the node's front address, stopped by SIGTERM to its own pid."""
    from kvprefetch.testbed.server import OpenAIServer, free_port

    with Fabric() as fab:
        node = fab.ns("node-a")
        front = fab.link_host(node)
        server = OpenAIServer([sys.executable, "-c", HEALTH], tmp_path / "server.log", free_port(), netns=node,
                              reach=front.b.ip)  # fmt: skip
        try:
            server.wait_ready(timeout=60)
            assert server.url == f"http://{front.b.ip}:{server.port}"
            inside = subprocess.run(["ip", "netns", "pids", node], capture_output=True, text=True).stdout.split()
            assert str(server.proc.pid) in inside  # `ip netns exec` became the server: signals reach it
        finally:
            server.stop(timeout=30)
        assert server.proc.poll() is not None
