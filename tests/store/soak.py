"""The crash soak: random SIGKILLs of writers and readers on one DRAM pool and one disk directory, with
corrupted files and a full disk thrown in; prints one summary line and exits non-zero on any violation.

    make soak                                          # 1,000 kills, fixed seed (not in CI)
    python -m tests.store.soak --kills 1000 --seed 20  # the same, by hand

Each round forks `--procs` children from this (single-threaded) process, each a writer or a reader of
tests/store/crash_driver.py's random workload on a small shared keyspace; half of them are armed at a random
crash point (kvprefetch.crashpoints, random nth arrival), and every one still alive is SIGKILLed at a random
moment. Between rounds (all children dead): a process attaches to the pool, reaps the dead, and no slot may be
WRITING; every so often a byte of a random chunk file is flipped (that chunk must read as a miss, never
wrong); and every `--restart-every` rounds the pool is removed and a fresh node recovers the directory:
every acknowledged save must be there, byte-identical (except chunks whose file the soak itself damaged),
with no temp file left. The last tenth of the kills run on a 1 MiB tmpfs (root only), where writers hit
ENOSPC: a save that hit it is never acknowledged. Random with a fixed seed; it asserts invariants, not counts.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import random
import select
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path

from kvprefetch import crashpoints
from kvprefetch.tiers.dram import SHM_DIR, SharedChunkPool

from .crash_driver import random_role
from .crash_harness import Tally, check_disk_after_restart, remove_pool

LOCAL_POINTS = sorted(p for p in crashpoints.POINTS if not p.startswith("store.remote"))


@dataclass
class Child:
    pid: int
    fd: int
    out: bytearray = field(default_factory=bytearray)


@dataclass
class Soak:
    rng: random.Random
    tally: Tally = field(default_factory=Tally)
    corrupted: set[bytes] = field(default_factory=set)
    damaged: int = 0  # chunk files the soak flipped a byte in
    acked_epochs: int = 0  # distinct keys acknowledged, summed over the epochs between fresh-node checks
    kills: int = 0
    armed_kills: int = 0
    full: int = 0
    errors: list[str] = field(default_factory=list)


def fork_child(disk: Path, pool: str, seed: int, role: str, crash_at: str | None) -> Child:
    """A child running the driver's random workload, its fd 1 on a pipe to us. It never returns here."""
    read_end, write_end = os.pipe()
    pid = os.fork()
    if pid == 0:
        code = 70
        try:
            os.close(read_end)
            os.dup2(write_end, 1)
            os.dup2(write_end, 2)  # its log lines and any traceback too, for the error report
            crashpoints.arm(crash_at)
            random_role(str(disk), pool, seed, role)
        finally:
            os._exit(code)
    os.close(write_end)
    return Child(pid, read_end)


def drain(children: list[Child], seconds: float) -> None:
    """Collect what the children print for `seconds` (so no pipe fills up and blocks a child)."""
    deadline = time.monotonic() + seconds
    while (left := deadline - time.monotonic()) > 0:
        open_fds = [c.fd for c in children if c.fd >= 0]
        if not open_fds:
            time.sleep(left)
            return
        ready, _, _ = select.select(open_fds, [], [], left)
        for child in children:
            if child.fd in ready:
                data = os.read(child.fd, 1 << 16)
                if data:
                    child.out += data
                else:
                    os.close(child.fd)
                    child.fd = -1


def finish(child: Child, soak: Soak) -> None:
    """SIGKILL the child (if its crash point did not already), reap it, take in all it printed."""
    with contextlib.suppress(ProcessLookupError):
        os.kill(child.pid, signal.SIGKILL)
    _, status = os.waitpid(child.pid, 0)
    while child.fd >= 0 and (data := os.read(child.fd, 1 << 16)):
        child.out += data
    if child.fd >= 0:
        os.close(child.fd)
        child.fd = -1
    text = child.out.decode(errors="replace")
    if os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGKILL:
        soak.kills += 1
    else:
        soak.errors.append(f"child {child.pid} ended with status {status}: {text[-2000:]}")
    soak.tally.absorb(text)
    soak.full += text.count("FULL\n")


def run_round(soak: Soak, disk: Path, pool: str, procs: int) -> None:
    rng = soak.rng
    children, kill_at = [], []
    for _ in range(procs):
        crash_at = None
        if rng.random() < 0.5:
            crash_at = f"{rng.choice(LOCAL_POINTS)}:{rng.randint(1, 8)}"
        role = "writer" if rng.random() < 0.6 else "reader"
        sys.stdout.flush()
        children.append(fork_child(disk, pool, rng.getrandbits(32), role, crash_at))
        kill_at.append(rng.uniform(0.05, 1.0))
    start = time.monotonic()
    for when, child in sorted(zip(kill_at, children, strict=True), key=lambda pair: pair[0]):
        drain(children, start + when - time.monotonic())
        soak.armed_kills += os.waitid(os.P_PID, child.pid, os.WEXITED | os.WNOHANG | os.WNOWAIT) is not None
        finish(child, soak)


