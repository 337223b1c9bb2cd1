"""Crash safety and corruption: the disk tier never returns damaged or partial data, and loses nothing acked."""

import os
import random
import re
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import numpy as np
import pytest

from kvprefetch.bench.micro.hugepages import reserved_huge_pages
from kvprefetch.tiers.disk import DiskFullError, DiskTier
from kvprefetch.tiers.dram import SHM_DIR

from .conftest import CHUNK_BYTES, chunk_payload, mounted_tmpfs
from .crash_harness import read_all_valid

WRITER = Path(__file__).with_name("crash_writer.py")
_ACK = re.compile(r"^ACK ([0-9a-f]{64})\n", re.MULTILINE)


def test_sigkill_at_random_points_never_serves_torn_data_nor_loses_acked_chunks(tmp_path):
    rng = random.Random(1234)
    acked: set[bytes] = set()
    for round_ in range(12):
        pool = f"crash-{uuid.uuid4().hex[:8]}"
        proc = subprocess.Popen(
            [sys.executable, str(WRITER), str(tmp_path), pool, str(round_)],
            stdout=subprocess.PIPE, text=True,
        )
        # let it import and write for a random while, then kill it mid-flight
        first = proc.stdout.readline()
        time.sleep(rng.uniform(0.0, 0.4))
        proc.send_signal(signal.SIGKILL)
        out = first + proc.stdout.read()
        proc.wait()
        (SHM_DIR / f"kvprefetch-{pool}.pool").unlink(missing_ok=True)
        # a line cut short by the kill was never a whole acknowledgement: only complete lines count
        acked |= {bytes.fromhex(m.group(1)) for m in _ACK.finditer(out)}

        disk = DiskTier(tmp_path, capacity_bytes=1 << 34)
        valid = read_all_valid(disk, CHUNK_BYTES)
        assert acked <= set(valid), f"round {round_}: acknowledged chunks lost"
        for key, data in valid.items():
            assert (data == chunk_payload(key)).all(), f"round {round_}: wrong bytes served"
        assert not list(tmp_path.glob("*/.*.tmp")), "temp files of dead writers must be cleaned up"
    assert len(acked) > 20


@pytest.fixture
def huge_pages_reserved():
    with reserved_huge_pages(32 << 20) as ok:
        yield ok


@pytest.fixture(params=["direct", "staged"])
def disk_with_chunks(request, open_store, keyer):
    """Chunks on disk only, read either straight into DRAM slots or through huge-page staging buffers."""
    if request.param == "staged":
        reserved = request.getfixturevalue("huge_pages_reserved")
        if not reserved:
            pytest.skip("no huge pages here (needs root to reserve them)")
    store = open_store(disk={"staging": "auto" if request.param == "staged" else "off"})
    keys = keyer.keys(range(16 * 4))
    store.put(keys, [chunk_payload(k) for k in keys]).result(30)
    for k in keys:
        store.dram.discard(k)
    return store, keys


def _assert_reads_as_miss_and_is_removed(store, keys, damaged):
    out = [np.zeros(CHUNK_BYTES, np.uint8) for _ in keys]
    loaded = store.get_into(keys, out)
    idx = keys.index(damaged)
    assert loaded == idx, "a damaged chunk must end the hit prefix"
    assert all((out[i] == chunk_payload(keys[i])).all() for i in range(idx))
    assert not store.disk.path_of(damaged).exists(), "damaged file must be removed"
    assert store.lookup(keys).num_hit_chunks == idx
    assert store.stats()["store"]["load_errors"] == 1
    assert store.errors.totals() == {"disk/corrupt": 1}, "counted once, by tier and kind (for /metrics)"
    if store.disk.staging is not None:
        assert store.disk.staging.reads_staged > 0, "the staged read path must have been the one tested"


def test_a_flipped_payload_byte_is_a_miss(disk_with_chunks):
    store, keys = disk_with_chunks
    path = store.disk.path_of(keys[2])
    data = bytearray(path.read_bytes())
    data[4096 + 1234] ^= 0x40
    path.write_bytes(data)
    _assert_reads_as_miss_and_is_removed(store, keys, keys[2])


def test_a_flipped_header_byte_is_a_miss(disk_with_chunks):
    store, keys = disk_with_chunks
    path = store.disk.path_of(keys[1])
    data = bytearray(path.read_bytes())
    data[60] ^= 0x01
    path.write_bytes(data)
    _assert_reads_as_miss_and_is_removed(store, keys, keys[1])


def test_a_truncated_file_is_a_miss(disk_with_chunks):
    store, keys = disk_with_chunks
    path = store.disk.path_of(keys[3])
    os.truncate(path, 4096 + 8192)
    _assert_reads_as_miss_and_is_removed(store, keys, keys[3])


def test_another_keys_file_under_this_name_is_a_miss(disk_with_chunks):
    store, keys = disk_with_chunks
    store.disk.path_of(keys[0]).write_bytes(store.disk.path_of(keys[1]).read_bytes())
    _assert_reads_as_miss_and_is_removed(store, keys, keys[0])


def test_a_foreign_file_under_a_chunk_name_is_a_miss(disk_with_chunks):
    store, keys = disk_with_chunks
    store.disk.path_of(keys[2]).write_bytes(os.urandom(CHUNK_BYTES + 4096))
    _assert_reads_as_miss_and_is_removed(store, keys, keys[2])


def test_recovery_skips_damaged_and_foreign_files(tmp_path, disk_with_chunks):
    store, keys = disk_with_chunks
    root = store.disk.root
    os.truncate(store.disk.path_of(keys[0]), 5000)  # not a whole image
    (root / "ab").mkdir(exist_ok=True)
    (root / "ab" / "notes.txt").write_text("someone else's file")
    (root / "ab" / f".{'0' * 64}.999999999.1.tmp").write_bytes(b"torn")  # a dead writer's temp file
    again = DiskTier(root, capacity_bytes=1 << 30)
    assert len(again) == 3
    assert not store.disk.path_of(keys[0]).exists()
    assert (root / "ab" / "notes.txt").exists(), "files that are not ours are left alone"
    assert again.counters["foreign"] == 1 and again.counters["temp_removed"] == 1


@pytest.fixture
def tiny_fs(tmp_path):
    with mounted_tmpfs(tmp_path / "tiny", "400k") as mnt:
        yield mnt


def test_disk_full_fails_the_writeback_cleanly_and_dram_keeps_serving(open_store, keyer, tiny_fs):
    store = open_store(disk={"path": str(tiny_fs / "cache")})
    keys = keyer.keys(range(16 * 8))
    fut = store.put(keys, [chunk_payload(k) for k in keys])
    with pytest.raises(DiskFullError):
        fut.result(30)
    assert not list(tiny_fs.rglob("*.tmp")), "no partial file left behind"
    out = [np.zeros(CHUNK_BYTES, np.uint8) for _ in keys]
    assert store.get_into(keys, out) == 8
    assert all((o == chunk_payload(k)).all() for o, k in zip(out, keys, strict=True))
    assert store.stats()["store"]["writeback_errors"] >= 1
    assert store.errors.totals()["disk/no_space"] == store.stats()["store"]["writeback_errors"]


def test_a_file_removed_behind_the_stores_back_is_a_miss_counted_as_missing(disk_with_chunks):
    store, keys = disk_with_chunks
    store.disk.path_of(keys[2]).unlink()
    out = [np.zeros(CHUNK_BYTES, np.uint8) for _ in keys]
    assert store.get_into(keys, out) == 2
    assert all((out[i] == chunk_payload(keys[i])).all() for i in range(2))
    assert store.errors.totals() == {"disk/missing": 1}
