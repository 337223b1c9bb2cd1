"""CPU a node spends per MiB it receives from and sends to a Mooncake Store pool across a shaped veth link.

The two-node cluster with a Mooncake pool (`kvprefetch.testbed.cluster.TwoNodeCluster(backend="mooncake")`: the
master and the process holding the pool's memory in the pool's namespace, node-a's link shaped to --rate-mbs); in a
process of node-a's namespace, kvprefetch's Mooncake backend (a client lending no memory) reads values into and
writes them from registered memory, one value per slot, 1 and 8 values per call, and the socket floor (a plain
`recv_into` / `sendall` loop against a peer in the pool's namespace) over the same link. Besides the process's
CPU per MiB it gives the part spent by the thread that made the calls (`caller`): Mooncake's wheel is built
without USE_EVENT_DRIVEN_COMPLETION, so that thread polls the transfer's status in a loop until it completes
(`TransferEngineOperationState::wait_for_completion`) and spends the transfer's whole wall time; the rest
(`engine`) is the transfer engine's own threads, which move the bytes. Root only.

    sudo PYTHONPATH=src .venv/bin/python benchmarks/mooncake_link_cpu.py --rate-mbs 482
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

MiB = 1 << 20


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rate-mbs", type=float, default=482.0, help="node-a's link rate, MB/s (0: unshaped)")
    ap.add_argument("--sizes", default="1,4,16", help="value sizes, MiB")
    ap.add_argument("--mib", type=int, default=64, help="MiB each path moves per size and round")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--json", type=Path)
    ap.add_argument("--inside", nargs=3, metavar=("SECTION", "POOL_NS", "POOL_IP"), help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.inside:
        return _inside(args, *args.inside)
    from kvprefetch.testbed.cluster import TwoNodeCluster

    rate = int(args.rate_mbs * 8e6) if args.rate_mbs else None
    segment = 2 * args.mib * MiB + (256 << 20)
    with tempfile.TemporaryDirectory(prefix="kvprefetch-mclinkcpu-") as tmp, \
            TwoNodeCluster(Path(tmp), rate, backend="mooncake", segment_bytes=segment) as c:  # fmt: skip
        section = json.dumps(c.remote_section(0, "cpu:", 1.0, 30.0))
        inside = [sys.executable, __file__, *sys.argv[1:], "--inside", section, c.pool_ns, c.reach[0].pool_ip]
        run = subprocess.run(c.fabric.exec_argv(c.node_ns(0), inside), stdout=subprocess.PIPE, text=True, check=True)
    rows = json.loads(run.stdout)
    print(f"node-a -> Mooncake pool over a veth link shaped to {args.rate_mbs:g} MB/s" if rate else "unshaped link")
    print(f"medians of {args.repeats} rounds of {args.mib} MiB; CPU ms per MiB (process = caller + engine threads)")
    print("| path | direction | value | process | caller | engine | MB/s |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['path']} | {r['direction']} | {r['value_mib']} MiB | {r['cpu_ms_per_mib']:.2f} | "
              f"{r['caller_ms_per_mib']:.2f} | {r['engine_ms_per_mib']:.2f} | {r['mbps']:,.0f} |")  # fmt: skip
    if args.json:
        args.json.write_text(json.dumps(rows, indent=2) + "\n")


def _timed(fn) -> tuple[float, float, float]:
    """(process CPU s, this thread's CPU s, wall s) of fn()."""
    p, t, w = time.process_time(), time.thread_time(), time.perf_counter()
    fn()
    return time.process_time() - p, time.thread_time() - t, time.perf_counter() - w


def _inside(args, section: str, pool_ns: str, pool_ip: str) -> None:
    """In node-a's namespace: each path's rows as JSON on stdout."""
    from kvprefetch.bench.micro.remote_cpu import FloorPeer
    from kvprefetch.config import RemoteConfig
    from kvprefetch.testbed.netns import Fabric
    from kvprefetch.tiers.disk import aligned_buffer
    from kvprefetch.tiers.remote import open_backend

    sizes = [int(s) for s in args.sizes.split(",")]
    backend = open_backend(RemoteConfig(**json.loads(section)))
    region = aligned_buffer(args.mib * MiB)
    backend.register_memory(region)
    peer = FloorPeer(max(sizes) * MiB, wrap=Fabric.exec_argv(pool_ns, []), bind="0.0.0.0", host=pool_ip)
    try:
        rows = [row for size in sizes for row in _size_rows(backend, peer, region, size, args)]
    finally:
        peer.close()
    print(json.dumps(rows))
    sys.stdout.flush()
    os._exit(0)  # the backend's close waits on its threads; the cluster removes everything


def _size_rows(backend, peer, region: memoryview, size: int, args) -> list[dict]:
    """Every path moving `args.mib` MiB in values of `size` MiB, each way."""
    n = args.mib // size
    views = [region[i * size * MiB : (i + 1) * size * MiB] for i in range(n)]
    names = [f"v{size}-{i}" for i in range(n)]
    batches = {per: [(names[i : i + per], views[i : i + per]) for i in range(0, n, per)] for per in (1, 8)}
    paths = {
        ("socket floor", "recv"): lambda: [peer.recv_value(v) for v in views],
        ("socket floor", "send"): lambda: [peer.send_value(v) for v in views],
    }
    for per, b in batches.items():
        paths[(f"mooncake x{per}", "send")] = lambda b=b: [backend.write_from(k, v) for k, v in b]
        paths[(f"mooncake x{per}", "recv")] = lambda b=b: [_check(backend.read_into(k, v), size) for k, v in b]
    for k, v in batches[8]:
        backend.write_from(k, v)
    rows = []
    for (path, direction), fn in paths.items():
        got = [_timed(fn) for _ in range(args.repeats)]
        cpu, caller, wall = (statistics.median(x[i] for x in got) for i in range(3))
        print(f"{path} {direction} {size} MiB: {cpu * 1e3 / args.mib:.2f} ms/MiB", file=sys.stderr)
        rows.append({"path": path, "direction": direction, "value_mib": size, "mib": args.mib,
                     "cpu_ms_per_mib": cpu * 1e3 / args.mib, "caller_ms_per_mib": caller * 1e3 / args.mib,
                     "engine_ms_per_mib": (cpu - caller) * 1e3 / args.mib,
                     "mbps": args.mib * MiB / wall / 1e6})  # fmt: skip
    backend.delete(names)
    return rows


def _check(got: list[int], size: int) -> None:
    if min(got) != size * MiB:
        raise RuntimeError(f"a read came back short: {got}")


if __name__ == "__main__":
    main()