def check_stuck(soak: Soak, pool: str) -> None:
    """With every child dead: a new process attaches, reaps, and finds no slot WRITING."""
    if not (SHM_DIR / f"kvprefetch-{pool}.pool").exists():
        return
    with SharedChunkPool.attach(pool) as attached:
        attached.reap_dead()
        soak.tally.stuck += attached.stats()["slots_writing"]


def corrupt_a_file(soak: Soak, disk: Path) -> None:
    files = sorted(disk.glob("*/*.kv"))
    if not files:
        return
    path = soak.rng.choice(files)
    data = bytearray(path.read_bytes())
    data[soak.rng.randrange(len(data))] ^= 0x5A
    path.write_bytes(data)
    soak.corrupted.add(bytes.fromhex(path.stem))
    soak.damaged += 1


def restart_check(soak: Soak, disk: Path, pool: str) -> None:
    """A fresh node on the directory: every acknowledged save is there and right (damaged ones excepted).
    Then the directory is emptied, so the next epoch's saves are new again (not skipped as on disk)."""
    remove_pool(pool)
    tally = soak.tally
    check_disk_after_restart(disk, tally)
    tally.lost -= soak.corrupted
    if tally.temp_left:
        soak.errors.append(f"temp files left after recovery: {tally.temp_left}")
    soak.acked_epochs += len(tally.acked)
    tally.acked.clear()
    soak.corrupted.clear()
    shutil.rmtree(disk, ignore_errors=True)


def soak_dir(soak: Soak, disk: Path, kills: int, procs: int, restart_every: int, corrupt_every: int) -> None:
    pool = f"soak-{uuid.uuid4().hex[:10]}"
    rounds = 0
    try:
        while soak.kills < kills:
            run_round(soak, disk, pool, procs)
            check_stuck(soak, pool)
            rounds += 1
            if corrupt_every and rounds % corrupt_every == 0:
                corrupt_a_file(soak, disk)
            if rounds % restart_every == 0:
                restart_check(soak, disk, pool)
        restart_check(soak, disk, pool)
    finally:
        remove_pool(pool)


@contextlib.contextmanager
def tiny_tmpfs(parent: Path, size: str = "1m"):
    """A small tmpfs to fill up (None where we may not mount one: not root)."""
    mnt = parent / "full"
    mnt.mkdir()
    if os.geteuid() != 0 or subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(mnt)],
                                           capture_output=True).returncode:  # fmt: skip
        yield None
        return
    try:
        yield mnt
    finally:
        subprocess.run(["umount", "-l", str(mnt)], check=False)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--kills", type=int, default=1000, help="SIGKILLs in all (writers and readers)")
    ap.add_argument("--procs", type=int, default=4, help="children per round")
    ap.add_argument("--seed", type=int, default=20)
    ap.add_argument("--restart-every", type=int, default=25, help="rounds between fresh-node checks")
    ap.add_argument("--corrupt-every", type=int, default=5, help="rounds between flipped bytes (0: never)")
    args = ap.parse_args(argv)
    soak = Soak(random.Random(args.seed))
    started = time.monotonic()
    full_kills = args.kills // 10
    with tempfile.TemporaryDirectory(prefix="kvprefetch-soak-") as tmp:
        soak_dir(soak, Path(tmp) / "disk", args.kills - full_kills, args.procs, args.restart_every,
                 args.corrupt_every)  # fmt: skip
        with tiny_tmpfs(Path(tmp)) as mnt:
            if mnt is not None and full_kills:
                soak_dir(soak, mnt / "disk", soak.kills + full_kills, args.procs, args.restart_every, 0)
            full_note = f"disk_full_saves={soak.full}" if mnt is not None else "disk_full=skipped(not root)"
    t = soak.tally
    print(f"soak: kills={soak.kills} (at crash points {soak.armed_kills}) acked={t.acks} "
          f"(distinct per epoch {soak.acked_epochs}) lost={len(t.lost)} wrong={len(t.wrong)} stuck={t.stuck} "
          f"served={t.served} files_damaged={soak.damaged} {full_note} errors={len(soak.errors)} seed={args.seed} "
          f"seconds={time.monotonic() - started:.0f}")  # fmt: skip
    for error in soak.errors[:5]:
        print(error, file=sys.stderr)
    return int(bool(t.lost or t.wrong or t.stuck or soak.errors))


if __name__ == "__main__":
    sys.exit(main())
