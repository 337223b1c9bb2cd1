"""`kvprefetch loadbench` around its passes: the table, the goals, results.json and --json (the passes faked)."""

from __future__ import annotations

import contextlib
import json

from tests.clitext import flat
from tests.loader.conftest import write_checkpoint
from typer.testing import CliRunner

from kvprefetch.bench.micro import hugepages, loadbench
from kvprefetch.cli import app


def test_loadbench_prints_and_writes_the_same_rows(tmp_path, monkeypatch):
    def passes(bench: loadbench.LoadBench) -> list[loadbench.Row]:
        samples = {m: [] if m.loader == "fastsafetensors" else [2.0, 1.0, 3.0] for m in loadbench.MODES}
        details = {m: [{"cpu_s": 4.0, "wait_s": 0.5, "handout_s": 1.5}] * 3 for m in loadbench.MODES}
        bench.timelines = {"kvprefetch local": {"blocks": [[0.0, 0.1, "source"], [0.05, 0.2, "source"]],
                                                "waits": [[0.0, 0.1]], "seconds": 0.3},
                           "kvprefetch warm-dram": {"blocks": [[0.0, 0.01, "cache-dram-map"]], "waits": [],
                                                    "seconds": 0.1}}  # fmt: skip
        return bench._rows(samples, {loadbench.MODES[3]: "needs a CUDA device"}, 4_000_000_000, details)

    monkeypatch.setattr(loadbench.LoadBench, "run", passes)
    monkeypatch.setattr(hugepages, "reserved_huge_pages", lambda nbytes: contextlib.nullcontext(False))
    model = write_checkpoint(tmp_path / "ckpt")
    out = tmp_path / "rows.json"
    run = CliRunner().invoke(app, ["loadbench", "--model", str(model), "--dir", str(tmp_path), "--json", str(out)])
    assert run.exit_code == 0, run.output
    text = flat(run.output)
    assert "kvprefetch loadbench: ckpt" in text and "median of 3" in text
    assert "unavailable: needs a CUDA device" in text
    assert "no huge pages could be reserved" in text
    assert "goal kvprefetch cold local vs vLLM default: 1.00x (target >= 1.5x): NOT met" in text
    (written,) = tmp_path.glob("loadbench-*/results.json")
    assert written.read_text() == out.read_text()
    assert (written.parent / "loadbench.png").exists()
    assert (written.parent / "loadbench_timeline.png").stat().st_size > 1000  # one panel per load of ours
    payload = json.loads(out.read_text())
    assert payload["repeats"] == 3 and payload["shards"] == 3
    assert [(r["loader"], r["regime"]) for r in payload["rows"]] == [(m.loader, m.regime) for m in loadbench.MODES]
    assert {r["seconds"] for r in payload["rows"]} == {2.0, None}
    assert len(payload["goals"]) == 6
    # where the seconds went: CPU per GB loaded (4 CPU s for 4 GB), and the whitepaper's R9 beside the warm tiers
    assert {r["cpu_s_per_gb"] for r in payload["rows"]} == {1.0, None} and "CPU s/GB" in text
    assert "goal warm DRAM pool vs cold local: 1.00x (target >= 1.0x): met" in text
    assert "whitepaper R9 (6.2-9.3x faster than from NFS): warm DRAM pool vs cold network 1.00x" in text
    assert payload["whitepaper_r9"] == {"range": [6.2, 9.3], "measured": {"warm DRAM pool vs cold network": 1.0,
                                                                          "warm disk cache vs cold network": 1.0}}
    assert set(payload["timelines"]) == {"kvprefetch local", "kvprefetch warm-dram"}
