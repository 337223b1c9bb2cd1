"""DRAM pool lifecycle: a pool outlives its last process only as its keep_idle_s says, an expired one is removed
by the next attach or `kvprefetch status`, and `status --gc/--remove` free idle pools' RAM but not pools in use."""

import json
import os
import signal
import subprocess
import sys
import time
import uuid

import pytest

from kvprefetch.status_cli import inspect_pool
from kvprefetch.tiers.access import PRIVATE
from kvprefetch.tiers.dram import SHM_DIR, PoolNoSpace, SharedChunkPool

from .conftest import mounted_tmpfs

SLOT = 16384


def _pool(name: str, keep_idle_s: float | None, directory=SHM_DIR) -> SharedChunkPool:
    return SharedChunkPool(name, SLOT, 4 * SLOT, keep_idle_s=keep_idle_s, directory=directory)


@pytest.fixture
def name():
    n = f"life-{uuid.uuid4().hex[:10]}"
    yield n
    (SHM_DIR / f"kvprefetch-{n}.pool").unlink(missing_ok=True)


KEY = bytes(range(32))
# A process that opens the pool, stores one chunk, and then detaches and exits, or is SIGKILLed (never detaches).
_CHILD = """
import os, signal, sys
from kvprefetch.tiers.chunk_format import HEADER_BYTES, write_header
from kvprefetch.tiers.dram import SharedChunkPool
name, keep, end = sys.argv[1], sys.argv[2], sys.argv[3]
pool = SharedChunkPool(name, 16384, 4 * 16384, keep_idle_s=None if keep == "none" else float(keep))
slot = pool.allocate(bytes(range(32)), 16384 - HEADER_BYTES)
write_header(pool.image(slot), bytes(range(32)), 16384 - HEADER_BYTES)
pool.commit(slot)
if end == "kill":
    os.kill(os.getpid(), signal.SIGKILL)
pool.close()
"""


def _child(name: str, keep: str, end: str) -> int:
    proc = subprocess.run([sys.executable, "-c", _CHILD, name, keep, end], timeout=120)
    return proc.returncode


@pytest.mark.parametrize("keep", ["0", "3600", "none"])
def test_a_pool_outlives_its_last_process_only_as_its_policy_says(name, keep):
    assert _child(name, keep, "exit") == 0
    path = SHM_DIR / f"kvprefetch-{name}.pool"
    assert path.exists() == (keep != "0"), "keep_idle_s=0 frees the pool when its last process detaches"
    if keep == "0":
        return
    report = inspect_pool(path, PRIVATE, reap=True, remove=False)  # looking keeps it: not expired
    assert report["pids"] == [] and report["processes"] == 0 and "removed" not in report
    assert report["keep_idle_s"] == (None if keep == "none" else 3600.0)
    assert 0 <= time.time() - report["last_used"] < 600
    assert report["held_bytes"] == os.stat(path).st_blocks * 512 >= 4 * SLOT, "the whole pool is reserved"
    with _pool(name, keep_idle_s=0) as again:
        assert not again.created and again.contains(KEY), "a warm restart finds the chunk"


def test_a_pool_in_use_by_another_attachment_stays_when_one_detaches(name):
    first, second = _pool(name, 0), _pool(name, 0)
    first.close()
    assert second.path.exists() and second.stats()["processes"] == 1
    second.close()
    assert not second.path.exists()


def test_an_expired_pool_is_removed_on_the_next_attach(name):
    assert _child(name, "1", "kill") == -signal.SIGKILL
    path = SHM_DIR / f"kvprefetch-{name}.pool"
    assert path.exists(), "a killed process never detaches (and a pool kept idle has no watcher)"
    old = os.stat(path).st_ino
    time.sleep(1.1)  # its only process is dead, for longer than its policy keeps it idle
    with _pool(name, keep_idle_s=0) as fresh:
        assert fresh.created and not fresh.contains(KEY)
        assert os.stat(path).st_ino != old


def _watchers(path) -> list[str]:
    out = subprocess.run(["pgrep", "-af", "pool_watch"], capture_output=True, text=True).stdout
    return [line for line in out.splitlines() if str(path) in line]


def _gone_within(path, seconds: float) -> bool:
    deadline = time.monotonic() + seconds
    while path.exists() and time.monotonic() < deadline:
        time.sleep(0.05)
    return not path.exists()


def test_a_pool_whose_last_process_was_killed_is_removed_by_its_watcher(name):
    path = SHM_DIR / f"kvprefetch-{name}.pool"
    assert _child(name, "0", "kill") == -signal.SIGKILL
    assert _gone_within(path, 10), "keep_idle_s=0: the watcher is the last one out when the last process died"
    time.sleep(1)
    assert not _watchers(path), "and exits"


def test_a_watcher_leaves_a_pool_that_a_live_process_still_uses(name):
    path = SHM_DIR / f"kvprefetch-{name}.pool"
    with _pool(name, keep_idle_s=0) as mine:
        assert len(_watchers(path)) == 1, "one watcher per pool"
        assert _child(name, "0", "kill") == -signal.SIGKILL
        time.sleep(1)  # a few of the watcher's polls
        assert path.exists() and mine.contains(KEY), "this process is attached still"
        assert len(_watchers(path)) == 1
    assert not path.exists(), "the last detach removed it"
    time.sleep(1)
    assert not _watchers(path), "the watcher exits once its pool is gone"


