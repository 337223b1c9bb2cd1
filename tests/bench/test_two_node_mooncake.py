"""The two-node cluster with a Mooncake Store pool (issue 63), without engines: mooncake_master and the segment
holder in the pool's namespace, each node a kvprefetch remote tier (a Mooncake client lending no memory) in its
own namespace. Node-a's values reach node-b byte-exact over the two links; a link down reads as a miss within the
tier's timeout; the master SIGKILLed and restarted reads as misses, then hits again."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from kvprefetch.bench.modes import remote_available
from kvprefetch.testbed import netns
from kvprefetch.testbed.cluster import TwoNodeCluster

pytestmark = [
    pytest.mark.skipif(netns.available() is not None, reason=str(netns.available())),
    pytest.mark.skipif(not remote_available("mooncake"), reason="mooncake_master is not installed"),
]

VALUES = 4
PAYLOAD = 1 << 20

NODE = textwrap.dedent("""
    import json, sys, time
    import numpy as np
    from kvprefetch.config import RemoteConfig
    from kvprefetch.tiers.chunk_format import HEADER_BYTES, image_bytes, write_header
    from kvprefetch.tiers.disk import aligned_buffer
    from kvprefetch.tiers.remote import RemoteTier, RemoteUnavailable, open_backend

    cfg = RemoteConfig(**json.loads(sys.argv[1]))
    n, payload = int(sys.argv[2]), int(sys.argv[3])
    tier = RemoteTier(open_backend(cfg), cfg.key_prefix, cfg.retry_after_s)
    size = image_bytes(payload)
    region = aligned_buffer(n * size)
    tier.backend.register_memory(region)
    key = lambda i: bytes([i]) * 32
    data = lambda i: np.random.default_rng(i).integers(0, 256, payload, dtype=np.uint8).tobytes()
    print(json.dumps({"ready": True}), flush=True)
    for line in sys.stdin:
        op, i = line.split()
        i = int(i)
        image = region[i * size : (i + 1) * size]
        t = time.monotonic()
        try:
            if op == "put":
                image[HEADER_BYTES : HEADER_BYTES + payload] = data(i)
                write_header(image, key(i), payload)
                tier.write(key(i), image)
                out = "written"
            else:
                image[:] = bytes(size)
                (got,) = tier.read_many([key(i)], [image])
                exact = not isinstance(got, Exception) and image[HEADER_BYTES : HEADER_BYTES + payload] == data(i)
                out = "exact" if exact else type(got).__name__ if isinstance(got, Exception) else "wrong"
        except RemoteUnavailable:
            out = "unavailable"
        except Exception as err:
            out = f"error {type(err).__name__}: {err}"
        print(json.dumps({"out": out, "s": time.monotonic() - t}), flush=True)
""")


class Node:
    """A process in a node's namespace holding a remote tier on the pool, driven line by line."""

    def __init__(self, c: TwoNodeCluster, node: int, timeout_s: float, log: Path):
        section = c.remote_section(node, "t:", retry_after_s=0.2, timeout_s=timeout_s)
        argv = c.fabric.exec_argv(c.node_ns(node), [sys.executable, "-c", NODE, json.dumps(section), str(VALUES),
                                                    str(PAYLOAD)])  # fmt: skip
        self.proc = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=log.open("wb"),
                                     text=True)  # fmt: skip
        assert json.loads(self.proc.stdout.readline()) == {"ready": True}, log.read_text()[-2000:]

    def do(self, op: str, i: int) -> tuple[str, float]:
        self.proc.stdin.write(f"{op} {i}\n")
        self.proc.stdin.flush()
        reply = json.loads(self.proc.stdout.readline())
        return reply["out"], reply["s"]

    def close(self) -> None:
        self.proc.kill()
        self.proc.wait()


def _rx_bytes(c: TwoNodeCluster, node: int) -> int:
    link = c.reach[node].link.b
    path = f"/sys/class/net/{link.dev}/statistics/rx_bytes"
    return int(subprocess.run(c.fabric.exec_argv(link.ns, ["cat", path]), capture_output=True, text=True).stdout)


def _until_hit(node: Node, writer: Node, i: int, timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if writer.do("put", i)[0] == "written" and node.do("get", i)[0] == "exact":
            return True
        time.sleep(0.3)
    return False


def test_nodes_share_a_mooncake_pool_over_their_links_through_faults(tmp_path):
    timeout_s = 1.0
    with TwoNodeCluster(tmp_path / "pool", rate_bps=400_000_000, backend="mooncake", segment_bytes=64 << 20) as c:
        a, b = (Node(c, e, timeout_s, tmp_path / f"node{e}.log") for e in range(2))
        try:
            for i in range(VALUES):
                assert a.do("put", i)[0] == "written"
            before = _rx_bytes(c, 1)
            assert [b.do("get", i)[0] for i in range(VALUES)] == ["exact"] * VALUES
            assert _rx_bytes(c, 1) - before >= VALUES * PAYLOAD  # the values crossed node-b's link

            c.set_links(False)
            out, seconds = b.do("get", 0)
            assert out in ("ChunkMissing", "unavailable") and seconds < 4 * timeout_s + 1, (out, seconds)
            c.set_links(True)
            assert _until_hit(b, a, 0, 30), "the nodes did not find the pool again after the links came back"

            c.kill_pool()
            out, seconds = b.do("get", 1)
            assert out in ("ChunkMissing", "unavailable") and seconds < 4 * timeout_s + 1, (out, seconds)
            c.restart_pool()
            assert b.do("get", 1)[0] != "exact"  # the restarted master knows nothing the old one held
            assert _until_hit(b, a, 1, 60), "the nodes did not use the restarted master"
        finally:
            a.close()
            b.close()
        assert c.leftovers()
    assert c.leftovers() == []
