"""The serving soak's CI cut (issue 40): `kvprefetch soak-serve` for 90 s as `make soak-serve` runs it for 900:
`kvprefetch serve` with a DRAM pool, a disk tier and a real Redis under a multi-turn load, redis-server killed and
restarted, chunk files damaged while being read, `kvprefetch status --gc`; every answer compared with vLLM alone's
for the same prompt. Asserted: no request failed, no answer differs, every fault kind was injected twice, the
server's DRAM pool is gone after its stop. (Resource growth is reported, not asserted: 90 s is mostly warm-up.)
"""

from __future__ import annotations

import json
import subprocess
import sys
from collections import Counter

import pytest

pytest.importorskip("vllm")

from kvprefetch.bench.soak_serve import FAULT_KINDS

pytestmark = pytest.mark.slow


def test_a_soak_with_faults_loses_no_request_and_answers_as_vllm_alone(tmp_path):
    out = tmp_path / "soak"
    run = subprocess.run([sys.executable, "-m", "kvprefetch.cli", "soak-serve", "--seconds", "90", "--sessions", "2",
                          "--out", str(out)], capture_output=True, text=True, timeout=900)  # fmt: skip
    lines = [ln for ln in run.stdout.splitlines() if ln.startswith("soak-serve:")]
    assert lines, f"no summary line; rc {run.returncode}\n{run.stdout[-2000:]}\n{run.stderr[-3000:]}"
    fields = dict(kv.split("=", 1) for kv in lines[-1].split()[1:])
    assert (fields["failed"], fields["wrong"], fields["shm_left"]) == ("0", "0", "0"), lines[-1]
    assert run.returncode == 0 and int(fields["requests"]) >= 20, lines[-1]
    doc = json.loads((out / "summary.json").read_text())
    kinds = Counter(f["kind"] for f in doc["faults"])
    assert all(kinds[k] >= 2 for k in FAULT_KINDS), doc["faults"]
    assert all(a["right"] is not None for a in doc["answers"]), "vLLM alone answered every prompt"
    assert doc["metrics_moved"].get("saved_chunks_total", 0) > 0 and (out / "timeline.png").stat().st_size > 0
