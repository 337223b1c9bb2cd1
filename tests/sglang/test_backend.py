"""The SGLang backend's own guarantees: isolation of ranks, models and tenants; clear errors for malformed calls;
damaged files, concurrent writers and a SIGKILLed writer give a miss, never other bytes."""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from kvprefetch.config import ConfigError
from kvprefetch.sglang import BackendSettings
from kvprefetch.sglang.host_pages import PageGeometry
from kvprefetch.sglang.hostpool import host_pool
from tests.sglang.conftest import page_bytes, page_content, tiers_extra
from tests.sglang.writer import page_key

REPO = Path(__file__).resolve().parents[2]


def _read(backend, pool, keys) -> list[bytes | None]:
    got = backend.batch_get(keys, [pool.get_dummy_flat_data_page() for _ in keys])
    return [None if g is None else page_bytes(g) for g in got]


def test_tp_ranks_keep_their_own_pages_and_mla_ranks_share_one(backends, tmp_path, pool_name):
    pool = host_pool()
    n = PageGeometry.of(pool).page_bytes
    rank0, rank1 = backends(pool, tp_rank=0, tp_size=2), backends(pool, tp_rank=1, tp_size=2)
    assert rank0.batch_set(["p"], [page_content("rank0", n)])
    assert rank1.exists("p") is False  # rank 1 holds other heads: rank 0's page is not its page
    assert rank1.batch_set(["p"], [page_content("rank1", n)])
    assert _read(rank0, pool, ["p"]) == [page_bytes(page_content("rank0", n))]
    assert _read(rank1, pool, ["p"]) == [page_bytes(page_content("rank1", n))]
    mla0, mla1 = backends(pool, tp_rank=0, tp_size=2, mla=True), backends(pool, tp_rank=1, tp_size=2, mla=True)
    assert mla0.batch_set(["m"], [page_content("m", n)])
    assert _read(mla1, pool, ["m"]) == [page_bytes(page_content("m", n))]


def test_models_and_tenants_never_read_each_others_pages(backends, tmp_path, pool_name):
    pool = host_pool()
    n = PageGeometry.of(pool).page_bytes
    base = tiers_extra(tmp_path, pool_name)
    a = backends(pool, extra=base | {"tenant": "a"})
    assert a.batch_set(["p"], [page_content("p", n)])
    assert backends(pool, extra=base | {"tenant": "b"}).batch_exists(["p"]) == 0
    assert backends(pool, extra=base | {"tenant": "a"}, model="other/model").batch_exists(["p"]) == 0
    assert backends(pool, extra=base | {"tenant": "a"}).batch_exists(["p"]) == 1


