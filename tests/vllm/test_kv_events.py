"""KV events for kvprefetch's tiers (issue 42): a router that indexes vLLM's KV events (`--kv-events-config`) sees
what the node's DRAM pool and disk tier hold, in the engine's own block-hash space.

One engine publishes on vLLM's ZMQ publisher; the test subscribes as a router would and keeps an index with vLLM's
own decoder (`KVEventBatch`). Prompts overflow a 4-chunk DRAM tier and an 8-chunk disk tier, so both evict; then
a chunk file is removed behind the engine's back (as `kvprefetch status --gc` or a damaged file's removal does).
After each, the index of each tier must equal what the tier holds (read off the tiers themselves: the pool's
index, the disk's files): no chunk indexed that is gone, none held that is not indexed. The hashes must be the
ones vLLM publishes for the same tokens' GPU blocks.
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
import uuid
from collections import defaultdict
from pathlib import Path

import pytest

pytest.importorskip("vllm")

import msgspec
import zmq
from vllm.distributed.kv_events import BlockRemoved, BlockStored, KVEventBatch
from vllm_harness import Engine

from conftest import CHUNK, CHUNK_MIB, extra_config, prompt
from kvprefetch.testbed import protocol as P
from kvprefetch.testbed.server import free_port
from kvprefetch.tiers.dram import SharedChunkPool
from kvprefetch.vllm import transfer_config

pytestmark = [pytest.mark.slow, pytest.mark.engine]

TOPIC = "kv"
PROMPTS = 6  # of 3 chunks each: 18 chunks through a DRAM tier of 4 and a disk tier of 4 per engine
SETTLE_S = 1.5  # over two of the events' reconcile periods (`events.PERIOD_S`)


def gpu_hashes(gpu_blocks: dict[tuple, int | bytes], tokens: list[int], block_size: int) -> list:
    """The hashes vLLM published for the GPU blocks of these tokens, block by block (`Router.gpu_blocks`)."""
    out, parent = [], None
    for j in range(len(tokens) // block_size):
        parent = gpu_blocks[(parent, tuple(tokens[j * block_size : (j + 1) * block_size]))]
        out.append(parent)
    return out


class Router:
    """A router's view, built from the events alone: the block hashes each (medium, locality) holds, and the
    GPU's blocks by (parent hash, tokens)."""

    def __init__(self, port: int):
        self.sock = zmq.Context.instance().socket(zmq.SUB)
        self.sock.connect(f"tcp://127.0.0.1:{port}")
        self.sock.setsockopt_string(zmq.SUBSCRIBE, TOPIC)
        self.decoder = msgspec.msgpack.Decoder(type=KVEventBatch)
        self.index: dict[tuple[str | None, str | None], set] = defaultdict(set)
        self.gpu_blocks: dict[tuple, int | bytes] = {}
        self.events: list = []

    def drain(self, quiet_s: float = 1.0) -> None:
        while self.sock.poll(int(quiet_s * 1000)):
            _topic, _seq, payload = self.sock.recv_multipart()
            for e in self.decoder.decode(payload).events:
                self.apply(e)

    def apply(self, e) -> None:
        self.events.append(e)
        where = (e.medium, getattr(e, "locality", None))
        if isinstance(e, BlockStored):
            self.index[where].update(e.block_hashes)
            if e.medium == "GPU":
                parent = e.parent_block_hash
                for j, h in enumerate(e.block_hashes):
                    self.gpu_blocks[(parent, tuple(e.token_ids[j * e.block_size : (j + 1) * e.block_size]))] = h
                    parent = h
        elif isinstance(e, BlockRemoved):
            self.index[where].difference_update(e.block_hashes)

    def close(self) -> None:
        self.sock.close(linger=0)


