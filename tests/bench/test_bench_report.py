"""The report writer: results.json, report.md (tables, ratios next to the whitepaper's), plots."""

from __future__ import annotations

import json

import pytest

from kvprefetch.bench.report import (
    comparisons,
    markdown_report,
    markdown_table,
    rich_table,
    row_cells,
    write_outputs,
)


def _row(mode, c, ttft, tok_s, **kw):
    base = {"mode": mode, "concurrency": c, "status": "ok", "workload": "chat", "regime": 10.0, "requests": 10,
            "completed": 10, "errors": 0, "ttft_p50_s": ttft, "ttft_p90_s": ttft * 2, "ttft_p99_s": ttft * 3,
            "itl_p50_s": 0.01, "output_tok_s": tok_s, "requests_per_s": 1.0, "hit_ratio": 0.8, "share_engine": 0.1,
            "share_dram": 0.3, "share_disk": 0.4, "share_computed": 0.2, "bytes_disk_read": 3 << 20,
            "prefetch_in_time": 4, "prefetch_late": 1, "prefetch_wasted_chunks": 0,
            "ttft_samples_s": [ttft * 0.5, ttft, ttft * 3]}  # fmt: skip
    return base | kw


def _results():
    rows = []
    for c in (1, 8):
        rows += [
            _row("recompute", c, 2.0 * c, 10.0),
            _row("ondemand-sync", c, 0.5 * c, 20.0),
            _row("prefetch", c, 0.25 * c, 30.0),
            _row("dram", c, 0.2 * c, 32.0),
        ]
        rows.append({"mode": "lmcache", "concurrency": c, "status": "unavailable", "reason": "needs CUDA"})
    return {
        "started": "2026-01-01T00:00:00", "duration_s": 12.0,
        "machine": {"cpu": "test cpu", "cpus": 2, "loadavg_start": [0.1, 0.2, 0.3], "loadavg_end": [1, 1, 1]},
        "versions": {"vllm": "0.32.0"}, "model": {"path": "tiny", "dtype": "float32", "bytes_per_token": 4096},
        "config": {"engine_kv_cache_tokens": 8000, "max_num_seqs": 8, "chunk_tokens": 256, "dram_tier_bytes": 1 << 27},
        "workload": {"name": "chat", "kind": "chat", "prelude_tokens": 100, "measured_prompt_tokens": 200,
                     "reusable_share": 0.8, "largest_level_prompt_tokens": 150},
        "regime": {"asked": 10.0, "enforced_by": "cgroup-v1-blkio 254:0", "prefill_tokens_per_s": 2560.0,
                   "chunk_tokens": 256, "chunk_bytes": 1 << 20, "native_read_bps": 1e9, "native_regime": 97.6,
                   "target_read_bps": 1.07e8, "read_bps": 1.1e8, "measured": 10.7, "stream_read_bps": 2.0e7,
                   "array_streams": 5.34, "io_threads": 6, "serial_read_bps": 1.9e7, "measured_serial": 1.8},
        "notes": ["dram: 40 of 40 chunks in DRAM before the run"],
        "rows": rows,
        "simulator_prediction": [
            {"mode": "prefetch", "concurrency": 8, "predicted": 2.1, "measured": 2.0,
             "computed_tokens_predicted": 5930, "computed_tokens_measured": 5800,
             "engine_cached_tokens_predicted": 43520, "engine_cached_tokens_measured": 44420},
            {"mode": "dram", "concurrency": 8, "predicted": 1.9, "measured": None},
        ],
    }  # fmt: skip


def test_comparisons_put_prefetch_against_each_baseline():
    comp = {(x["concurrency"], x["baseline"]): x for x in comparisons(_results()["rows"])}
    assert set(comp) == {(c, b) for c in (1, 8) for b in ("ondemand-sync", "recompute", "dram")}
    x = comp[(8, "ondemand-sync")]
    assert x["ttft_p50_change"] == pytest.approx(-0.5)
    assert x["throughput_change"] == pytest.approx(0.5)
    assert comp[(8, "recompute")]["ttft_speedup"] == pytest.approx(8.0)
    assert comp[(1, "dram")]["ttft_p50_change"] == pytest.approx(0.25)


def _rounds(mode, c, ttfts, toks):
    return [_row(mode, c, t, x) | {"round": k} for k, (t, x) in enumerate(zip(ttfts, toks, strict=True))]


