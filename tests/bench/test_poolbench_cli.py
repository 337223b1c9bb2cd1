"""`kvprefetch poolbench` end to end on a small pool: every reserve way's rounds, the summary, the JSON."""

from __future__ import annotations

import json

from typer.testing import CliRunner

from kvprefetch.bench.micro.poolbench import WAYS
from kvprefetch.cli import app


def test_poolbench_measures_every_way_and_writes_the_json(tmp_path):
    out = tmp_path / "pool.json"
    args = ["poolbench", "--pool", "64MiB", "--chunk", "1MiB", "--chunks", "2", "--repeats", "2", "--json", str(out)]
    run = CliRunner().invoke(app, args)
    assert run.exit_code == 0, run.output
    assert [line.split()[2] for line in run.output.splitlines() if line.startswith("round ")] == [*WAYS, *WAYS]
    assert "64MiB pool in" in run.output and "medians of 2 (min-max)" in run.output
    payload = json.loads(out.read_text())
    assert payload["args"] == {"pool": "64MiB", "chunk": "1MiB", "chunks": 2, "repeats": 2, "json": str(out)}
    assert {way: len(rounds) for way, rounds in payload["runs"].items()} == dict.fromkeys(WAYS, 2)
    for way in WAYS:
        assert set(payload["summary"][way]) == {"create_s", "first_load_s", "touched_load_s", "held_gib"}
        assert payload["summary"][way]["held_gib"] > 0  # every way holds the pool's RAM by the end of a load
