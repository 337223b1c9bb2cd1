"""`kvprefetch remotebench` end to end on real local servers (small sizes)."""

import json
import subprocess
import sys


def test_remotebench_reports_ours_next_to_the_raw_client_and_the_floors(tmp_path):
    out = tmp_path / "rb.json"
    cmd = [sys.executable, "-m", "kvprefetch.cli", "remotebench", "--backend", "redis", "--backend", "mooncake",
           "--chunk", "256KiB", "--chunks", "32", "--repeats", "1", "--cpu-sizes", "256KiB,1MiB", "--cpu-bytes",
           "4MiB", "--json", str(out)]  # fmt: skip
    run = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-2000:]
    result = json.loads(out.read_text())
    rows = {r["backend"]: r for r in result["bandwidth"]}
    assert set(rows) == {"redis", "mooncake"}
    for row in rows.values():
        assert row["chunks"] == 32 and row["chunk_bytes"] == 256 * 1024
        assert row["raw_read_gbps"] > 0 and row["prefetch_read_gbps"] > 0 and row["get_into_gbps"] > 0
        assert row["prefetch_over_raw"] == row["prefetch_read_gbps"] / row["raw_read_gbps"]
    cpu = {(r["path"], r["direction"], r["value_bytes"]): r for r in result["cpu"]}
    for size in (256 << 10, 1 << 20):
        floor = cpu[("socket floor", "recv", size)]
        assert floor["over_floor"] == 1.0 and floor["bytes_per_round"] == 4 << 20
        for path in ("redis", "redis-py", "mooncake"):
            for direction in ("recv", "send"):
                row = cpu[(path, direction, size)]
                assert row["cpu_ms_per_mib"] > 0 and row["over_floor"] > 0
        assert cpu[("memcpy", "recv", size)]["over_floor"] is None
        assert cpu[("framed floor", "recv", size)]["over_framed"] == 1.0
    assert "socket floor" in run.stdout and "x framed" in run.stdout


def test_unknown_backend_is_refused():
    run = subprocess.run([sys.executable, "-m", "kvprefetch.cli", "remotebench", "--backend", "memcached"],
                         capture_output=True, text=True, timeout=60)  # fmt: skip
    assert run.returncode == 2 and "memcached" in run.stderr