def test_a_pool_is_kept_within_its_idle_time_and_removed_by_status_after_it(name):
    assert _child(name, "3600", "kill") == -signal.SIGKILL
    path = SHM_DIR / f"kvprefetch-{name}.pool"
    with _pool(name, keep_idle_s=1) as warm:  # within its hour: kept, chunk and all (and now declared 1 s)
        assert not warm.created and warm.contains(KEY)
    assert path.exists()
    time.sleep(1.1)  # idle since that detach for longer than keep_idle_s
    report = inspect_pool(path, PRIVATE, reap=True, remove=False)
    assert report["removed"].startswith("expired") and not path.exists()


@pytest.fixture
def private_shm(tmp_path):
    """A tmpfs of our own, so that the RAM a removal frees is measured on it alone (other tests use /dev/shm)."""
    with mounted_tmpfs(tmp_path / "shm", "64m") as mnt:
        yield mnt


def _status(shm, *args: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, KVPREFETCH_SHM_DIR=str(shm), KVPREFETCH_TIERS='["dram"]')
    return subprocess.run([sys.executable, "-m", "kvprefetch.cli", "status", "--json", *args], capture_output=True,
                          text=True, env=env, timeout=120)  # fmt: skip


def _used(mnt) -> int:
    st = os.statvfs(mnt)
    return (st.f_blocks - st.f_bfree) * st.f_frsize


def test_gc_frees_idle_pools_ram_and_refuses_a_pool_in_use(private_shm):
    idle = SharedChunkPool("idle", 1 << 20, 16 << 20, keep_idle_s=None, directory=private_shm)
    idle.close()
    busy = SharedChunkPool("busy", 1 << 20, 8 << 20, keep_idle_s=None, directory=private_shm)
    try:
        held = os.stat(idle.path).st_blocks * 512
        assert held >= 16 << 20
        refused = _status(private_shm, "--remove", "busy")
        assert refused.returncode == 1, refused.stderr
        report = {p["name"]: p for p in json.loads(refused.stdout)["pools"]}
        assert f"in use by process(es) {os.getpid()}" in report["busy"]["refused"]
        assert report["idle"]["held_bytes"] == held and "removed" not in report["idle"]
        before = _used(private_shm)
        gc = _status(private_shm, "--gc")
        report = {p["name"]: p for p in json.loads(gc.stdout)["pools"]}
        assert "removed" in report["idle"] and "refused" in report["busy"]
        assert gc.returncode == 0, "--gc keeps pools in use without failing"
        assert not idle.path.exists() and busy.path.exists()
        assert before - _used(private_shm) >= held, "the idle pool's RAM is free again"
    finally:
        busy.close()


def test_a_pool_larger_than_the_memory_left_is_a_clear_error_at_creation(private_shm):
    with pytest.raises(PoolNoSpace, match=r"needs 0\.1\d GiB but .* has 0\.0\d GiB free: lower dram\.capacity_bytes"):
        SharedChunkPool("big", 1 << 20, 128 << 20, directory=private_shm)
    assert not list(private_shm.iterdir()), "nothing left behind"


def _held(pool: SharedChunkPool) -> int:
    return os.stat(pool.path).st_blocks * 512


def test_a_first_write_pool_takes_its_ram_when_its_first_slot_is_handed_out(private_shm):
    pool = SharedChunkPool("fw", 1 << 20, 32 << 20, directory=private_shm, reserve="first_write")
    try:
        assert _held(pool) <= 2 << 20, "created: only its bookkeeping pages are allocated"
        reader = SharedChunkPool("fw", 1 << 20, 32 << 20, directory=private_shm)
        assert not reader.created and _held(pool) <= 2 << 20, "attaching reserves nothing"
        assert not reader.contains(KEY)
        slot = pool.allocate(KEY, 4096)
        assert slot is not None and _held(pool) >= 32 << 20, "the first slot handed out reserves the whole pool"
        pool.abort(slot)
        reader.close()
    finally:
        pool.close()
    again = SharedChunkPool("fw", 1 << 20, 32 << 20, directory=private_shm, keep_idle_s=None)
    assert again.created, "keep_idle_s=0: the last process removed it"
    again.allocate(KEY, 4096)
    again.close()
    kept = SharedChunkPool("fw", 1 << 20, 32 << 20, directory=private_shm, reserve="first_write")
    assert not kept.created and _held(kept) >= 32 << 20, "reserved at its creation (the default): kept so"
    kept.destroy()


def test_a_first_write_pool_the_node_cannot_hold_reads_as_full_and_frees_what_it_tried(private_shm, caplog):
    pool = SharedChunkPool("big", 1 << 20, 128 << 20, directory=private_shm, reserve="first_write")
    try:
        with caplog.at_level("WARNING"):
            assert pool.allocate(KEY, 4096) is None, "no slot from a pool that could not be reserved: no SIGBUS later"
            assert pool.allocate(bytes(32), 4096) is None
        warned = [r.getMessage() for r in caplog.records if "cannot be reserved" in r.getMessage()]
        assert len(warned) == 1 and "needs 0.1" in warned[0] and "lower dram.capacity_bytes" in warned[0]
        assert _held(pool) <= 2 << 20, "the failed reservation gave back what it had allocated"
        assert pool.stats()["processes"] == 1 and not pool.contains(KEY)
    finally:
        pool.close()
    assert not list(private_shm.iterdir()), "nothing left behind"
