"""The serving soak's CI cut (issue 40): `kvprefetch soak-serve` for 90 s with the faults that neither restart the
server nor add an engine (`--faults light`; `make soak-serve` runs every kind for 900 s): `kvprefetch serve` with a
DRAM pool, a disk tier on a tmpfs of its own and a real Redis under a multi-turn load; redis-server killed and
restarted, the chunk files the node writes next damaged as they land, `kvprefetch status --gc`, the disk tier's
filesystem filled and freed; every answer compared with vLLM alone's for the same prompt.

Asserted: no request failed, no answer differs, every fault kind injected twice, each fault that can show in
/metrics did (vllm:kvprefetch_tier_errors_total by tier and kind) and the log named it without a line per chunk,
the server's DRAM pool is gone after its stop. (Resource growth is judged only on runs long enough to level off.)
"""

from __future__ import annotations

import json
import subprocess
import sys
from collections import Counter

import pytest

pytest.importorskip("vllm")

from kvprefetch.bench.soak_faults import LIGHT_KINDS

pytestmark = pytest.mark.slow


def test_a_soak_with_faults_loses_no_request_answers_as_vllm_alone_and_shows_every_fault(tmp_path):
    out = tmp_path / "soak"
    run = subprocess.run([sys.executable, "-m", "kvprefetch.cli", "soak-serve", "--seconds", "90", "--sessions", "2",
                          "--faults", "light", "--full-s", "8", "--out", str(out)],
                         capture_output=True, text=True, timeout=900)  # fmt: skip
    lines = [ln for ln in run.stdout.splitlines() if ln.startswith("soak-serve:")]
    assert lines, f"no summary line; rc {run.returncode}\n{run.stdout[-2000:]}\n{run.stderr[-3000:]}"
    fields = dict(kv.split("=", 1) for kv in lines[-1].split()[1:])
    assert (fields["failed"], fields["wrong"], fields["shm_left"], fields["apart"]) == ("0", "0", "0", "0"), lines[-1]
    doc = json.loads((out / "summary.json").read_text())
    failed_checks = [c for c in doc["checks"] if not c["passed"]]
    assert run.returncode == 0 and not failed_checks, (failed_checks, run.stdout[-3000:])
    names = {c["check"] for c in doc["checks"]}
    assert {f"{k} in /metrics" for k in ("redis_kill", "damage", "disk_full")} <= names
    kinds = Counter(f["kind"] for f in doc["faults"])
    assert all(kinds[k] >= 2 for k in LIGHT_KINDS), doc["faults"]
    assert not [f for f in doc["faults"] if f["what"].startswith("FAILED")], doc["faults"]
    assert int(fields["requests"]) >= 50 and all(a["right"] is not None for a in doc["answers"])
    assert float(fields["hit_ratio"]) > 0, "the tiers served part of the prompts"
    assert (out / "timeline.png").stat().st_size > 0 and "| calm |" in (out / "conditions.md").read_text()
