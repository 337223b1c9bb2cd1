"""`kvprefetch iobench` end to end, as a user runs it (small size)."""

import json
import shutil
import subprocess
import sys


def test_iobench_writes_the_documented_json(tmp_path):
    out = tmp_path / "io.json"
    cmd = [sys.executable, "-m", "kvprefetch.cli", "iobench", "--dir", str(tmp_path), "--size", "64MiB",
           "--chunk", "2MiB", "--repeats", "1", "--json", str(out)]  # fmt: skip
    if shutil.which("fio") is None:
        cmd.append("--no-fio")
    run = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-2000:]
    result = json.loads(out.read_text())
    for field in ("fio_read_gbps", "serial_read_gbps", "parallel_read_gbps", "write_gbps", "parallel_over_fio",
                  "parallel_over_serial", "chunk_bytes", "total_bytes"):  # fmt: skip
        assert field in result
    assert result["chunk_bytes"] == 2 << 20 and result["total_bytes"] == 64 << 20
    assert result["serial_read_gbps"] > 0 and result["parallel_read_gbps"] > 0 and result["write_gbps"] > 0
    assert result["parallel_over_serial"] == result["parallel_read_gbps"] / result["serial_read_gbps"]
    assert "parallel/serial" in run.stdout
    assert not list(tmp_path.glob("kvprefetch-iobench-*")), "the benchmark cleans up its files"


def test_bad_sizes_are_refused_clearly():
    run = subprocess.run([sys.executable, "-m", "kvprefetch.cli", "iobench", "--size", "-3"],
                         capture_output=True, text=True, timeout=60)  # fmt: skip
    assert run.returncode == 2
    assert "size" in run.stderr