class Node:
    """Engines on one node: one DRAM pool and one disk tier, each engine publishing on its own port and heard
    by a router of its own."""

    def __init__(self, model_dir: str, logs: Path, disk: Path, pools: list[str]):
        self.model_dir, self.logs, self.disk = model_dir, logs, disk
        # (the disk tier's capacity is each process's: two engines' workers keep up to 4 chunks each)
        dram, disk_cfg = int(4 * (CHUNK_MIB << 20) * 1.02), {"path": str(disk), "capacity_bytes": 4 * (CHUNK_MIB << 20)}
        self.extra = extra_config(disk, pools, dram={"capacity_bytes": dram}, disk=disk_cfg)
        self.pool = self.extra["dram"]["pool_name"]
        self.live: list[tuple[Engine, Router]] = []
        self.procs: list[subprocess.Popen] = []

    def start(self, name: str, port: int | None = None) -> tuple[Engine, Router, int]:
        port = port or free_port()
        router = Router(port)  # connected before the engine binds: nothing it publishes is missed
        spec = {"model": self.model_dir, "max_num_seqs": 1, "enable_prefix_caching": True,
                "kv_transfer_config": transfer_config(self.extra),
                "engine_args": {"kv_events_config": {"enable_kv_cache_events": True, "publisher": "zmq",
                                                     "endpoint": f"tcp://*:{port}", "topic": TOPIC}}}  # fmt: skip
        try:
            engine = Engine(spec, self.logs / f"events-{name}-{uuid.uuid4().hex[:6]}.log")
        except BaseException:
            router.close()
            raise
        self.live.append((engine, router))
        return engine, router, port

    def run(self, argv: list[str]) -> subprocess.Popen:
        """A command beside the engines (killed with them if still running)."""
        self.procs.append(subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
        return self.procs[-1]

    def close(self) -> None:
        for proc in self.procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
        for engine, router in self.live:
            engine.close()
            router.close()


@pytest.fixture
def node(model_dir, logs, tmp_path, pools):
    n = Node(model_dir, logs, tmp_path / "disk", pools)
    yield n
    n.close()


def publish(engine: Engine, router: Router) -> None:
    """Let the events' thread see the tiers as they are now, then step the engine once (vLLM publishes with a
    step) and read what it published."""
    time.sleep(SETTLE_S)
    engine.generate([prompt(9_999, 10)], max_tokens=1)  # under a block: no chunk, no GPU block of its own
    router.drain()


def held(pool: str, disk: Path, keys: list[str]) -> dict[str, set[str]]:
    """Which of the keys each tier holds, read off the tiers themselves."""
    with SharedChunkPool.attach(pool) as p:
        in_dram = p.contains_many([bytes.fromhex(k) for k in keys])
    on_disk = {f.stem for f in disk.rglob("*.kv")}
    return {"dram": {k for k, d in zip(keys, in_dram, strict=True) if d}, "disk": {k for k in keys if k in on_disk}}


def test_the_index_a_router_builds_from_each_engines_events_equals_what_the_nodes_tiers_hold(node):
    port_a = free_port()
    # `kvprefetch events`, as a user runs it against engine a until Ctrl-C (it imports vLLM while the engines start)
    cli = node.run([sys.executable, "-m", "kvprefetch.cli", "events", "--url", f"tcp://127.0.0.1:{port_a}",
                    "--topic", TOPIC, "--json"])  # fmt: skip
    a, router_a, _ = node.start("a", port_a)
    b, router_b, _ = node.start("b")
    said = []  # (vLLM's import may print first)
    while not said or "subscribed" not in said[-1]:
        said.append(cli.stderr.readline())
        assert said[-1], f"kvprefetch events ended before it subscribed: {said}"
    time.sleep(0.5)  # (ZMQ's subscription reaches the publisher a moment after connect)
    block = a.call(P.Geometry()).block_size
    prompts = [prompt(700 + i, 3 * CHUNK + 10) for i in range(PROMPTS)]
    for i, p in enumerate(prompts):  # half on each engine
        (a if i % 2 else b).generate([p], max_tokens=1)
    assert a.flush() and b.flush()
    publish(a, router_a)
    publish(b, router_b)

    # every chunk: its key (rank 0's: TP 1), the hashes vLLM published for its GPU blocks (on either engine),
    # the one before, its tokens
    gpu_blocks = router_a.gpu_blocks | router_b.gpu_blocks
    chunk_hashes: dict[str, list] = {}
    chunk_parent: dict[str, int | bytes | None] = {}
    chunk_tokens: dict[str, list[int]] = {}
    per = CHUNK // block
    for p in prompts:
        hashes = gpu_hashes(gpu_blocks, p, block)
        for i, k in enumerate(a.call(P.ChunkKeys(tokens=p)).keys[0]):
            chunk_hashes[k] = hashes[i * per : (i + 1) * per]
            chunk_parent[k] = hashes[i * per - 1] if i else None
            chunk_tokens[k] = p[i * CHUNK : (i + 1) * CHUNK]
    by_hashes = {tuple(h): k for k, h in chunk_hashes.items()}

    def expect(tier_keys: set[str]) -> set:
        return {h for k in tier_keys for h in chunk_hashes[k]}

    def check(router: Router, when: str) -> dict[str, set[str]]:
        now = held(node.pool, node.disk, list(chunk_hashes))
        assert router.index[("CPU", "LOCAL")] == expect(now["dram"]), when
        assert router.index[("STORAGE", "LOCAL")] == expect(now["disk"]), when
        return now

    # each engine announces what the node holds, the other engine's chunks included
    check(router_a, "engine a, after the prompts")
    now = check(router_b, "engine b, after the prompts")
    assert 0 < len(now["dram"]) <= 4 and 0 < len(now["disk"]) < len(chunk_hashes)  # both tiers evicted
    for router in (router_a, router_b):
        removed = {e.medium for e in router.events if isinstance(e, BlockRemoved) and e.medium != "GPU"}
        assert removed == {"CPU", "STORAGE"}, "both tiers evicted, and said so"
    ours = [e for e in router_a.events if isinstance(e, BlockStored) and e.medium != "GPU"]
    assert {(e.medium, e.locality, e.ownership) for e in ours} == {
        ("CPU", "LOCAL", "kvprefetch-dram"), ("STORAGE", "LOCAL", "kvprefetch-disk")}  # fmt: skip
    for e in ours:  # the payload a router that drops bare events (Dynamo) needs: tokens, parent, block size
        k = by_hashes[tuple(e.block_hashes)]  # (a KeyError: hashes that are not vLLM's for these tokens)
        assert e.block_size == block and e.token_ids == chunk_tokens[k] and e.parent_block_hash == chunk_parent[k]

    # a chunk file removed behind the engines' backs: the router hears of it
    gone = sorted(now["disk"])[0]
    next(node.disk.rglob(f"{gone}.kv")).unlink()
    publish(a, router_a)
    after = check(router_a, "after a chunk file was removed")
    assert gone not in after["disk"]
    # and `kvprefetch events`, stopped with Ctrl-C, counted what the router holds
    cli.send_signal(signal.SIGINT)
    out, _ = cli.communicate(timeout=60)
    seen = {(t["medium"], t["locality"], t["ownership"]): t["blocks"] for t in json.loads(out)["tiers"]}
    assert seen[("CPU", "LOCAL", "kvprefetch-dram")] == len(expect(after["dram"]))
    assert seen[("STORAGE", "LOCAL", "kvprefetch-disk")] == len(expect(after["disk"]))
    assert seen[("GPU", "-", "-")] == len(router_a.index[("GPU", None)]) > 0

    # an engine started later (a restart) announces what the node already holds, before any request of its own
    b.close()
    _c, router_c, _ = node.start("c")
    publish(_c, router_c)
    check(router_c, "a new engine, before any prompt")
