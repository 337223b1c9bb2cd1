"""Free-form planning runs: closed loops, Poisson open loops and traces, from `Load` through `kvprefetch sim`."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
from tests.clitext import flat
from typer.testing import CliRunner

from kvprefetch.cli import app
from kvprefetch.sim.freeform import Load, Setup, parse_workload, run_setup
from kvprefetch.sim.policy import Policy
from kvprefetch.sim.tiers import BlockCache
from kvprefetch.workload.request import BLOCK_TOKENS

SETUP = Setup(efficiency=0.05)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"concurrency": 4, "rate_per_s": 1.0}, "not both"),
        ({"concurrency": 0}, "concurrency must be at least 1"),
        ({"rate_per_s": 0.0}, "arrival rate must be positive"),
    ],
)
def test_a_load_is_one_closed_or_open_loop(kwargs, message):
    with pytest.raises(ValueError, match=message):
        Load(**kwargs)


def test_open_loop_sessions_start_as_a_poisson_process():
    rate = 2.0
    requests, warm = parse_workload("context:4096,256,16", Load(rate_per_s=rate), seed=3)
    assert warm and len(requests) == Load(rate_per_s=rate).sessions() == 240  # two minutes of arrivals
    starts = np.array([r.arrival_s for r in requests])
    gaps = np.diff(np.concatenate([[0.0], starts]))
    assert (gaps > 0).all()
    assert gaps.mean() == pytest.approx(1 / rate, rel=0.15) and gaps.std() == pytest.approx(1 / rate, rel=0.2)
    chat, _ = parse_workload("chat", Load(rate_per_s=0.1))
    assert len({r.session_id for r in chat}) == Load.MIN_SESSIONS  # a slow rate still runs enough sessions
    closed, _ = parse_workload("chat", Load(concurrency=4))
    assert {r.arrival_s for r in closed if r.turn == 0} == {0.0}


def test_trace_and_synthetic_workloads_refuse_the_load_they_cannot_take():
    with pytest.raises(ValueError, match="a trace brings its own arrival times"):
        parse_workload("trace:whatever.jsonl", Load(concurrency=8))
    with pytest.raises(ValueError, match="needs a concurrency or an arrival rate"):
        parse_workload("chat", Load())


def test_an_open_loop_past_what_recompute_serves_queues_while_prefetch_keeps_up():
    slow, fast = Load(rate_per_s=0.1), Load(rate_per_s=0.6)
    runs = {(p, load): run_setup(SETUP, p, "context", load) for p in (Policy.RECOMPUTE, Policy.PREFETCH) for load in
            (slow, fast)}  # fmt: skip
    # recompute serves ~0.3 prompts/s of 18k tokens here: at 0.6/s its queue grows for the whole two minutes
    assert runs[(Policy.RECOMPUTE, fast)].ttft_p(50) > 5 * runs[(Policy.RECOMPUTE, slow)].ttft_p(50)
    # prefetch loads from storage faster than the sessions arrive: its TTFT hardly moves, its output follows the rate
    assert runs[(Policy.PREFETCH, fast)].ttft_p(50) < 3 * runs[(Policy.PREFETCH, slow)].ttft_p(50)
    ratio = runs[(Policy.PREFETCH, fast)].output_tok_s / runs[(Policy.PREFETCH, slow)].output_tok_s
    assert ratio == pytest.approx(6.0, rel=0.25)


def _sim(*args: str) -> tuple[int, str]:
    res = CliRunner().invoke(app, ["sim", *args])
    return res.exit_code, flat(res.output)


def test_cli_runs_open_loops_and_labels_them(tmp_path):
    out, plots = tmp_path / "rows.json", tmp_path / "plots"
    plots.mkdir()
    code, text = _sim("--efficiency", "0.05", "--rate", "0.1,0.6", "--policies", "recompute,prefetch",
                      "--json", str(out), "--plots", str(plots))  # fmt: skip
    assert code == 0, text
    rows = json.loads(out.read_text())
    assert [(r["load"], r["rate_per_s"], r["concurrency"]) for r in rows] == [
        ("0.1/s", 0.1, None), ("0.1/s", 0.1, None), ("0.6/s", 0.6, None), ("0.6/s", 0.6, None)
    ]  # fmt: skip
    assert "0.6/s" in text and (plots / "ttft_vs_concurrency.png").stat().st_size > 0


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--rate", "1", "--concurrency", "2"], "--concurrency (closed loop) or --rate (open loop), not both"),
        (["--rate", "fast"], "--rate takes comma-separated floats, got 'fast'"),
        (["--concurrency", "1.5"], "--concurrency takes comma-separated ints, got '1.5'"),
        (["--workload", "trace:t.jsonl", "--rate", "1"], "a trace brings its own arrival times"),
        (["--workload", "bogus"], "unknown workload 'bogus': use chat, context:CTX,NEW,OUT or trace:PATH"),
        (["--workload", "context:1,2"], "context:CTX,NEW,OUT takes three token counts"),
        (["--workload", "context:0,1,1"], "token counts must be positive"),
        (["--workload", "trace:/no/such.jsonl"], "No such file or directory"),
        (["--policies", "prefetch,fastest"], "'fastest' is not a valid Policy; known policies: recompute"),
        (["--model", "llama-3-70b", "--accelerator", "a100", "--tp", "1"],
         "llama-3-70b does not fit on 1x a100: 141 GB of weights, 72 GB of usable HBM"),
        (["--tp", "0"], "tp must be at least 1 device, got 0"),
        (["--efficiency", "0"], "efficiency is a share of peak FLOP/s, in (0, 1]; got 0.0"),
        (["--dram-gb", "-1"], "dram_gb must be positive, got -1.0"),
    ],
)  # fmt: skip
def test_cli_refuses_loads_workloads_and_policies_it_cannot_run(args, message):
    code, text = _sim(*args)
    assert code != 0 and message in text


def test_a_full_dram_tier_keeps_pinned_blocks_and_turns_the_newcomer_away():
    cache = BlockCache(capacity=3)
    for b in (1, 2, 3):
        cache.insert(b)
    cache.pin([1, 2])
    assert cache.room() == 1
    cache.insert(4)  # the unpinned block 3 makes way
    assert list(cache.blocks) == [1, 2, 4] and cache.room() == 1
    cache.pin([4, 5])
    assert cache.room() == 0
    cache.insert(5)  # everything pinned: the newcomer stays out, the queue ahead keeps its KV
    assert list(cache.blocks) == [1, 2, 4]
    assert BlockCache(capacity=None).room() == float("inf")


QUEUED = Setup("qwen-14b", "a100", 1, "local-nvme", efficiency=0.3, dram_gb=32)


@pytest.mark.parametrize("rate", [0.5, 1.5])
def test_queue_aware_eviction_keeps_queued_kv_that_lru_evicts_and_reads_again(rate):
    load = Load(rate_per_s=rate)
    lru = run_setup(QUEUED, Policy.PREFETCH, "context", load)
    queue_aware = run_setup(replace(QUEUED, queue_aware_eviction=True), Policy.PREFETCH, "context", load)
    requests, _ = parse_workload("context", load)
    dep = QUEUED.deployment()
    once = sum((r.input_len - 1) // BLOCK_TOKENS for r in requests) * BLOCK_TOKENS * dep.model.kv_bytes_per_token
    # every request's stored KV is read from storage exactly once when DRAM keeps what the queue still needs
    assert queue_aware.bytes_read["local-nvme"] == pytest.approx(once)
    if rate < 1:  # the queue stays short: 32 GB hold it, and the two policies do the same
        assert lru.bytes_read == queue_aware.bytes_read and np.array_equal(lru.ttft, queue_aware.ttft)
        return
    # past what the engine serves, requests queue for its KV; LRU evicts their prefetched blocks for newer
    # arrivals', and reads them again at admission
    assert lru.bytes_read["local-nvme"] > 1.5 * once
    assert queue_aware.ttft_p(50) < 0.5 * lru.ttft_p(50)
    assert queue_aware.output_tok_s > lru.output_tok_s


def test_cli_eviction_is_in_the_title_and_rows(tmp_path):
    out = tmp_path / "rows.json"
    code, text = _sim("--model", "qwen-14b", "--accelerator", "a100", "--tp", "1", "--storage", "local-nvme",
                      "--dram-gb", "32", "--rate", "1.5", "--policies", "prefetch", "--eviction", "queue-aware",
                      "--json", str(out))  # fmt: skip
    assert code == 0, text
    assert "32 GB DRAM (queue-aware)" in text
    (row,) = json.loads(out.read_text())
    assert row["eviction"] == "queue-aware" and row["storage_read_gb"] > 0
    code, text = _sim("--eviction", "fifo")
    assert code != 0 and "--eviction" in text


def test_cli_names_the_line_of_a_corrupt_trace(tmp_path):
    trace = tmp_path / "trace.jsonl"
    good = {"timestamp": 0, "input_length": 600, "output_length": 4, "hash_ids": [1, 2]}
    trace.write_text(json.dumps(good) + "\n" + json.dumps({"timestamp": 5, "input_length": 10}) + "\n")
    code, text = _sim("--workload", f"trace:{trace}")
    squeezed = "".join(text.split())  # a long path wraps anywhere in rich's box
    assert code != 0 and "".join(f"{trace}:2: not a Mooncake trace line (missing 'hash_ids')".split()) in squeezed
    code, text = _sim("--scenario", "mooncake", "--trace", str(trace))
    assert code != 0 and "--trace:" in text and "".join(f"{trace}:2:".split()) in "".join(text.split())


def test_cli_plots_a_traces_reuse_against_capacity(tmp_path):
    trace = tmp_path / "trace.jsonl"
    rows = [
        {"timestamp": 100 * i, "input_length": 1500, "output_length": 4, "hash_ids": [1, 2, 3 + i]} for i in range(6)
    ]
    trace.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    code, text = _sim("--workload", f"trace:{trace}", "--policies", "prefetch", "--plots", str(tmp_path))
    assert code == 0, text
    assert (tmp_path / "hit_ratio.png").stat().st_size > 0 and not (tmp_path / "ttft_vs_concurrency.png").exists()


TRACE = Path(__file__).resolve().parents[2] / "../shared/data/mooncake/synthetic_trace.jsonl"


@pytest.mark.skipif(not TRACE.exists(), reason="Mooncake trace not present")
def test_a_local_nvme_in_front_of_a_slow_pool_serves_the_reuse_the_pool_is_too_slow_for():
    base = Setup("llama-3-70b", "h100", 4, "nfs", efficiency=0.3, dram_gb=50)
    pool_only = run_setup(base, Policy.ONDEMAND, f"trace:{TRACE}", Load())
    tiered = run_setup(replace(base, storage="local-nvme,nfs"), Policy.ONDEMAND, f"trace:{TRACE}", Load())
    # NFS alone loads slower than the engine recomputes: the load-or-recompute rule leaves only the engine's cache
    assert pool_only.hit_ratio < 0.2 and pool_only.bytes_read["nfs"] == 0
    assert pool_only.recomputed_slower_tokens > 0.3 * pool_only.input_len.sum()
    # every prompt is written through to both; reuse that DRAM lost is read from the nearer, faster tier, as far as
    # its queue lets a load beat recomputing (this engine cannot keep up with the trace: queues are long)
    assert tiered.hit_ratio > 4 * pool_only.hit_ratio
    assert tiered.bytes_read["local-nvme"] > 0 and tiered.bytes_read["nfs"] == 0
    assert tiered.output_tok_s > 1.3 * pool_only.output_tok_s
    assert tiered.ttft_p(50) < pool_only.ttft_p(50)


def test_cli_lists_each_storage_tier_nearest_first_and_refuses_a_repeat():
    code, text = _sim("--storage", "local-nvme,nvmeof-100gbe-raid0", "--concurrency", "2", "--policies", "prefetch")
    assert code == 0, text
    assert text.index("local-nvme: 6.90 GB/s") < text.index("nvmeof-100gbe-raid0: 5.23 GB/s, 3.92 GB/s")
    code, text = _sim("--storage", "nfs,nfs", "--concurrency", "2")
    assert code != 0 and "storage names one or more distinct tiers, nearest first" in text


def test_cli_says_where_hits_came_from_and_when_hbm_alone_served_them(tmp_path):
    # a short chat fits in 8x H200's HBM: every hit is the engine's own, and no policy changes anything
    out = tmp_path / "rows.json"
    code, text = _sim("--model", "deepseek-v3", "--accelerator", "h200", "--workload", "chat", "--concurrency", "4",
                      "--policies", "recompute,prefetch", "--json", str(out))  # fmt: skip
    assert code == 0, text
    assert "every hit came from the engine's own prefix cache in HBM" in text
    rows = json.loads(out.read_text())
    assert all(set(r["served_from"]) == {"computed", "hbm"} for r in rows)
    assert all(r["served_from"]["hbm"] == pytest.approx(r["hit_ratio"]) for r in rows)
    # the cold-read workload sits only in storage: prefetch's hits come through DRAM, none from HBM
    code, text = _sim("--concurrency", "2", "--policies", "recompute,prefetch", "--efficiency", "0.05",
                      "--json", str(out))  # fmt: skip
    assert code == 0, text
    assert "every hit came from" not in text and "every prompt was recomputed" not in text
    recompute, prefetch = json.loads(out.read_text())
    assert set(recompute["served_from"]) == {"computed"}
    assert prefetch["served_from"]["dram"] == pytest.approx(prefetch["hit_ratio"]) and prefetch["hit_ratio"] > 0.8
    assert sum(prefetch["served_from"].values()) == pytest.approx(1.0)


def test_cli_says_when_the_load_or_recompute_rule_left_storage_unread(tmp_path):
    # at 40% of peak the 480B prefills a 16k-token prompt faster than 3.9 GB/s brings its 4 GB of KV; one client
    # never queues, so no prefetch gets ahead of the request it reads for
    code, text = _sim("--concurrency", "1", "--policies", "recompute,prefetch", "--json", str(tmp_path / "rows.json"))
    assert code == 0, text
    assert "the tiers held hits, but the load-or-recompute rule recomputed them all" in text
    recompute, prefetch = json.loads((tmp_path / "rows.json").read_text())
    assert recompute["recomputed_slower"] == 0  # no external cache: nothing to weigh
    assert prefetch["recomputed_slower"] == pytest.approx(17920 / 18432)  # every stored block: all but the last


def test_cli_says_when_a_workload_reuses_nothing(tmp_path):
    trace = tmp_path / "unique.jsonl"
    ids = [[10 * i + j for j in range(4)] for i in range(4)]  # four prompts, no block in common
    lines = [
        {"timestamp": 1000 * i, "input_length": 2048, "output_length": 16, "hash_ids": h} for i, h in enumerate(ids)
    ]
    trace.write_text("".join(json.dumps(line) + "\n" for line in lines))
    code, text = _sim("--workload", f"trace:{trace}", "--policies", "recompute,prefetch")
    assert code == 0, text
    assert "this workload reuses no prompt tokens" in text


def test_cli_sweep_prints_and_plots_prefetch_between_its_two_bounds(tmp_path):
    out, plots = tmp_path / "sweep.json", tmp_path / "plots"
    args = ["--sweep", "--efficiency", "0.05", "--concurrency", "1", "--json", str(out), "--plots", str(plots)]
    code, text = _sim(*args)
    assert code == 0, text
    assert "all in DRAM" in text and "recompute" in text and (plots / "sweep.png").stat().st_size > 0
    (sweep,) = json.loads(out.read_text())
    recompute = run_setup(Setup(efficiency=0.05), Policy.RECOMPUTE, "context", Load(concurrency=1)).ttft_p(50)
    assert sweep["recompute_ttft_p50_s"] == pytest.approx(recompute)
    # one client, no queue: more bandwidth never hurts, and prefetch lies between all-in-DRAM and recomputing
    ttfts = [p["prefetch_ttft_p50_s"] for p in sweep["points"]]
    assert ttfts == sorted(ttfts, reverse=True)
    assert all(sweep["points"][0]["dram_ttft_p50_s"] <= t <= recompute * 1.001 for t in ttfts)
    assert ttfts[-1] < 0.1 * recompute
