"""What the kill-point tests and the soak share: run driver children, restart after them, check the invariants.

The invariants, after any number of processes were SIGKILLed anywhere:
  * lost:   every acknowledged save is on disk, byte-identical, once the node restarts on a fresh pool;
  * wrong:  every chunk any process was served (before or after the kills) has the right bytes;
  * stuck:  once dead processes are reaped, no slot is WRITING, and no read waited out join_timeout_s;
  * temp:   no temp file is left in the disk tier after recovery.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from kvprefetch.crashpoints import ENV
from kvprefetch.store import TieredStore
from kvprefetch.tiers.chunk_format import CorruptChunk
from kvprefetch.tiers.disk import ChunkMissing, DiskTier, aligned_buffer
from kvprefetch.tiers.dram import SHM_DIR

from .crash_driver import CHUNK, config, payload

DRIVER = Path(__file__).with_name("crash_driver.py")
REPO = Path(__file__).resolve().parents[2]
_LINE = re.compile(r"^(ACK|OK|WRONG) ([0-9a-f]{64})$", re.MULTILINE)


@dataclass
class Tally:
    """What the children said and what the checks found (keys, so a report can name them)."""

    acked: set[bytes] = field(default_factory=set)
    acks: int = 0  # ACK lines: saves acknowledged, a key saved again counted again
    wrong: set[bytes] = field(default_factory=set)
    served: int = 0
    lost: set[bytes] = field(default_factory=set)
    stuck: int = 0
    wait_timeouts: int = 0
    temp_left: list[str] = field(default_factory=list)

    def absorb(self, output: str) -> None:
        for kind, hexkey in _LINE.findall(output):
            key = bytes.fromhex(hexkey)
            if kind == "ACK":
                self.acked.add(key)
                self.acks += 1
            else:
                self.served += 1
                if kind == "WRONG":
                    self.wrong.add(key)


def child_env(crash_at: str | None = None) -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(REPO / "src"), env.get("PYTHONPATH", "")])
    env.pop(ENV, None)
    if crash_at:
        env[ENV] = crash_at
    return env


def spawn(args: list[str], crash_at: str | None = None) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, str(DRIVER), *args], stdout=subprocess.PIPE, text=True,
                            env=child_env(crash_at))  # fmt: skip


def run_script_child(disk: Path, pool: str, crash_at: str, disk_capacity: int, timeout: float = 120) -> tuple[int, str]:
    """Run the fixed workload armed at one crash point; (return code, output). -SIGKILL means it was reached."""
    proc = spawn(["script", str(disk), pool, str(disk_capacity)], crash_at)
    out, _ = proc.communicate(timeout=timeout)
    return proc.returncode, out


def kill(proc: subprocess.Popen) -> str:
    """SIGKILL a child (no-op if it died already), reap it, and return all it printed."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGKILL)
    out = proc.stdout.read() if proc.stdout else ""
    proc.wait()
    return out


def read_one(store: TieredStore, key: bytes) -> bool | None:
    """None on a miss, else whether the bytes served were right."""
    out = np.zeros(CHUNK, np.uint8)
    if not store.get_into([key], [out]):
        return None
    return bool((out == payload(key)).all())


def restart_and_resave(disk: Path, pool: str, keys: list[bytes], tally: Tally, disk_capacity: int = 1 << 30) -> None:
    """A new process on the same pool and directory (this one): what the dead left is served right or not at
    all; it saves every key again and must then read each back, right (unless the disk tier is too small to
    hold them all); nothing is stuck afterwards."""
    store = TieredStore(config(str(disk), pool, disk_capacity), chunk_bytes=CHUNK)
    try:
        in_dram = [k for k in keys if store.dram.contains(k)]  # first, before promotions evict what the dead left
        for key in in_dram + [k for k in keys if k not in in_dram]:
            if (ok := read_one(store, key)) is not None:
                tally.served += 1
                if not ok:
                    tally.wrong.add(key)
        store.put(keys, [payload(k) for k in keys]).result(120)
        tally.acked |= set(keys)
        for key in keys:
            ok = read_one(store, key)
            if ok is None:
                if disk_capacity >= len(keys) * store.image_bytes:
                    tally.lost.add(key)
                continue
            tally.served += 1
            if not ok:
                tally.wrong.add(key)
        store.dram.reap_dead()
        tally.stuck += store.dram.stats()["slots_writing"]
        tally.wait_timeouts += store.dram.wait_timeouts
    finally:
        store.close()
        store.dram.path.unlink(missing_ok=True)


def check_disk_after_restart(disk: Path, tally: Tally, expect_all_acked: bool = True) -> DiskTier:
    """A fresh node on the same directory (recovery runs): acknowledged saves are there and every file is right."""
    tier = DiskTier(disk, capacity_bytes=1 << 34)
    tally.temp_left = [str(p) for p in disk.rglob(".*.tmp")]
    valid = read_all_valid(tier)
    tally.wrong |= {key for key, data in valid.items() if len(data) != CHUNK or not (data == payload(key)).all()}
    if expect_all_acked:
        tally.lost |= tally.acked - set(valid)
    return tier


def read_all_valid(tier: DiskTier, chunk_bytes: int = CHUNK) -> dict[bytes, np.ndarray]:
    """Every chunk the tier's index holds that reads back whole and verified (damaged files read as misses)."""
    got = {}
    for key in list(tier._index):
        buf = aligned_buffer(chunk_bytes + 4096)
        try:
            n = tier.read_into(key, buf)
        except (CorruptChunk, ChunkMissing):
            continue
        got[key] = np.frombuffer(buf[4096 : 4096 + n], np.uint8).copy()
    return got


def remove_pool(pool: str) -> None:
    (SHM_DIR / f"kvprefetch-{pool}.pool").unlink(missing_ok=True)
