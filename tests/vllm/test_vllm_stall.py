"""Issue 59: a cache layer must never stop an engine. Whatever goes wrong with a request's KV, it is answered within
a bounded time, and so is every other request.

The stall the soak met (damaged chunk files, then a full disk, four sessions), built directly on a real engine:

* the engine's KV cache holds one long prompt but not two (18 MiB, as the soak's server: 36 blocks; the prompt
  needs 21). vLLM keeps a request whose async load failed among its in-flight prefills, which reserve the blocks
  they still need, and admits an async load only within the free blocks less those reservations: parking the
  request a second time needs its blocks twice over, which never fit. vLLM skips it every step, and as it heads
  the queue of requests holding KV, nothing behind it runs either.
* the DRAM pool is full of chunks another process pins (in the soak: the write-backs' pins, a second engine on
  the pool): the scheduler's prefetch cannot bring the prompt's chunks up into DRAM, and reads no file.
* the prompt's first chunk file is damaged: the worker, reading it itself once the prefetch has settled, finds it
  corrupt and removes it, and the load fails at its first block: vLLM frees the request's blocks and asks again.
  The scheduler's process never read that file: its disk index still lists the chunk, a hit again.

On 10889fb the engine never answered (the first test's generate timed out after 30 s, the long request asked
about 3,000 times a second, the three others loaded and waiting behind it). The second test holds a load up with
reads that do not return: the connector's watchdog releases it within its bound.
"""

from __future__ import annotations

import time
import uuid
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("vllm")

from vllm_harness import Engine

from conftest import CHUNK, CHUNK_MIB, extra_config, prompt
from kvprefetch.config import StoreConfig
from kvprefetch.store import TieredStore
from kvprefetch.testbed import protocol as P
from kvprefetch.testbed.client import EngineError
from kvprefetch.vllm import scheduler, transfer_config

pytestmark = [pytest.mark.slow, pytest.mark.engine]

KV_BYTES = 18 << 20  # 36 blocks of 128 tokens (4 KiB a token): one long prompt, not two
LONG = 10 * CHUNK + 50  # 21 blocks: its load's blocks and vLLM's reservation for it do not fit together
SHORT = CHUNK + 30  # the other sessions' turns
BOUND_S = 30.0  # the bound on any request outside a restart


class Node:
    """An engine as the soak's server (an 18 MiB KV cache, four sequences, async loads) and a second process on
    its DRAM pool (the test), which can fill the pool with pinned chunks or hold chunks mid-write."""

    def __init__(self, model_dir: str, logs: Path, disk: Path, pools: list[str], **extra):
        self.disk = disk
        cfg = extra_config(disk, pools, load_mode="async", **extra)
        spec = {"model": model_dir, "max_num_seqs": 4, "max_model_len": 4096, "kv_cache_bytes": KV_BYTES,
                "kv_transfer_config": transfer_config(cfg)}  # fmt: skip
        self.engine = Engine(spec, logs / f"stall-{uuid.uuid4().hex[:6]}.log")
        dram = {"pool_name": cfg["dram"]["pool_name"], "capacity_bytes": cfg["dram"]["capacity_bytes"]}
        self.other = TieredStore(StoreConfig.load(tiers=["dram"], dram=dram), chunk_bytes=CHUNK_MIB << 20)
        self.writing: list[int] = []

    def cached_on_disk(self, prompts: list[list[int]]) -> list[P.Completion]:
        """Compute the prompts (their chunks saved to DRAM and disk), then leave them on disk only."""
        out = self.engine.generate(prompts)
        assert self.engine.flush()
        self.engine.call(P.CoolDram())
        return out

    def keys(self, tokens: list[int]) -> list[bytes]:
        return [bytes.fromhex(k) for k in self.engine.call(P.ChunkKeys(tokens=tokens)).keys[0]]

    def pin_every_slot(self) -> None:
        """Fill the DRAM pool with chunks this process pins: the engine's reads into DRAM find no slot."""
        junk = np.zeros(CHUNK_MIB << 20, dtype=np.uint8)
        for i in range(64):
            key = (b"stall-test-junk-%d" % i).ljust(32, b".")
            self.other.put([key], [junk]).result(timeout=10)
            self.other.pin([key])
        assert self.other.dram.unpinned_ticks() == {}, "a DRAM slot is still free for the engine"

    def hold_mid_write(self, keys: list[bytes]) -> None:
        """Start writing the keys into DRAM and never finish: every read of them joins this write and waits."""
        for key in keys:
            slot = self.other.dram.allocate(key, CHUNK_MIB << 20)
            assert slot is not None
            self.writing.append(slot)

    def counters(self) -> dict[str, int]:
        return self.engine.counters().counters

    def generate_within(self, prompts: list[list[int]], bound_s: float) -> tuple[list[P.Completion], float]:
        t0 = time.monotonic()
        try:
            out = self.engine.call(P.Generate(prompts=prompts, max_tokens=8), timeout=bound_s).outputs
        except EngineError as err:
            pytest.fail(f"the engine stopped serving: {err}")
        return out, time.monotonic() - t0

    def close(self, ok: bool) -> None:
        for slot in self.writing:
            self.other.dram.abort(slot)
        self.other.close()
        if ok:
            self.engine.close()
        else:
            self.engine.kill()  # (a stalled engine would not answer its exit)