def test_malformed_calls_get_a_clear_answer_and_store_nothing(backends):
    pool = host_pool()
    ours = backends(pool)
    n = PageGeometry.of(pool).page_bytes
    idx = pool.alloc(2 * pool.page_size)
    assert ours.batch_set_v1(["a", "b", "c"], idx) == [False] * 3  # two pages of indices for three keys
    assert ours.batch_get_v1(["a"], idx) == [False]
    assert ours.batch_set(["a"], [page_content("a", n // 2)]) is False  # half a page
    assert ours.batch_set(["a", "b"], [page_content("a", n)]) is False  # a value missing
    assert ours.batch_exists(["a", "b", "c"]) == 0


def test_a_data_call_before_the_host_pool_is_registered_says_so(tmp_path, pool_name):
    from sglang.srt.mem_cache.storage.backend_factory import StorageBackendFactory

    from kvprefetch.sglang.hostpool import storage_config

    backend = StorageBackendFactory.create_backend("dynamic", storage_config(extra=tiers_extra(tmp_path, pool_name)),
                                                   None)  # fmt: skip
    with pytest.raises(RuntimeError, match="register_mem_pool_host"):
        backend.exists("a")


def test_bad_extra_config_values_name_the_key(tmp_path, pool_name):
    with pytest.raises(ConfigError, match="read_rate_limit_bps"):
        BackendSettings.from_extra_config(tiers_extra(tmp_path, pool_name) | {"io": {"read_rate_limit_bps": "fast"}})
    with pytest.raises(ConfigError, match="tenant"):
        BackendSettings.from_extra_config({"tenant": ["a"]})


def test_damaged_and_truncated_files_are_misses_never_other_bytes(backends, tmp_path, pool_name):
    pool = host_pool()
    n = PageGeometry.of(pool).page_bytes
    keys = [page_key(i) for i in range(4)]
    writer = backends(pool)
    assert writer.batch_set(keys, [page_content(k, n) for k in keys])
    assert writer.store.flush(timeout=30)
    paths = [writer.store.disk.path_of(k) for k in writer.chunk_keys(keys)]
    writer.close()  # the last process: the DRAM pool goes with it, the disk tier stays
    with open(paths[1], "r+b") as f:  # one flipped byte in the payload
        f.seek(8192)
        byte = f.read(1)
        f.seek(8192)
        f.write(bytes([byte[0] ^ 0xFF]))
    os.truncate(paths[2], 6000)
    reader = backends(pool)
    assert reader.batch_exists(keys) == 2  # the truncated file is dropped at start; the flipped byte when read
    want = [page_bytes(page_content(k, n)) for k in keys]
    assert _read(reader, pool, keys) == [want[0], None, None, want[3]]
    idx = pool.alloc(4 * pool.page_size)
    assert reader.batch_get_v1(keys, idx) == [True, False, False, True]
    assert [reader.exists(k) for k in keys] == [True, False, False, True]  # damaged files were dropped


def _writer(root: Path, pool: str, start: int, stop: int, *flags: str) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "tests.sglang.writer", str(root), pool, str(start), str(stop), *flags]
    return subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def test_two_processes_writing_the_same_pages_at_once(backends, tmp_path, pool_name):
    """Two servers on one node store overlapping prefixes at the same time (one forwards, one backwards through
    the same 96 pages, and 32 of their own each): a third reads every page, byte for byte."""
    pool = host_pool()
    reader = backends(pool)  # attached first: the DRAM pool lives through both writers
    procs = [_writer(tmp_path, pool_name, 0, 128), _writer(tmp_path, pool_name, 32, 160, "--reverse")]
    for proc in procs:
        out, err = proc.communicate(timeout=120)
        assert proc.returncode == 0 and out.split() == ["started", "done"], err[-2000:]
    keys = [page_key(i) for i in range(160)]
    assert reader.batch_exists(keys) == 160
    n = PageGeometry.of(pool).page_bytes
    assert _read(reader, pool, keys) == [page_bytes(page_content(k, n)) for k in keys]


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_a_sigkilled_writer_leaves_pages_that_are_whole_or_missing(backends, tmp_path, pool_name, seed):
    """SIGKILL a writer at a random moment of its batches (inside a copy into a DRAM slot, a disk write-back, a
    rename): every page a reader then finds is the writer's whole page; the rest are misses. Read from the DRAM
    pool (the reader keeps it alive) and again from disk alone."""
    pool = host_pool()
    reader = backends(pool)
    n = PageGeometry.of(pool).page_bytes
    proc = _writer(tmp_path, pool_name, 0, 4000)
    assert proc.stdout is not None and proc.stdout.readline().strip() == "started"
    time.sleep(random.Random(seed).uniform(0.05, 0.6))
    proc.send_signal(signal.SIGKILL)
    proc.wait(timeout=30)
    keys = [page_key(i) for i in range(4000)]
    want = [page_bytes(page_content(k, n)) for k in keys]
    for got, w in zip(_read(reader, pool, keys), want, strict=True):
        assert got is None or got == w
    found = sum(g is not None for g in _read(reader, pool, keys))
    assert found > 0
    reader.close()
    on_disk = backends(pool, extra=tiers_extra(tmp_path, pool_name + "-after"))
    for got, w in zip(_read(on_disk, pool, keys), want, strict=True):
        assert got is None or got == w


def test_a_page_per_io_thread_may_be_in_flight_unless_the_user_capped_it(backends, tmp_path, pool_name):
    pool = host_pool()  # pages of 32 KiB: the default cap (4 MiB) holds more than 4
    ours = backends(pool)
    assert ours.store.disk.read_gate.limit_bytes == 4 << 20
    big = host_pool(page_size=64, layers=32, heads=8, head_dim=128, tokens=128)  # 8 MiB pages
    ours = backends(big, extra=tiers_extra(tmp_path, pool_name + "-big") | {"io": {"threads": 6}})
    assert ours.store.disk.read_gate.limit_bytes == 6 * ((8 << 20) + 4096)
    capped = tiers_extra(tmp_path, pool_name + "-capped")
    capped["disk"] = capped["disk"] | {"read_inflight_bytes": "2MiB"}
    assert backends(big, extra=capped).store.disk.read_gate.limit_bytes == 2 << 20


def test_a_chunk_tokens_other_than_the_page_size_is_refused_not_ignored(backends, tmp_path, pool_name):
    """With SGLang a chunk is one HiCache page: chunk_tokens equal to the page size (or unset) is fine, another
    value fails the start naming both sizes and the flag, before any tier opens."""
    pool = host_pool(page_size=16)
    assert backends(pool, extra=tiers_extra(tmp_path, pool_name, chunk_tokens=16)).store is not None
    with pytest.raises(ConfigError, match=r"chunk_tokens 256 differs from SGLang's page size 16.*--page-size 256"):
        backends(pool, extra=tiers_extra(tmp_path, pool_name, chunk_tokens=256))