def test_rounds_give_medians_with_their_range_and_paired_verdicts():
    from kvprefetch.bench.rounds import aggregate

    runs = (_rounds("ondemand-sync", 16, [1.0, 2.0, 1.2], [10.0, 5.0, 9.0])
            + _rounds("prefetch", 16, [0.6, 1.2, 0.7], [14.0, 7.0, 12.0])
            + _rounds("ondemand", 16, [0.5, 2.5, 1.0], [10.0, 10.0, 10.0])
            + _rounds("dram", 16, [0.6, 1.0, 0.8], [14.0, 7.0, 12.0])
            + [{"mode": "recompute", "concurrency": 16, "status": "failed", "reason": "boom", "round": 0}])  # fmt: skip
    rows = {r["mode"]: r for r in aggregate(runs)}
    p = rows["prefetch"]
    assert p["ttft_p50_s"] == 0.7 and (p["ttft_p50_s_min"], p["ttft_p50_s_max"]) == (0.6, 1.2)
    assert p["repeats"] == 3 and len(p["ttft_samples_s"]) == 9  # every round's samples
    assert rows["recompute"]["status"] == "failed" and rows["recompute"]["repeats"] == 0
    comp = {x["baseline"]: x for x in comparisons(list(rows.values()))}
    sync = comp["ondemand-sync"]
    # paired ratios 0.6, 0.6, 0.583: faster in every round, though the medians' ranges overlap
    assert sync["ttft_verdict"] == "faster" and sync["ttft_p50_change"] == pytest.approx(-0.4)
    assert sync["throughput_verdict"] == "higher" and sync["rounds"] == 3
    # against ondemand: 1.2, 0.48, 0.7 -> the rounds disagree: a tie, not a gain
    assert comp["ondemand"]["ttft_verdict"] == "tie"
    from kvprefetch.bench.report import goals

    judged = goals(list(comp.values()))
    met = {g["goal"]: g["met"] for g in judged}
    assert met["TTFT p50 vs ondemand-sync <= -26% (c>=16)"] is True
    assert met["TTFT p50 <= 1.10x dram (c>=8)"] is True  # 1.0, 1.2, 0.875: a tie with dram
    assert {g["goal"]: g["measured"] for g in judged}["TTFT p50 <= 1.10x dram (c>=8)"] == "c=16 1.00x (a tie)"
    assert met["never slower than ondemand or ondemand-sync beyond the spread"] is True
    assert "TTFT p50 >= 8.6x faster than recompute (c=16)" not in met  # recompute failed: not judged
    assert "| prefetch | 16 | 10 | 0.700 | 0.600-1.200 |" in "\n".join(markdown_table(list(rows.values())))


def test_a_cell_whose_rounds_are_more_than_2x_apart_is_listed_round_by_round():
    """Issue 48: ondemand's rounds at c=16 were 1.51 and 20.34 s; the table showed a median and a range only."""
    from kvprefetch.bench.rounds import aggregate

    runs = (_rounds("ondemand-sync", 16, [2.23, 2.43], [10.0, 9.0]) + _rounds("ondemand", 16, [1.51, 20.34],
            [12.0, 1.5]) + _rounds("prefetch", 16, [1.38, 1.67], [13.0, 12.0]))  # fmt: skip
    runs[3]["foreign_cpu_cores"] = 0.9
    rows = json.loads(json.dumps(aggregate(runs)))  # as a report rebuilt from results.json reads them
    md = markdown_report(_results() | {"rows": rows, "runs": runs})
    section = md.split("## Cells whose rounds are more than 2x apart")[1].split("## ")[0]
    assert "| 10.0 | ondemand | 16 | TTFT p50, throughput | 1 | 1.510 | 3.020 | 12.0 | 80% | - |" in section
    assert "| 10.0 | ondemand | 16 | TTFT p50, throughput | 2 | 20.340 | 40.680 | 1.5 | 80% | 0.90 |" in section
    assert "prefetch" not in section and "ondemand-sync" not in section  # within 2x: not flagged
    steady = [r for r in rows if r["mode"] != "ondemand"]
    assert "rounds are more than" not in markdown_report(_results() | {"rows": steady})


def test_markdown_report_has_tables_regime_whitepaper_and_missing_modes():
    md = markdown_report(_results())
    assert "| prefetch | 8 | 10 | 2.000 |" in md
    assert "Measured regime R = 10.7" in md and "cgroup-v1-blkio" in md
    assert "one read stream capped at 20.0 MB/s, 1/5.34 of the regime's bandwidth" in md
    assert "Serial reads (one in flight) measured at 19.0 MB/s: R = 1.8." in md
    assert "-26% to -32%" in md and "8.6x to 20x" in md
    assert "| 8 | ondemand-sync | -50% | - | one round | +50% | - | 2.00x |" in md
    assert "| 8 | recompute | -88% | - | one round | +200% | - | 8.00x |" in md
    assert "| TTFT p50 <= 1.10x dram (c>=8) | c=8 1.25x | **no** |" in md
    assert "`lmcache`: unavailable: needs CUDA" in md
    assert "| prefetch | 8 | 2.100 | 2.000 | 5930 / 5800 | 43520 / 44420 |" in md
    assert "| dram | 8 | 1.900 | - | - |" in md  # an older run, or a cell that failed
    assert "0.10/0.20/0.30" in md  # load average next to the numbers
    for png in ("ttft_p50.png", "throughput.png", "ttft_cdf.png"):
        assert png in md


