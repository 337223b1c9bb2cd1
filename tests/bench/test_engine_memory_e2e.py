"""`kvprefetch bench --engine-kv` end to end on real vLLM CPU engines: every mode at every size, rounds
interleaved across them, a size too small for vLLM reported rather than started, and the report's section."""

from __future__ import annotations

import pytest

from kvprefetch.bench.options import (
    BenchOptions,
    EngineOptions,
    FileOptions,
    KvAsk,
    SingleOptions,
    WorkloadOptions,
)
from kvprefetch.workload.replay import IN_RUN

pytest.importorskip("vllm")

pytestmark = [pytest.mark.slow, pytest.mark.engine, pytest.mark.long]

TOKEN_BYTES = 4096  # the packaged tiny Llama's KV per token (fp32)


def test_every_mode_at_every_engine_size_in_interleaved_rounds(tmp_path):
    from kvprefetch.bench.bench_cli import run_and_report

    chat = IN_RUN.__class__(**{**IN_RUN.__dict__, "system_tokens": 256, "history_tokens": 512, "user_tokens": 64,
                               "output_tokens": 8, "measured_turns": 3, "think_s": 0.2, "min_sessions": 2,
                               "sessions_per_concurrency": 1.0})  # fmt: skip
    full = 2 * (1280 + 128) * TOKEN_BYTES  # two requests of max_model_len (1280) and vLLM's null block: 1/2 holds one
    opts = BenchOptions(modes=["recompute", "prefetch"], concurrency=[2], regimes=(10.0,), repeats=2,
                        # the sizes, the interleaving and the loads do not depend on where the threads run: the
                        # gpu-node topology (a worker process per engine, 97 s for this test against 29 s) is
                        # test_bench_e2e's to check
                        engine=EngineOptions(max_num_seqs=None, kv_cache_bytes=full, topology="shared"),
                        workload=WorkloadOptions(chat=chat),
                        scenario=SingleOptions(engine_kv=(KvAsk(0.5), KvAsk(0.25))),
                        files=FileOptions(out=tmp_path / "out", cache_dir=tmp_path / "cache"),
                        cell_timeout_s=300)  # fmt: skip
    results = run_and_report(opts)
    assert results["config"]["max_model_len"] == 1280
    by = {(r["mode"], r["engine_kv_share"]): r for r in results["rows"]}
    assert set(by) == {(m, s) for m in ("recompute", "prefetch") for s in (1.0, 0.5, 0.25)}
    for share in (1.0, 0.5):
        for mode in ("recompute", "prefetch"):
            r = by[mode, share]
            assert r["status"] == "ok" and r["errors"] == 0 and r["completed"] == r["requests"] == 6, r
            assert r["engine_kv_bytes"] == int(full * share) and r["repeats"] == 2
    # 1/4 cannot hold one request: no engine was started for it, and its rows say why
    for mode in ("recompute", "prefetch"):
        r = by[mode, 0.25]
        assert r["status"] == "unavailable" and "below one request of max_model_len 1,280" in r["reason"], r
    # rounds interleave every engine: round 0 of every (mode, size) before round 1 of any
    ran = [(x["round"], x["mode"], x["engine_kv_share"]) for x in results["runs"] if x["status"] == "ok"]
    assert ran == [(k, m, s) for k in (0, 1) for s in (1.0, 0.5) for m in ("recompute", "prefetch")]
    # the conversations' later turns reuse what their first computed: vLLM alone finds it in its own KV cache at
    # full size; at 1/2 one conversation's turn evicts the other's prefix, and kvprefetch loads it from its tiers
    assert by["recompute", 1.0]["hit_ratio"] > 0 and by["recompute", 1.0]["loaded_chunks"] == 0
    assert by["prefetch", 0.5]["loaded_chunks"] > 0
    md = (tmp_path / "out" / "report.md").read_text()
    assert "## Engine memory (the whitepaper's R5)" in md
    assert f"| prefetch | 2 | {full / 2 / 2**20:,.0f} MiB | 0.5 |" in md
    assert (tmp_path / "out" / "engine_memory.png").stat().st_size > 0
