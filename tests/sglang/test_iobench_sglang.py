"""`kvprefetch iobench --sglang` end to end, as a user runs it (a small size, one round)."""

import json
import subprocess
import sys

from tests.clitext import flat

PATHS = ("hicache-file", "ours-v1", "ours-flat", "store-get-into")


def test_iobench_sglang_reads_the_same_pages_through_every_path(tmp_path):
    out = tmp_path / "sgl.json"
    cmd = [sys.executable, "-m", "kvprefetch.cli", "iobench", "--sglang", "--dir", str(tmp_path), "--size", "64MiB",
           "--page-tokens", "16", "--repeats", "2", "--json", str(out)]  # fmt: skip
    run = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-2000:]
    result = json.loads(out.read_text())
    assert result["page_bytes"] == 2 << 20 and result["pages"] == 32
    for path in PATHS:
        assert len(result["gbps"][path]) == 2 and all(r > 0 for r in result["gbps"][path])
    med, lo, hi = result["ours_v1_over_hicache_file"]
    assert lo <= med <= hi
    text = flat(run.stdout)
    assert "ours-v1 / hicache-file:" in text and "ours-v1 / store-get-into:" in text
    assert not list(tmp_path.glob("kvprefetch-sglangbench-*")), "the benchmark cleans up its files"