@pytest.mark.parametrize(
    ("reason", "known"),
    [
        ("RuntimeError: shape mismatch: value tensor of shape [2048, 2, 128] cannot be broadcast to indexing "
         "result of shape [3200, 2, 128]", True),
        ("EngineError: engine exited with code 1", False),
    ],
)  # fmt: skip
def test_report_explains_a_peer_failure_we_have_traced_and_only_that_one(reason, known):
    results = _results()
    results["rows"].append({"mode": "vllm-example", "concurrency": 16, "status": "failed", "reason": reason})
    line = next(x for x in markdown_report(results).splitlines() if x.startswith("- `vllm-example`"))
    assert reason in line
    assert ("(known: vLLM's ExampleConnector (a debug connector) stores a prompt only in the step" in line) == known


def test_report_lists_each_engines_calibration_beside_the_medians_the_replay_took():
    results = _results()
    assert "Calibrated on" not in markdown_report(results)  # one engine's calibration: nothing to compare
    results["populate"] = {"calibration": {"prefill_tokens_per_s": 12000.0, "decode_step_s": 0.004}}
    results["mode_calibrations"] = {
        "recompute": {"prefill_tokens_per_s": 15500.0, "decode_step_s": 0.003, "decode_batch_step_s": 0.0062},
        "prefetch": {"prefill_tokens_per_s": 9000.0, "decode_step_s": 0.006},
    }
    results["calibration"] = {"prefill_tokens_per_s": 12000.0, "decode_step_s": 0.004, "decode_batch_step_s": 0.0062}
    md = markdown_report(results)
    assert "Calibrated on 3 engines" in md
    assert "| recompute | 15500 | 3.0 | 6.2 |" in md and "| prefetch | 9000 | 6.0 | - |" in md
    assert "| **median (the replay's)** | 12000 | 4.0 | 6.2 |" in md


def test_write_outputs(tmp_path):
    res = _results() | {
        "calibration": {
            "prefill_tokens_per_s": 2560.0,
            "decode_step_s": 0.01,
            "disk_read_gbps": 0.11,
            "chunk_bytes": 1 << 20,
            "chunk_tokens": 256,
        }
    }
    files = write_outputs(res, tmp_path / "out")
    assert set(files) == {
        "results.json",
        "report.md",
        "ttft_p50.png",
        "throughput.png",
        "ttft_cdf.png",
        "calibration.json",
    }
    from kvprefetch.sim.calibration import Calibration

    assert Calibration.load(tmp_path / "out" / "calibration.json").chunk_tokens == 256
    for f in files:
        assert (tmp_path / "out" / f).stat().st_size > 0
    back = json.loads((tmp_path / "out" / "results.json").read_text())
    assert back["rows"] == res["rows"]
    assert (tmp_path / "out" / "ttft_p50.png").read_bytes()[:4] == b"\x89PNG"
    required = {"mode", "concurrency", "workload", "regime", "ttft_p50_s", "ttft_p90_s", "ttft_p99_s", "itl_p50_s",
                "output_tok_s", "requests", "errors", "hit_ratio"}  # fmt: skip
    assert all(required <= set(r) for r in back["rows"] if r["status"] == "ok")


def test_table_cells_and_unavailable_rows():
    res = _results()
    res["rows"][2] |= {"helper_cpu_s": 0.37, "foreign_cpu_cores": 0.05}
    cells = row_cells(res["rows"][2])
    assert cells[:4] == ["prefetch", "1", "10", "0.250"]
    assert cells[-2:] == ["0.37", "0.05"]  # the connector's CPU, then other processes'
    assert "80%" in cells and "3" in cells
    un = row_cells(res["rows"][4])
    assert un[2] == "unavailable" and len(un) == len(cells)
    assert rich_table(res["rows"]).row_count == len(res["rows"])


def test_report_survives_an_empty_run(tmp_path):
    res = {"rows": [], "regime": {"asked": "native"}, "workload": {}, "config": {}, "machine": {}}
    files = write_outputs(res, tmp_path)
    assert "report.md" in files
    assert "# kvprefetch bench" in (tmp_path / "report.md").read_text()


