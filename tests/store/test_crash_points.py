"""Kill-point injection: a writer SIGKILLed at every step of put, allocate/commit, write-back, eviction and
recovery loses no acknowledged save, makes no process serve a wrong byte, and leaves nothing stuck or behind.

Each case runs the driver's fixed workload (tests/store/crash_driver.py `script`) in a child armed at one crash
point (kvprefetch.crashpoints), which kills itself there with SIGKILL; the test process then attaches to the
same pool and directory, reads what the dead left, saves every key again, reads each back, and finally a fresh
node recovers the directory (see crash_harness for the invariants). Deterministic: the kill lands on the named
step, and the checks are invariants, not counts.
"""

from __future__ import annotations

import re
import signal
import subprocess
import sys
import uuid
from pathlib import Path

import pytest

from kvprefetch.crashpoints import POINTS
from kvprefetch.tiers.chunk_format import image_bytes

from .crash_driver import CHUNK, SCRIPT_KEYS, key_of
from .crash_harness import (
    REPO,
    Tally,
    check_disk_after_restart,
    child_env,
    remove_pool,
    restart_and_resave,
    run_script_child,
)

# nth arrival: 1 = the first put, into a free slot; 9 = the second put, over an evicted slot;
# 13 = the reads, promoting evicted chunks back from disk into evicted slots
SLOT_STEPS = ["dram.allocate.pinned", "dram.allocate.writing", "dram.allocate.key_published", "dram.commit.ready"]
PUT_STEPS = ["store.put.payload_copied", "store.put.header_written"]
SMALL_DISK = 6 * image_bytes(CHUNK)  # holds half the script's keys: its writes evict
CASES: list[tuple[tuple[str, ...], int]] = [
    *[((f"{step}:{nth}",), 1 << 30) for step in SLOT_STEPS for nth in (1, 9)],
    *[((f"{step}:13",), 1 << 30) for step in ("dram.allocate.writing", "dram.allocate.key_published")],
    *[((f"{step}:{nth}",), 1 << 30) for step in PUT_STEPS for nth in (1, 9)],
    (("store.put.queued:1",), 1 << 30),
    (("store.put.queued:2",), 1 << 30),
    (("store.writeback.written:1",), 1 << 30),
    (("disk.write.temp_written:1",), 1 << 30),
    (("disk.write.temp_synced:1",), 1 << 30),
    (("disk.write.renamed:1",), 1 << 30),
    (("store.promote.read:1",), 1 << 30),
    (("dram.acquire.pinned:1",), 1 << 30),
    (("disk.recover.temp_removed:1",), 1 << 30),
    # a dead writer leaves a WRITING slot; the next process dies while reaping it
    (("dram.allocate.key_published:9", "dram.reap.rows_cleared:1"), 1 << 30),
    (("disk.evict.unindexed:1",), SMALL_DISK),
]
REMOTE_ONLY = {"store.remote_write.sending", "store.remote_write.acked"}  # tests/remote/test_remote_crash.py
DEAD_WRITERS_TEMP = ".{}.999999999.1.tmp"  # pid above pid_max: its writer is certainly dead


def _case_id(case: tuple[tuple[str, ...], int]) -> str:
    return "+".join(case[0])


@pytest.mark.parametrize("case", CASES, ids=_case_id)
def test_a_kill_at_this_step_loses_no_ack_serves_no_wrong_byte_and_leaves_nothing_stuck(tmp_path, case):
    arms, disk_capacity = case
    disk, pool = tmp_path / "disk", f"kill-{uuid.uuid4().hex[:10]}"
    (disk / "ab").mkdir(parents=True)
    (disk / "ab" / DEAD_WRITERS_TEMP.format("ab" * 32)).write_bytes(b"torn")  # recovery's work at every start
    keys = [key_of(i) for i in range(SCRIPT_KEYS)]
    tally = Tally()
    try:
        for arm in arms:
            code, out = run_script_child(disk, pool, arm, disk_capacity)
            tally.absorb(out)
            assert code == -signal.SIGKILL, f"the child never reached {arm} (exit {code}): the case tests nothing"
        restart_and_resave(disk, pool, keys, tally, disk_capacity)
    finally:
        remove_pool(pool)
    tier = check_disk_after_restart(disk, tally, expect_all_acked=disk_capacity >= len(keys) * image_bytes(CHUNK))
    assert not tally.wrong, f"wrong bytes served for {len(tally.wrong)} chunks"
    assert not tally.lost, f"{len(tally.lost)} acknowledged chunks lost"
    assert tally.stuck == 0, f"{tally.stuck} slots stuck WRITING after the dead were reaped"
    assert tally.wait_timeouts == 0, "a read waited out join_timeout_s on a dead writer"
    assert not tally.temp_left, f"temp files left: {tally.temp_left}"
    # the tier evicts to fit before each write; the driver's 2 I/O threads may each be admitted at once
    assert tier.used_bytes <= disk_capacity + 2 * image_bytes(CHUNK)


def test_every_crash_point_is_in_the_code_and_injected_by_a_test():
    src = Path(__file__).resolve().parents[2] / "src" / "kvprefetch"
    called = {m for p in src.rglob("*.py") for m in re.findall(r'crash_point\("([^"]+)"\)', p.read_text())}
    assert called == set(POINTS), "POINTS and the crash_point() calls in the code must name the same steps"
    injected = {arm.split(":")[0] for arms, _ in CASES for arm in arms}
    assert injected | REMOTE_ONLY == set(POINTS)


def test_an_unknown_crash_point_is_a_clear_error():
    from kvprefetch.crashpoints import _parse

    with pytest.raises(ValueError, match=r"no crash point 'dram\.alocate'"):
        _parse("dram.alocate:2")
    assert _parse("disk.write.renamed") == ("disk.write.renamed", 1)


def test_a_short_soak_of_random_kills_keeps_every_invariant():
    """CI's cut of `make soak` (1,000 kills there): the same rounds, fixed seed; invariants only, no counts."""
    args = ["--kills", "24", "--procs", "4", "--seed", "7", "--restart-every", "3", "--corrupt-every", "2"]
    proc = subprocess.run([sys.executable, "-m", "tests.store.soak", *args], cwd=REPO, env=child_env(),
                          capture_output=True, text=True, timeout=600)  # fmt: skip
    summary = next((line for line in proc.stdout.splitlines() if line.startswith("soak:")), proc.stdout)
    assert proc.returncode == 0, f"{summary}\n{proc.stderr[-3000:]}"
    assert " lost=0 wrong=0 stuck=0 " in summary and " errors=0 " in summary
