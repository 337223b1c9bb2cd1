"""Shared vLLM engines (one per configuration, each in its own process) for the connector tests."""

from __future__ import annotations

import random
import shutil
import uuid
from pathlib import Path

import pytest
from vllm_harness import Engine

from kvprefetch.vllm import transfer_config

CHUNK = 256  # tokens; the CPU backend's block size is 128, so a chunk is two blocks
CHUNK_MIB = 1  # 4 layers x 2 KV heads x 64 dims x (K, V) x float32 x 256 tokens = 1 MiB
DRAM_CHUNKS = 16
TP2_CHUNK_BYTES = 512 << 10  # with TP=2 each rank holds one KV head: half a chunk per rank
TP2_DRAM_SLOTS = 32  # rank-chunks (one rank's part of one chunk per slot)
# LoRA adapters (up to 4 loaded at once, as many kept in memory) and prompt embeddings
IDENTITY_ENGINE_ARGS = {"enable_lora": True, "max_lora_rank": 8, "max_loras": 4, "max_cpu_loras": 4,
                        "enable_prompt_embeds": True}  # fmt: skip
VLM_ENGINE_ARGS = {"skip_tokenizer_init": False, "limit_mm_per_prompt": {"image": 1}}


def prompt(seed: int, n: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(1, 2000) for _ in range(n)]


@pytest.fixture(scope="session")
def model_dir(tmp_path_factory) -> str:
    from tiny_llama import make_model

    d = tmp_path_factory.mktemp("model")
    make_model(str(d))
    return str(d)


