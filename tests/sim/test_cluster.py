"""`kvprefetch sim --scenario cluster`: the whitepaper's deployment on N nodes sharing its array."""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from kvprefetch.cli import app
from kvprefetch.sim.cluster import PORT_BPS, project


@pytest.fixture(scope="module")
def projection():
    return project([1, 2, 4, 8], concurrency=8)


def test_each_node_gets_its_share_of_the_array(projection):
    shares = [p.share_bps for p in projection.points]
    assert shares[0] == pytest.approx(projection.array_bps)  # one node: the array (slower than its port)
    assert shares == pytest.approx([projection.array_bps / n for n in (1, 2, 4, 8)])
    assert all(s <= PORT_BPS for s in shares)


def test_the_array_saturates_and_the_cluster_stops_scaling(projection):
    # one whitepaper node at c=8 reads faster than the array gives it (R1: it reaches 5.23 GB/s alone)
    assert projection.saturates_at < 1.0
    pts = projection.points
    assert all(p.array_util <= 1.02 for p in pts)
    cluster = [p.nodes * p.prefetch_tok_s for p in pts]
    assert max(cluster) / min(cluster) < 1.2  # the array bounds the cluster's throughput: more nodes add nothing
    ttft = [p.prefetch_ttft_p50_s for p in pts]
    assert ttft == sorted(ttft)  # each node waits longer for its share
    # prefetch's gain over loading on demand shrinks as storage dominates, and recompute overtakes both
    assert pts[0].prefetch_vs_sync < pts[-1].prefetch_vs_sync < 1.0
    assert pts[0].recompute_vs_prefetch > 1.0 > pts[-1].recompute_vs_prefetch


def test_cli_prints_and_writes_the_projection(tmp_path):
    out = tmp_path / "cluster.json"
    res = CliRunner().invoke(app, ["sim", "--scenario", "cluster", "--nodes", "1,4", "--concurrency", "8",
                                   "--json", str(out), "--plots", str(tmp_path)])  # fmt: skip
    assert res.exit_code == 0, res.output
    assert "the array's 5.23 GB/s carries" in res.output
    (p,) = json.loads(out.read_text())
    assert [x["nodes"] for x in p["points"]] == [1, 4] and p["port_saturates"] is False
    assert (tmp_path / "cluster_c8.png").stat().st_size > 0
    bad = CliRunner().invoke(app, ["sim", "--scenario", "cluster", "--nodes", "0"])
    assert bad.exit_code != 0 and "not a number of nodes" in bad.output