def test_a_regime_sweep_is_reported_per_regime_with_where_prefetch_pays(tmp_path):
    from kvprefetch.bench.report import pays_from, sweep_points
    from kvprefetch.bench.rounds import aggregate

    runs = []
    for regime, sync_ttft in ((18.2, 2.0), (3.0, 1.2), ("native", 1.0)):  # prefetch 1.0 s throughout
        for mode, ttft in (("ondemand-sync", sync_ttft), ("prefetch", 1.0), ("dram", 0.95)):
            runs += [r | {"regime": regime} for r in _rounds(mode, 16, [ttft, ttft * 1.02], [10.0, 10.0])]
    res = _results() | {"rows": aggregate(runs), "runs": runs,
                        "regime": {"asked": 18.2, "measured": 17.0},
                        "sweep": [{"asked": 3.0, "measured": 3.1}, {"asked": "native", "measured": 90.0}]}  # fmt: skip
    points = sweep_points(res)
    assert {(p["regime"], p["baseline"]) for p in points} == {(g, b) for g in (18.2, 3.0, "native")
                                                              for b in ("ondemand-sync", "dram")}  # fmt: skip
    # faster than ondemand-sync at R 3.1 and 17, a tie at R 90 (native: storage never waited): pays nowhere
    # all the way up; drop the native point and it pays from 3.1
    assert pays_from(points) is None
    assert pays_from([p for p in points if p["regime"] != "native"]) == 3.1
    md = markdown_report(res)
    assert "### regime 3.0" in md and "## Regime sweep" in md and "| 3.0 | 3.1 | 16 | 0.83x | faster |" in md
    files = write_outputs(res, tmp_path)
    assert "regime_sweep.png" in files and (tmp_path / "regime_sweep.png").stat().st_size > 0


def test_report_shows_per_rank_bytes_only_for_tensor_parallel_runs():
    from kvprefetch.bench.stats import cell_metrics

    after = {"ranks": {str(r): {"loaded_bytes": (r + 1) << 20, "saved_bytes": 3 << 20, "prefetched_chunks": 4,
                                "reached_hit_chunks": 8, "reached_in_dram_chunks": 6} for r in (0, 1)}}  # fmt: skip
    m = cell_metrics({"records": [], "wall_s": 1.0, "before": {"ranks": {"0": {"loaded_bytes": 1 << 20}}},
                      "after": after})  # fmt: skip
    assert m["ranks"]["0"]["loaded_bytes"] == 0 and m["ranks"]["1"]["loaded_bytes"] == 2 << 20
    res = _results()
    res["rows"][2] |= {"ranks": m["ranks"]}
    text = markdown_report(res)
    assert "## Per tensor-parallel rank" in text
    assert "| prefetch | 1 | 1 | 2.0 | 3.0 | 4 | 6 / 8 |" in text
    assert "Per tensor-parallel rank" not in markdown_report(_results())  # TP=1: no such section


def test_cpu_tensor_parallel_ranks_get_a_core_set_each():
    from kvprefetch.vllm.cpu import OMP_BIND, omp_threads_bind, tp_cpu_env

    assert omp_threads_bind(2, [0, 1]) == "0|1"
    assert omp_threads_bind(2, list(range(16))) == "0-7|8-15"
    assert omp_threads_bind(4, [0, 1, 2, 3, 8, 9, 10, 11, 12]) == "0-1|2-3|8-9|10-11"
    assert tp_cpu_env(1, {}) == {} and tp_cpu_env(2, {OMP_BIND: "5|6"}) == {}
    assert set(tp_cpu_env(2, {})) == {OMP_BIND}
    with pytest.raises(ValueError, match="needs 4 cores"):
        omp_threads_bind(4, [0, 1])


def test_storage_share_bounds_what_prefetch_can_cut_and_stands_beside_r2s():
    """Storage's share of on-demand TTFT, paired by round (1 - dram / ondemand-sync): 0.4/1.0, 1.0/2.0 and
    0.8/1.2 -> shares 60%, 50%, 33%; the report puts it beside prefetch's cut and R2's share."""
    from kvprefetch.bench.report import storage_shares
    from kvprefetch.bench.rounds import aggregate

    runs = (_rounds("ondemand-sync", 16, [1.0, 2.0, 1.2], [10.0, 5.0, 9.0])
            + _rounds("prefetch", 16, [0.6, 1.2, 0.7], [14.0, 7.0, 12.0])
            + _rounds("dram", 16, [0.4, 1.0, 0.8], [14.0, 7.0, 12.0]))  # fmt: skip
    rows = aggregate(runs)
    (share,) = storage_shares(rows)
    assert share["concurrency"] == 16 and share["share"] == pytest.approx(0.5)
    assert share["range"] == pytest.approx((1 - 0.8 / 1.2, 0.6))
    res = _results() | {"rows": rows}
    res["regime"] = res["regime"] | {"whitepaper_storage_share": {"16": 0.966}}
    md = markdown_report(res)
    assert "## How much of on-demand TTFT is storage" in md
    assert "| 16 | 50% | 33..60% | -40% | 97% |" in md
    assert "## How much of on-demand TTFT is storage" not in markdown_report(_results() | {"rows": rows[:1]})
