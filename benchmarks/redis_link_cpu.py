"""CPU a node spends per MiB it receives from and sends to the shared Redis pool across a shaped veth link.

`kvprefetch remotebench` measures this on loopback; the two-node cluster's nodes reach the pool over a veth link
shaped with tbf, where the bytes arrive paced and each wakeup of the reader costs more (issue 63's 1.15-1.19 ms
per MiB was measured there). This script builds that cluster (`kvprefetch.testbed.cluster.TwoNodeCluster`: the
pool's redis-server in its namespace, node-a's link shaped to --rate-mbs), starts the floors' peer in the pool's
namespace and runs remotebench's CPU table in a process of node-a's namespace, over the link: the socket floor,
the framed floor, kvprefetch's Redis backend one and eight values per call, and redis-py. Root only.

    sudo PYTHONPATH=src .venv/bin/python benchmarks/redis_link_cpu.py --rate-mbs 482
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

import redis

from kvprefetch.bench.micro.remote_cpu import CpuRow, FloorPeer, measure
from kvprefetch.bench.micro.remotebench_cli import _cpu_table
from kvprefetch.cli_args import parse_size
from kvprefetch.testbed.cluster import TwoNodeCluster
from kvprefetch.testbed.netns import Fabric
from kvprefetch.tiers.remote.redis_backend import RedisBackend


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rate-mbs", type=float, default=482.0, help="node-a's link rate, MB/s (0: unshaped)")
    ap.add_argument("--sizes", default="1MiB,4MiB,16MiB")
    ap.add_argument("--bytes", default="64MiB", help="bytes each path moves per size and round")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--json", type=Path)
    ap.add_argument("--inside", nargs=3, metavar=("URL", "POOL_NS", "POOL_IP"), help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.inside:
        return _inside(args, *args.inside)
    rate = int(args.rate_mbs * 8e6) if args.rate_mbs else None
    with tempfile.TemporaryDirectory(prefix="kvprefetch-linkcpu-") as tmp, TwoNodeCluster(Path(tmp), rate) as c:
        pool_ip = c.reach[0].pool_ip
        inside = [sys.executable, __file__, *sys.argv[1:], "--inside", c.server.url_at(pool_ip), c.pool_ns, pool_ip]
        run = subprocess.run(c.fabric.exec_argv(c.node_ns(0), inside), stdout=subprocess.PIPE, text=True, check=True)
    rows = [CpuRow(**r) for r in json.loads(run.stdout)]
    print(f"node-a -> pool over a veth link shaped to {args.rate_mbs:g} MB/s" if rate else "unshaped veth link")
    _cpu_table(rows, args.repeats)
    if args.json:
        args.json.write_text(json.dumps([r.to_json() for r in rows], indent=2) + "\n")


def _inside(args, url: str, pool_ns: str, pool_ip: str) -> None:
    """In node-a's namespace: the floors' peer in the pool's, the measurement here, the rows as JSON on stdout."""
    sizes = [parse_size(s) for s in args.sizes.split(",")]
    peer = FloorPeer(max(sizes), wrap=Fabric.exec_argv(pool_ns, []), bind="0.0.0.0", host=pool_ip)
    try:
        servers = {"peer": peer, "redis": RedisBackend(url, False, 30.0, None, None, None, None),
                   "redis-py": redis.Redis.from_url(url)}  # fmt: skip
        rows = measure(servers, sizes, parse_size(args.bytes), args.repeats, lambda s: print(s, file=sys.stderr))
    finally:
        peer.close()
    print(json.dumps([r.to_json() for r in rows]))


if __name__ == "__main__":
    main()
