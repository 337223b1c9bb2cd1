"""`kvprefetch sim --scenario engine-memory`: the whitepaper's 14B deployment with its engine KV cut to shares of
the full size, vLLM alone against kvprefetch, every input declared."""

from __future__ import annotations

import json

from tests.clitext import flat
from typer.testing import CliRunner

from kvprefetch.cli import app
from kvprefetch.sim.engine_memory import GIVE_BACK_SHARE, Inputs, Policy, lines, project


def test_the_full_kv_holds_the_clients_conversations_and_the_policies_run_at_every_share():
    inputs = Inputs(concurrency=12, sessions_per_client=2)
    dep = inputs.deployment()
    assert dep.model.name == "qwen-14b" and dep.tp == 1
    assert Inputs().clients() == dep.kv_capacity_tokens // Inputs().longest_conversation()  # derived, not fitted
    p = project(inputs)
    assert {(x.policy, x.share) for x in p.points} == {(pol.value, s) for pol in (Policy.RECOMPUTE, Policy.PREFETCH,
                                                                                   Policy.DRAM) for s in inputs.shares}
    full = p.full()
    assert full.share == 1.0 and full.kv_gb == p.full_kv_gb > 0
    # vLLM alone keeps its reuse only while its KV holds the conversations: at 1/8 it recomputes them
    assert p.at(Policy.RECOMPUTE, 0.125).hit_ratio < full.hit_ratio
    assert p.at(Policy.PREFETCH, 0.125).hit_ratio >= full.hit_ratio * 0.95  # the tiers keep it
    found = p.give_back()
    if found is not None:
        assert found.vs(full)[0] >= GIVE_BACK_SHARE
    text = "\n".join(lines(p))
    assert "qwen-14b on 1x mi308x" in text and "memory given back at equal throughput" in text


def test_the_cli_prints_the_curve_and_writes_its_json_and_plot(tmp_path):
    out = tmp_path / "em.json"
    run = CliRunner().invoke(app, ["sim", "--scenario", "engine-memory", "--concurrency", "8", "--json", str(out),
                                   "--plots", str(tmp_path)])  # fmt: skip
    assert run.exit_code == 0, run.output
    assert "8 closed-loop clients" in flat(run.output)
    data = json.loads(out.read_text())
    assert data["clients"] == 8 and len(data["points"]) == 12 and data["inputs"]["model"] == "qwen-14b"
    assert (tmp_path / "engine_memory_14b.png").stat().st_size > 0
    bad = CliRunner().invoke(app, ["sim", "--scenario", "engine-memory", "--concurrency", "many"])
    assert bad.exit_code == 2 and "--concurrency" in flat(bad.output)
