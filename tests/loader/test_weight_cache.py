"""The weight cache: a second load reads only the cache, a changed checkpoint never loads stale bytes, a damaged
cache reads the source again, and every load yields exactly the checkpoint's tensors."""

from __future__ import annotations

import os

import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

from kvprefetch.loader import LoaderSettings
from kvprefetch.loader.vllm_loader import iterate_weights


class Owner:
    last_load = None


def load(path, settings: LoaderSettings) -> tuple[dict[str, np.ndarray], dict]:
    owner = Owner()
    out = {name: t.numpy().copy() for name, t in iterate_weights(path, settings, owner)}
    return out, owner.last_load.as_dict()


def expected(path) -> dict[str, np.ndarray]:
    out: dict[str, np.ndarray] = {}
    for f in sorted(path.glob("*.safetensors")):
        out |= load_file(str(f))
    return out


def assert_same(got: dict, want: dict) -> None:
    assert got.keys() == want.keys()
    for name, arr in want.items():
        assert got[name].dtype == arr.dtype and got[name].shape == arr.shape, name
        assert got[name].tobytes() == arr.tobytes(), name


def test_tensors_are_the_checkpoints_bytes_with_and_without_staging_and_small_blocks(ckpt):
    want = expected(ckpt)
    for settings in (LoaderSettings(staging="auto"), LoaderSettings(block_bytes="64KiB", read_inflight_bytes="128KiB",
                                                      staging="off", lookahead_shards=0, direct_io=False,
                                                      huge_pages=False)):  # fmt: skip
        got, counters = load(ckpt, settings)
        assert_same(got, want)
        assert counters["source_bytes"] == sum(f.stat().st_size for f in ckpt.glob("*.safetensors"))


def test_second_load_reads_only_the_cache(ckpt, cache_settings):
    want = expected(ckpt)
    first, c1 = load(ckpt, cache_settings())
    assert c1["cache_bytes"] == 0 and c1["cache_put_bytes"] > 0
    second, c2 = load(ckpt, cache_settings())  # from the node's DRAM pool
    third, c3 = load(ckpt, cache_settings(restarted=True))  # from the local disk cache
    for c in (c2, c3):
        assert c["source_bytes"] == 0 and c["cache_bytes"] == c1["cache_put_bytes"]
    # from DRAM every block is the pool's pages mapped into the shard buffers, not copied; only the blocks under
    # the tensor the caller still held when the load ended were made private copies
    assert c2["cache_map_bytes"] == c2["cache_bytes"] and 0 < c2["privatized_bytes"] < c2["cache_map_bytes"] / 4
    assert c3["cache_map_bytes"] == 0 and {s for *_, s in c3["blocks"]} == {"cache-disk"}
    # the timeline: every block once, each ending after it started; the waits add up to wait_s
    for c in (c1, c2, c3):
        assert len(c["blocks"]) == c1["cache_put_bytes"] // (256 << 10) and all(s <= e for s, e, _ in c["blocks"])
        assert abs(sum(e - s for s, e in c["waits"]) - c["wait_s"]) < 1e-6
    for got in (first, second, third):
        assert_same(got, want)


