"""The soak's damage fault damages the chunk files the node writes next, as they land: a chunk file is read back a
few seconds after it is written and rarely again, so damaging files already there (a CI run drew 8 of the 32 newest)
often showed nothing."""

from __future__ import annotations

import os
import random
import threading
import time
from pathlib import Path

from kvprefetch.bench.soak_faults import damage


def land(disk: Path, i: int) -> tuple[Path, bytes]:
    """Chunk file i, committed as the disk tier commits one (a temp file renamed into place)."""
    hexkey = (i.to_bytes(4, "little") * 8).hex()
    f = disk / hexkey[:2] / f"{hexkey}.kv"
    f.parent.mkdir(parents=True, exist_ok=True)
    temp = f.parent / f".{hexkey}.{os.getpid()}.tmp"
    temp.write_bytes(bytes([i]) * 4096)
    os.rename(temp, f)
    return f, bytes([i]) * 4096


def intact(f: Path, data: bytes) -> bool:
    return f.exists() and f.read_bytes() == data


def test_damage_hits_the_next_files_written_as_they_land_and_leaves_the_others_whole(tmp_path):
    before = [land(tmp_path, i) for i in range(6)]
    after: list[tuple[Path, bytes]] = []

    def writer() -> None:
        for i in range(6, 11):
            time.sleep(0.3)
            after.append(land(tmp_path, i))

    t = threading.Thread(target=writer)
    t.start()
    done = damage(tmp_path, random.Random(0), n=3, wait_s=20)
    t.join()
    assert [d.split()[1] for d in done] == [f.name[:12] for f, _ in after[:3]], done
    assert {d.split()[0] for d in done} <= {"flip", "truncate", "delete"}
    assert [intact(f, b) for f, b in after] == [False, False, False, True, True]
    assert all(intact(f, b) for f, b in before)


def test_with_nothing_written_it_damages_nothing_and_gives_up_after_its_wait(tmp_path):
    files = [land(tmp_path, i) for i in range(3)]
    t0 = time.monotonic()
    assert damage(tmp_path, random.Random(1), n=8, wait_s=0.5) == []
    assert 0.5 <= time.monotonic() - t0 < 5
    assert all(intact(f, b) for f, b in files)