@pytest.fixture
def node(model_dir, logs, tmp_path, pools):
    made: list[Node] = []
    state = {"ok": False}

    def make(**extra) -> Node:
        made.append(Node(model_dir, logs, tmp_path / "disk", pools, **extra))
        return made[-1]

    yield make, state
    for n in made:
        n.close(state["ok"])


def same(a: list[P.Completion], b: list[P.Completion]) -> None:
    for x, y in zip(a, b, strict=True):
        assert x.token_ids == y.token_ids
        assert max(abs(p - q) for p, q in zip(x.logprobs, y.logprobs, strict=True)) <= 1e-5


def flip(path: Path) -> None:
    with open(path, "r+b") as fh:
        fh.seek(path.stat().st_size // 2)
        b = fh.read(1)
        fh.seek(-1, 1)
        fh.write(bytes([b[0] ^ 0xFF]))


def test_a_request_whose_async_load_failed_computes_its_prompt_and_the_engine_goes_on(node):
    make, state = node
    n = make(load_policy="always")
    long_p, others = prompt(5901, LONG), [prompt(5902 + k, SHORT) for k in range(3)]
    computed = n.cached_on_disk([long_p, *others])
    first = n.keys(long_p)[0].hex()
    n.pin_every_slot()
    flip(n.disk / first[:2] / f"{first}.kv")
    before = n.counters()
    again, _ = n.generate_within([long_p, *others], BOUND_S)
    same(again, computed)
    after = n.counters()
    assert after["load_error_chunks"] > before["load_error_chunks"], "the load did fail: the case is real"
    assert after["reasked_unparked"] - before["reasked_unparked"] == 1, "asked again: not parked again"
    assert after["stalls_released"] == before["stalls_released"], "no watchdog needed: the cause is handled"
    state["ok"] = True


def test_a_load_held_up_by_reads_that_never_return_is_released_within_its_bound(node):
    """The watchdog: the prompt's chunks are mid-write in another process that never finishes, and the engine's
    reads join those writes (for up to a minute: io.join_timeout_s). The parked request is released to compute
    once it has waited its bound, the other sessions' requests are answered beside it."""
    make, state = node
    n = make(load_policy="always", io={"read_rate_limit_bps": 200_000_000, "join_timeout_s": 60.0})
    long_p, others = prompt(5911, LONG), [prompt(5912 + k, SHORT) for k in range(3)]
    computed = n.cached_on_disk([long_p])
    n.hold_mid_write(n.keys(long_p))
    before = n.counters()
    again, took = n.generate_within([long_p, *others], BOUND_S)
    same(again[:1], computed)
    assert took < scheduler.STALL_MAX_S + 10.0, f"{took:.1f} s: released within its bound (and a recompute)"
    after = n.counters()
    assert after["stalls_released"] - before["stalls_released"] == 1
    state["ok"] = True
