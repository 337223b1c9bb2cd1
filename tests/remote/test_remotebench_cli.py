"""`kvprefetch remotebench` end to end on real local servers (small sizes)."""

import json
import subprocess
import sys


def test_remotebench_reports_ours_next_to_the_raw_client(tmp_path):
    out = tmp_path / "rb.json"
    cmd = [sys.executable, "-m", "kvprefetch.cli", "remotebench", "--backend", "redis", "--backend", "mooncake",
           "--chunk", "256KiB", "--chunks", "32", "--repeats", "1", "--json", str(out)]  # fmt: skip
    run = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-2000:]
    rows = {r["backend"]: r for r in json.loads(out.read_text())}
    assert set(rows) == {"redis", "mooncake"}
    for row in rows.values():
        assert row["chunks"] == 32 and row["chunk_bytes"] == 256 * 1024
        assert row["raw_read_gbps"] > 0 and row["prefetch_read_gbps"] > 0 and row["get_into_gbps"] > 0
        assert row["prefetch_over_raw"] == row["prefetch_read_gbps"] / row["raw_read_gbps"]


def test_unknown_backend_is_refused():
    run = subprocess.run([sys.executable, "-m", "kvprefetch.cli", "remotebench", "--backend", "memcached"],
                         capture_output=True, text=True, timeout=60)  # fmt: skip
    assert run.returncode == 2 and "memcached" in run.stderr