@pytest.fixture(scope="session")
def logs(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("logs")


@pytest.fixture(scope="session")
def disk_dir(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("kvdisk")


@pytest.fixture(scope="session")
def pools():
    names: list[str] = []
    yield names
    for n in names:  # the shared-memory pools outlive their processes by design; remove the test's ones
        for f in Path("/dev/shm").glob(f"*{n}*"):
            f.unlink(missing_ok=True)


def extra_config(disk_dir: Path, pools: list[str], dram: dict | None = None, **kw) -> dict:
    pool = "kvpt-" + uuid.uuid4().hex[:10]
    pools.append(pool)
    cfg = {
        "chunk_tokens": CHUNK,
        "dram": {"capacity_bytes": int(DRAM_CHUNKS * (CHUNK_MIB << 20) * 1.02), "pool_name": pool} | (dram or {}),
        "disk": {"path": str(disk_dir), "capacity_bytes": 1 << 30},
        "io": {"read_rate_limit_bps": 200_000_000},
        "log_interval_s": 0,
        # The tiny test model recomputes a chunk in ~15 ms, only ~2x a 200 MB/s disk read: on a busy machine
        # the load-or-recompute rule could go either way, and these tests are about what a load produces.
        # A lenient margin keeps the rule on but the decisions stable (the rule has its own tests).
        "load_margin": 0.2,
        # These tests save what they run once, to DRAM and disk, and load it the next time: every request is saved
        # (save_policy seen, the default, saves a prompt from its second sighting on: test_vllm_save_policy.py).
        "save_policy": "all",
    }
    cfg.update(kw)
    return cfg


class Engines:
    """Engines by name, started on first use; close() lets a test end one before starting another."""

    def __init__(self, model_dir: str, logs: Path, disk_dir: Path, pools: list[str]):
        self.model_dir, self.logs, self.disk_dir, self.pools = model_dir, logs, disk_dir, pools
        self.live: dict[str, Engine] = {}

    def spec(self, name: str) -> dict:
        base = {"model": self.model_dir, "max_num_seqs": 1}
        if name == "reference":
            return base
        if name == "prefetch_on":
            return base | {"kv_transfer_config": transfer_config(extra_config(self.disk_dir, self.pools))}
        if name == "restarted_prefetch_off":
            extra = extra_config(self.disk_dir, self.pools, prefetch=False)
            return base | {"kv_transfer_config": transfer_config(extra)}
        if name.startswith("tp2"):
            # Tensor parallelism 2 (one core per rank); the same disk tier as the TP=1 engines above.
            # (with LoRA: the adapter case at TP=2, `test_vllm_tp2.py`)
            tp2 = base | {"engine_args": {"tensor_parallel_size": 2, "enable_lora": True, "max_lora_rank": 8}}
            if name == "tp2_reference":
                return tp2
            dram = {"capacity_bytes": int(TP2_DRAM_SLOTS * (TP2_CHUNK_BYTES + 4096) * 1.01)}
            if name == "tp2":
                extra = extra_config(self.disk_dir, self.pools, dram=dram)
                return tp2 | {"kv_transfer_config": transfer_config(extra)}
            if name == "tp2_restarted_prefetch_off":
                extra = extra_config(self.disk_dir, self.pools, dram=dram, prefetch=False)
                return tp2 | {"kv_transfer_config": transfer_config(extra)}
        if name.startswith("id_"):
            # The identity tests (`test_vllm_identity.py`): adapters and prompt embeddings, a disk tier of their own.
            ident = base | {"engine_args": IDENTITY_ENGINE_ARGS}
            if name == "id_reference":
                return ident
            extra = extra_config(self.disk_dir / "identity", self.pools)
            return ident | {"kv_transfer_config": transfer_config(extra)}  # id_tiers, id_tiers_restarted
        if name.startswith("vlm_"):
            # A tiny vision-language model (`tiny_vlm`): images behind placeholder tokens.
            vlm = base | {"model": self.vlm_dir(), "engine_args": VLM_ENGINE_ARGS}
            if name == "vlm_reference":
                return vlm
            return vlm | {"kv_transfer_config": transfer_config(extra_config(self.disk_dir / "vlm", self.pools))}
        if name.startswith("hybrid"):
            # The packaged sliding-window hybrid (`tiny_hybrid`, 4 KV cache groups: 3 sliding-window layers with a
            # 96-token window, 1 full-attention layer), vLLM's hybrid KV cache manager on; a disk tier of its own.
            # With the connector, vLLM's own prefix cache is on (as `serve` and the bench run it; the tests empty it
            # where a hit must come from the connector); the reference computes every prompt.
            hybrid = base | {"model": self.packaged_dir("kvprefetch-tiny-hybrid")}
            if name == "hybrid_reference":
                return hybrid
            extra = extra_config(self.disk_dir / "hybrid", self.pools)
            return hybrid | {"enable_prefix_caching": True, "kv_transfer_config": transfer_config(extra)}
        if name.startswith("mla"):
            # The packaged MLA model (DeepSeek V2's latent KV, `tiny_hybrid`) at tensor parallelism 2 (one core per
            # rank): every rank holds the same latent KV, stored once. A disk tier of its own.
            mla = base | {"model": self.packaged_dir("kvprefetch-tiny-mla"), "engine_args": {"tensor_parallel_size": 2}}
            return mla | {"kv_transfer_config": transfer_config(extra_config(self.disk_dir / "mla", self.pools))}
        if name == "sync_slow_disk":
            # ondemand-sync (prefetch off, the step waits for loads) over a disk throttled to 4 MB/s (a 1 MiB chunk
            # takes 250 ms to read; the tiny model recomputes it in ~50 ms). The connector starts out believing
            # the disk is fast (prior 1 GB/s): only a measured read can teach it otherwise.
            extra = extra_config(
                self.disk_dir / "slow", self.pools, prefetch=False, load_mode="sync", disk_bps_prior=1e9,
                io={"read_rate_limit_bps": 4_000_000}, load_margin=1.0,
            )
            return base | {"kv_transfer_config": transfer_config(extra)}
        if name == "auto_slow_disk":
            # prefetch with load_mode auto over a disk throttled to 1.5 MB/s: a 4-chunk prefetch takes ~2.8 s, so
            # the scheduler reaches its request (at once: the engine is idle) while every read is in flight.
            # load_policy always: this engine tests where the reads finish, not whether loading pays.
            extra = extra_config(
                self.disk_dir / "auto", self.pools, load_mode="auto", load_policy="always",
                io={"read_rate_limit_bps": 1_500_000},
            )
            return base | {"kv_transfer_config": transfer_config(extra)}
        raise KeyError(name)

    def vlm_dir(self) -> str:
        """The tiny vision-language model, saved once (beside the tests' Llama)."""
        from tests.tiny_vlm import make_vlm

        path = Path(self.model_dir).parent / "vlm"
        if not (path / "config.json").exists():
            make_vlm(str(path))
        return str(path)

    def packaged_dir(self, name: str) -> str:
        """A random checkpoint of a packaged tiny model (`tiny_hybrid`), saved once (beside the tests' Llama)."""
        from tiny_hybrid import make_packaged

        path = Path(self.model_dir).parent / name
        if not (path / "config.json").exists():
            make_packaged(name, str(path))
        return str(path)

    def get(self, name: str) -> Engine:
        if name not in self.live:
            self.live[name] = Engine(self.spec(name), self.logs / f"{name}.log")
        return self.live[name]

    def close(self, name: str) -> None:
        e = self.live.pop(name, None)
        if e is not None:
            e.close()

    def close_all(self) -> None:
        for name in list(self.live):
            self.close(name)


@pytest.fixture(scope="session")
def engines(model_dir, logs, disk_dir, pools):
    e = Engines(model_dir, logs, disk_dir, pools)
    yield e
    e.close_all()


def corrupt_disk_tier(disk_dir: Path) -> int:
    """Flip a byte in the middle of every chunk file (the store's checksums must catch every one)."""
    n = 0
    for f in disk_dir.rglob("*"):
        if f.is_file() and f.stat().st_size > 8192:
            with open(f, "r+b") as fh:
                fh.seek(f.stat().st_size // 2)
                b = fh.read(1)
                fh.seek(-1, 1)
                fh.write(bytes([b[0] ^ 0xFF]))
            n += 1
    return n


def wipe(path: Path) -> None:
    shutil.rmtree(path, ignore_errors=True)