def test_tensors_kept_from_a_mapped_load_keep_their_bytes_when_the_pool_reuses_every_slot(ckpt, cache_settings):
    """The pool's pins go back when the load ends: a tensor still held then was made a private copy first, so
    filling the pool with other chunks (every slot evicted and rewritten) does not change it."""
    from kvprefetch.loader.cache import WeightCache
    from kvprefetch.loader.shards import open_checkpoint
    from kvprefetch.tiers.dram import SharedChunkPool

    want = expected(ckpt)
    load(ckpt, cache_settings())  # fills the pool
    settings = cache_settings()
    owner = Owner()
    kept = dict(iterate_weights(ckpt, settings, owner))  # views of the shard buffers, never copied
    c = owner.last_load.as_dict()
    assert c["cache_map_bytes"] > 0 and c["privatized_bytes"] == c["cache_map_bytes"]
    name = settings.cache["dram"]["pool_name"]
    with SharedChunkPool.attach(name, observer=True) as observer:
        assert observer.stats()["slots_pinned"] == 0, "every pin went back"
    cache = WeightCache(settings.store_config(), int(settings.block_bytes))
    try:
        ours = [k for shard in open_checkpoint(ckpt).shards
                for k in cache.block_keys(shard, -(-shard.size // int(settings.block_bytes)))]  # fmt: skip
        assert all(cache.store.in_dram(ours))
        block = np.full(int(settings.block_bytes), 0x5A, np.uint8)
        n = cache.store.dram.geometry.n_slots
        for _ in range(4):  # other chunks until none of the checkpoint's blocks is left in the pool
            assert cache.store.put([os.urandom(32) for _ in range(n)], [block] * n).result() == n
        assert not any(cache.store.in_dram(ours)), "every slot that held the checkpoint was reused"
    finally:
        cache.close()
    assert_same({k: t.numpy() for k, t in kept.items()}, want)


def test_a_load_served_by_the_disk_cache_does_not_allocate_the_nodes_pool(ckpt, tmp_path):
    """The pool (dram.reserve defaults to first_write for weights) takes its RAM only when a block is put into it."""
    from kvprefetch.tiers.dram import SHM_DIR

    from .conftest import drop_pools

    name = f"kvpl-{os.getpid()}-reserve"
    cache = {"disk": {"path": str(tmp_path / "wcache")}, "dram": {"pool_name": name, "capacity_bytes": "32MiB",
                                                                  "keep_idle_s": 600}}  # fmt: skip
    settings = LoaderSettings.from_extra_config({"block_bytes": "256KiB", "cache": cache})
    pool = SHM_DIR / f"kvprefetch-{name}.pool"
    try:
        _, filled = load(ckpt, settings)
        assert filled["cache_put_bytes"] > 0 and pool.stat().st_blocks * 512 >= 32 << 20, "a fill reserves it whole"
        drop_pools(name)  # a reboot: only the disk cache is left
        got, warm = load(ckpt, settings)
        assert warm["cache_bytes"] == filled["cache_put_bytes"] and warm["source_bytes"] == 0
        assert_same(got, expected(ckpt))
        assert pool.exists() and pool.stat().st_blocks * 512 <= 4 << 20, "only its bookkeeping pages are allocated"
    finally:
        drop_pools(name)


def rewrite_shard(path, tensors: dict[str, np.ndarray]) -> None:
    """Rewrite a shard in place with other values, same names and shapes (so the same header bytes)."""
    save_file(tensors, str(path), metadata={"format": "pt"})


def test_changed_checkpoint_never_loads_stale_bytes(ckpt, cache_settings):
    load(ckpt, cache_settings())
    victim = sorted(ckpt.glob("*.safetensors"))[1]
    changed = {n: a + 1 for n, a in load_file(str(victim)).items()}
    rewrite_shard(victim, changed)
    got, counters = load(ckpt, cache_settings(restarted=True))
    assert_same(got, expected(ckpt))
    assert counters["source_bytes"] == victim.stat().st_size  # only the changed shard came from the source


def test_full_identity_catches_a_rewrite_that_kept_size_header_and_mtime(ckpt, cache_settings):
    """The default identity trusts the mtime; a writer that restores it defeats it, the full hash does not."""
    victim = sorted(ckpt.glob("*.safetensors"))[0]
    load(ckpt, cache_settings(identity="full"))
    st = victim.stat()
    rewrite_shard(victim, {n: a * 2 for n, a in load_file(str(victim)).items()})
    os.utime(victim, ns=(st.st_atime_ns, st.st_mtime_ns))
    got, _ = load(ckpt, cache_settings(identity="full", restarted=True))
    assert_same(got, expected(ckpt))


def test_damaged_cache_reads_the_source_again(ckpt, cache_settings, tmp_path):
    load(ckpt, cache_settings())
    files = [f for f in (tmp_path / "wcache").rglob("*.kv")]
    assert files
    for f in files:
        with open(f, "r+b") as fh:
            fh.seek(f.stat().st_size // 2)
            b = fh.read(1)
            fh.seek(-1, 1)
            fh.write(bytes([b[0] ^ 0xFF]))
    got, counters = load(ckpt, cache_settings(restarted=True))
    assert_same(got, expected(ckpt))
    assert counters["source_bytes"] > 0


def test_truncated_or_swapped_cache_files_read_the_source_again(ckpt, cache_settings, tmp_path):
    """The warm path reads a cached block straight into the shard buffer: a file cut short, or one holding another
    block (two files swapped), is a miss there, and the block comes from the source."""
    _, c1 = load(ckpt, cache_settings())
    files = sorted((tmp_path / "wcache").rglob("*.kv"))
    assert len(files) >= 3
    with open(files[0], "r+b") as fh:
        fh.truncate(files[0].stat().st_size - 4096)
    a, b = files[1].read_bytes(), files[2].read_bytes()
    files[1].write_bytes(b)
    files[2].write_bytes(a)
    got, c2 = load(ckpt, cache_settings(restarted=True))
    assert_same(got, expected(ckpt))
    block = 256 << 10  # cache_settings' block_bytes
    assert c2["cache_put_bytes"] == 3 * block and c2["cache_bytes"] == c1["cache_put_bytes"] - 3 * block
    again, c3 = load(ckpt, cache_settings(restarted=True))  # the bad blocks were cached afresh by the second load
    assert_same(again, expected(ckpt))
    assert c3["source_bytes"] == 0


def test_cache_directory_unusable_at_load_time_degrades_to_the_source(ckpt, cache_settings, tmp_path):
    settings = cache_settings()  # valid when configured
    (tmp_path / "wcache").write_text("a file where the cache directory was")
    got, counters = load(ckpt, settings)
    assert_same(got, expected(ckpt))
    assert counters["cache_bytes"] == 0 and counters["source_bytes"] > 0


def test_cache_directory_unusable_when_configured_is_a_clear_error(tmp_path):
    from kvprefetch.config import ConfigError

    (tmp_path / "f").write_text("x")
    with pytest.raises(ConfigError, match="not a directory"):
        LoaderSettings.from_extra_config({"cache": {"disk": {"path": str(tmp_path / "f" / "sub")}}})
