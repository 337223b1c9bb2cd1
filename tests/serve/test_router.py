"""A KV-aware router in front of two `kvprefetch serve` nodes (issue 61): vllm-router's `kv_aware` policy, fed
both nodes' KV events (GPU blocks and kvprefetch's DRAM and disk chunks, with a replay endpoint each), sends a
session's second turn back to the node that served its first, after that node's engine evicted the first turn's
blocks from its GPU KV: what still draws the session back is the tiers' CPU/STORAGE events.

Two nodes on loopback (the tiny model, 24 MiB of engine KV: 6,144 tokens, 48 blocks of 128), each with a DRAM
pool and a disk tier. Eight sessions' first turns (1,024 tokens each, as token ids) go straight to node k mod 2;
then six 1,152-token fillers per node push them out of the engines' GPU KV; then each session's second turn (its
first turn's tokens and 128 more, streamed) goes through the router. Which node served a request: the one whose
`vllm:request_success_total` moved (the requests go one at a time).

The second turns are sent in the order of sessions 0 2 1 3 4 6 5 7 (first nodes 0 0 1 1 ...), so a router blind to
where their prefixes are (`--policy round_robin`, or by hand a `kv_aware` router crediting a DRAM or disk hit
nothing: every `--kv-penalty-*` 0) sends 4 of 8 home whichever node it starts at. Round robin under load, the
bench's HTTP client and the same nodes in network namespaces are the cluster-serve scenario's
(`tests/bench/test_cluster_serve_e2e.py`).
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import signal
import time
import urllib.request
import uuid
from pathlib import Path

import pytest

pytest.importorskip("vllm")

from kvprefetch.testbed.router import (
    KvEventsPorts,
    RouterSpec,
    RouterWorker,
    VllmRouter,
    router_executable,
    serve_node_argv,
)
from kvprefetch.testbed.server import OpenAIServer, free_port, metric_sum, tiny_model_dir, tiny_server_args
from kvprefetch.tiers.dram import SHM_DIR

pytestmark = [pytest.mark.slow, pytest.mark.engine]

SESSIONS = 8
FIRST_TOKENS, SECOND_EXTRA, FILLER_TOKENS, FILLERS_PER_NODE = 1024, 128, 1152, 6
ORDER = (0, 2, 1, 3, 4, 6, 5, 7)  # second turns' order: first nodes 0 0 1 1 0 0 1 1
ENGINE_ARGS = [*tiny_server_args(24 << 20, 2048, 2), "--served-model-name", "tiny", "--enable-prompt-tokens-details"]


def _ids(seed: int, n: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(5, 4000) for _ in range(n)]


def _complete(url: str, prompt: list[int], stream: bool = False) -> str:
    """A completion of token ids (the router routes on KV only for those); streamed: every event read."""
    body = json.dumps({"model": "tiny", "prompt": prompt, "max_tokens": 2, "stream": stream}).encode()
    req = urllib.request.Request(url + "/v1/completions", body, {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=120) as r:
        if not stream:
            return json.loads(r.read())["choices"][0]["text"]
        events = [line[6:] for line in r.read().decode().splitlines() if line.startswith("data: ")]
    assert events and events[-1] == "[DONE]", events
    return "".join(json.loads(e)["choices"][0]["text"] for e in events[:-1])


def _served(node: OpenAIServer) -> float:
    return metric_sum(node.metrics(), "vllm:request_success_total")


def _which_node(nodes: list[OpenAIServer], before: list[float]) -> int:
    """The node whose finished-request counter moved (its /metrics may lag the response by a moment)."""
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        moved = [i for i, n in enumerate(nodes) if _served(n) > before[i]]
        if moved:
            assert len(moved) == 1, moved
            return moved[0]
        time.sleep(0.1)
    raise AssertionError("no node counted the request")


def _first_turns(nodes: list[OpenAIServer], base: int) -> None:
    """Sessions base..base+7's first turns straight to node k mod 2, then the fillers that push them out of each
    engine's GPU KV (kvprefetch's DRAM pool and disk keep them)."""
    for k in range(SESSIONS):
        _complete(nodes[k % 2].url, _ids(base + k, FIRST_TOKENS))
    for i, node in enumerate(nodes):
        for j in range(FILLERS_PER_NODE):
            _complete(node.url, _ids(10_000 + base + 10 * i + j, FILLER_TOKENS))
    time.sleep(1.5)  # the tiers' events of the last saves ride the next engine steps: give them one


def _second_turns(router: VllmRouter, nodes: list[OpenAIServer], base: int) -> list[int]:
    """Each session's second turn through the router, in ORDER; returns the node that served each."""
    landed = []
    for k in ORDER:
        before = [_served(n) for n in nodes]
        assert _complete(router.url, _ids(base + k, FIRST_TOKENS) + _ids(20_000 + base + k, SECOND_EXTRA), True)
        landed.append(_which_node(nodes, before))
    return landed


@pytest.fixture(scope="module")
def nodes(tmp_path_factory):
    """Two `kvprefetch serve` nodes with KV events + replay, started at once; no process, no pool left after."""
    router_executable()  # fails here, naming the install, without the router
    work = tmp_path_factory.mktemp("router")
    model = str(tiny_model_dir(work / "model"))
    live: list[tuple[OpenAIServer, KvEventsPorts, Path]] = []
    try:
        for i in range(2):
            pool, events = f"kvpt-router-{uuid.uuid4().hex[:8]}", KvEventsPorts.free()
            # (save_policy all: every first turn is stored in DRAM and on disk, whose events draw its second turn)
            sets = {"dram.pool_name": pool, "dram.capacity_bytes": "64MiB", "disk.path": str(work / f"disk{i}"),
                    "log_interval_s": 0, "save_policy": "all"}  # fmt: skip
            argv = serve_node_argv(model, events, sets, ENGINE_ARGS)
            server = OpenAIServer(argv, work / f"node{i}.log", free_port(), new_session=True)
            live.append((server, events, SHM_DIR / f"kvprefetch-{pool}.pool"))
        for server, _events, _pool in live:
            server.wait_ready(300)
        yield work, live
    finally:
        for server, _events, _pool in live:
            server.terminate()
        for server, _events, pool in live:
            server.stop(60)
            with contextlib.suppress(ProcessLookupError):  # whatever of its group outlived it
                os.killpg(server.proc.pid, signal.SIGKILL)
            pool.unlink(missing_ok=True)


def _home(landed: list[int]) -> int:
    return sum(node == k % 2 for node, k in zip(landed, ORDER, strict=True))


def test_kv_aware_router_sends_second_turns_back_to_the_node_whose_tiers_hold_the_first(nodes):
    work, live = nodes
    servers = [s for s, _e, _p in live]
    workers = tuple(RouterWorker(s.url, e) for s, e, _p in live)
    t0 = time.monotonic()
    with VllmRouter(RouterSpec(workers, "kv_aware", model="tiny"), work / "router-kv.log") as router:
        router.wait_ready()  # before the first turns: it hears every event from the first on
        _first_turns(servers, 0)
        before = router.metrics()
        kv_landed = _second_turns(router, servers, 0)
        after = router.metrics()

    def moved(name: str, **labels: str) -> float:
        return metric_sum(after, name, **labels) - metric_sum(before, name, **labels)

    lookups = {r: moved("vllm_router_kv_placement_lookups_total", result=r) for r in ("hit", "miss")}
    inputs = moved("vllm_router_kv_routing_inputs_total", result="token_ids")
    print(f"second turns on their first node: kv_aware {_home(kv_landed)}/8 {kv_landed}; placement lookups "
          f"{lookups}, token-id inputs {inputs}; {time.monotonic() - t0:.0f} s")  # fmt: skip
    assert kv_landed == [k % 2 for k in ORDER]
    assert lookups["hit"] >= SESSIONS and inputs >= SESSIONS
