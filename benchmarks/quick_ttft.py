"""Quick TTFT comparison: vLLM alone (recompute) against kvprefetch's load modes, one run, same engine settings.

    python benchmarks/quick_ttft.py                 # ~5 minutes on 2 CPU cores
    python benchmarks/quick_ttft.py --modes recompute,prefetch --sessions 8 --json out.json

Workload: synthetic multi-turn chat (``kvprefetch.workload.generate_chat``: a shared system prompt, each turn
appends the previous answer and a new user message). A closed loop keeps ``--concurrency`` requests in flight
and starts a session's next turn once its previous one is done, cycling through the sessions; the engine runs
``--max-num-seqs`` of them at once and the rest wait in its queue (the time prefetch turns into reads). The history
of all sessions (``--sessions`` x ~``turns`` x ``user_tokens``) is far larger than the engine's own KV cache
(``--engine-kv-mib``) and the DRAM tier (``--dram-mib``): later turns find their history on disk. Disk reads are
capped at ``--disk-mbps`` (the store's ``io.read_rate_limit_bps``) to put storage in a known regime.

Modes (each a fresh engine, a fresh disk directory and a fresh DRAM pool):

* ``recompute``: vLLM alone with its prefix cache (no connector);
* ``ondemand``: kvprefetch, prefetch off, async loads (reads start when the scheduler reaches the request);
* ``ondemand-sync``: kvprefetch, prefetch off, ``load_mode: sync`` (the engine step waits for the reads);
* ``prefetch``: kvprefetch, prefetch on arrival, async loads.

Reported per mode (pooled over ``--repeats`` interleaved rounds): median and p90 TTFT of the turns that reuse
history (turn >= 1), median TTFT of first turns, the run's wall time (median over rounds), and the connector's
counters and cost-model state. First turns share only the system prompt, but they queue behind later turns, so
their TTFT moves with the whole run; for the overhead on misses alone run ``--turns 1`` (no reuse at all).
The machine's load average is printed with every round: other processes on a small machine move these numbers.
The model is a small random-weight Llama (float32) written once to ``--model-dir``; pass ``--model PATH`` for
a real checkpoint.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

MODES = ("recompute", "ondemand", "ondemand-sync", "prefetch")
MARK = "@@QUICK_TTFT "


# ---- the engine child ---------------------------------------------------------------------------------------
def make_model(path: Path, layers: int, hidden: int, vocab: int) -> None:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    heads = max(1, hidden // 64)
    cfg = LlamaConfig(
        vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers,
        num_attention_heads=heads, num_key_value_heads=max(1, heads // 2), head_dim=64,
        max_position_embeddings=16384, torch_dtype="float32",
    )
    LlamaForCausalLM(cfg).to(torch.float32).save_pretrained(str(path), safe_serialization=True)


def run_child(spec: dict) -> dict:
    """One mode: start the engine, run the closed loop, return per-request TTFTs and the connector's state."""
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # in-process engine core: the counters are readable here
    from kvprefetch.workload import ChatWorkload, generate_chat
    from vllm import LLM, SamplingParams

    kwargs = dict(
        model=spec["model"], skip_tokenizer_init=True, dtype="float32", max_model_len=spec["max_model_len"],
        enforce_eager=True, kv_cache_memory_bytes=spec["engine_kv_bytes"], max_num_seqs=spec["max_num_seqs"],
        max_num_batched_tokens=spec["max_num_batched_tokens"], enable_prefix_caching=True, seed=0,
    )
    if spec.get("kv_transfer_config"):
        kwargs["kv_transfer_config"] = spec["kv_transfer_config"]
    t_start = time.perf_counter()
    llm = LLM(**kwargs)
    startup_s = time.perf_counter() - t_start
    engine = llm.llm_engine
    # Warm-up (kernels, allocator, the connector's prefill-speed estimate) on tokens the workload never uses.
    import random

    rng = random.Random(12345)
    n_warm = min(768, spec["max_model_len"] - 8)  # a short workload's max_model_len can be below 768
    warm = [{"prompt_token_ids": [rng.randrange(4, spec["vocab"]) for _ in range(n_warm)]} for _ in range(2)]
    llm.generate(warm, SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True), use_tqdm=False)
    w = spec["workload"]
    reqs = generate_chat(ChatWorkload(
        sessions=w["sessions"], turns=w["turns"], system_tokens=w["system_tokens"],
        first_user_tokens=w["first_user_tokens"], user_tokens=w["user_tokens"], output_tokens=w["output_tokens"],
        think_s=0.0, jitter=0.0, seed=w["seed"], concurrency=spec["concurrency"],
    ))
    vocab = spec["vocab"]
    # Turn-major order: every session's turn t before any session's turn t+1, so a session comes back only after
    # all the others have pushed its history out of the engine's KV cache.
    order = sorted(reqs, key=lambda r: (r.turn, r.session_id))
    done_turn = {r.session_id: -1 for r in reqs}
    queue = list(order)
    inflight: dict[str, tuple] = {}
    results = []
    steps = 0
    step_s: list[float] = []
    t0 = time.perf_counter()
    while queue or inflight:
        while len(inflight) < spec["concurrency"]:
            nxt = next((r for r in queue if done_turn[r.session_id] == r.turn - 1), None)
            if nxt is None:
                break
            queue.remove(nxt)
            rid = f"s{nxt.session_id}t{nxt.turn}"
            sp = SamplingParams(max_tokens=nxt.output_len, temperature=0.0, ignore_eos=True)
            prompt = {"prompt_token_ids": [int(t) for t in nxt.token_ids(vocab)]}
            inflight[rid] = (nxt, time.perf_counter(), None)
            engine.add_request(rid, prompt, sp)
        steps += 1
        t_step = time.perf_counter()
        outs = engine.step()
        step_s.append(time.perf_counter() - t_step)
        for out in outs:
            rid = out.request_id
            if rid not in inflight:
                continue
            r, t_sub, ttft = inflight[rid]
            if ttft is None and out.outputs and out.outputs[0].token_ids:
                ttft = time.perf_counter() - t_sub
                inflight[rid] = (r, t_sub, ttft)
            if out.finished:
                del inflight[rid]
                done_turn[r.session_id] = r.turn
                results.append({"session": r.session_id, "turn": r.turn, "prompt_tokens": r.input_len,
                                "ttft_s": ttft, "e2e_s": time.perf_counter() - t_sub})
    wall = time.perf_counter() - t0
    counters = cost = store = None
    if spec.get("kv_transfer_config"):
        from kvprefetch.vllm.connector import live_connectors
        from kvprefetch.vllm.metrics import snapshot_all

        counters = {k: v for k, v in snapshot_all().items() if v}
        for c in live_connectors():
            cost = c.cost_snapshot() or cost
            if c.counters.role == "scheduler" and c.store is not None:
                store = c.store.stats().get("store")
                # the pool is this mode's alone, and a named shm pool outlives its process: unlink it (the mapping
                # stays valid until this child exits)
                c.store.dram.path.unlink(missing_ok=True)
    return {"results": results, "wall_s": wall, "startup_s": startup_s, "steps": steps,
            "step_s_max": max(step_s, default=0.0), "step_s_sum": sum(step_s), "counters": counters, "cost": cost,
            "store": store}


# ---- the driver ---------------------------------------------------------------------------------------------
def connector(args, mode: str, disk: Path) -> dict:
    extra = {
        "chunk_tokens": args.chunk_tokens,
        "prefetch": mode == "prefetch",
        "load_mode": "sync" if mode == "ondemand-sync" else "async",
        "dram": {"capacity_bytes": args.dram_mib << 20, "pool_name": f"quickttft-{uuid.uuid4().hex[:8]}"},
        "disk": {"path": str(disk), "capacity_bytes": 8 << 30},
        "io": {"read_rate_limit_bps": int(args.disk_mbps * 1e6)},
        "log_interval_s": 0,
    }
    extra.update(json.loads(args.connector_extra or "{}"))
    return {"kv_connector": "KVPrefetchConnector", "kv_connector_module_path": "kvprefetch.vllm",
            "kv_role": "kv_both", "kv_connector_extra_config": extra}


def pct(xs: list[float], q: float) -> float | None:
    if not xs:
        return None
    xs = sorted(xs)
    return xs[min(len(xs) - 1, round(q * (len(xs) - 1)))]


def summarize(mode: str, runs: list[dict]) -> dict:
    """Pooled over the mode's rounds; counters and cost model from its last round."""
    results = [r for res in runs for r in res["results"]]
    reuse = [r["ttft_s"] for r in results if r["turn"] >= 1 and r["ttft_s"] is not None]
    first = [r["ttft_s"] for r in results if r["turn"] == 0 and r["ttft_s"] is not None]
    return {
        "mode": mode,
        "rounds": len(runs),
        "requests": len(results),
        "ttft_p50_reuse_s": statistics.median(reuse) if reuse else None,
        "ttft_p90_reuse_s": pct(reuse, 0.9),
        "ttft_p50_first_turn_s": statistics.median(first) if first else None,
        "wall_s": statistics.median(res["wall_s"] for res in runs),
        "counters": runs[-1]["counters"],
        "cost": runs[-1]["cost"],
    }


def _s(x: float | None) -> str:
    return "-" if x is None else f"{x:.3f}s"


def _ratio(a: float | None, b: float | None) -> str:
    return "-" if not a or not b else f"{a / b:.2f}x"


def load_avg() -> str:
    try:
        return " ".join(Path("/proc/loadavg").read_text().split()[:3])
    except OSError:
        return "?"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--modes", default=",".join(MODES), help=f"comma-separated subset of {','.join(MODES)}")
    ap.add_argument("--model", help="a checkpoint directory (default: a random-weight Llama in --model-dir)")
    ap.add_argument("--model-dir", default=str(Path(tempfile.gettempdir()) / "kvprefetch-quick-ttft-model"))
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--vocab", type=int, default=2048)
    ap.add_argument("--sessions", type=int, default=12)
    ap.add_argument("--turns", type=int, default=4)
    ap.add_argument("--system-tokens", type=int, default=256)
    ap.add_argument("--first-user-tokens", type=int, default=1024)
    ap.add_argument("--user-tokens", type=int, default=384)
    ap.add_argument("--output-tokens", type=int, default=8)
    ap.add_argument("--concurrency", type=int, default=6, help="requests the client keeps in flight")
    ap.add_argument("--max-num-seqs", type=int, default=2, help="requests the engine runs at once (the rest queue)")
    ap.add_argument("--engine-kv-mib", type=int, default=96, help="the engine's own KV cache")
    ap.add_argument("--dram-mib", type=int, default=192, help="kvprefetch's DRAM tier")
    ap.add_argument("--disk-mbps", type=float, default=400.0, help="disk read cap (MB/s)")
    ap.add_argument("--chunk-tokens", type=int, default=256)
    ap.add_argument("--max-num-batched-tokens", type=int, default=2048)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--repeats", type=int, default=1, help="interleaved rounds per mode (pooled)")
    ap.add_argument("--connector-extra", help='JSON merged into the connector extra config, e.g. {"save": false}')
    ap.add_argument("--json", help="write the summary rows (and raw per-request results) here")
    ap.add_argument("--child", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        res = run_child(json.loads(args.child))
        sys.stdout.write(MARK + json.dumps(res) + "\n")
        sys.stdout.flush()
        os._exit(0)  # skip the engine's thread teardown

    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    for m in modes:
        if m not in MODES:
            ap.error(f"unknown mode {m!r}")
    model = args.model
    if model is None:
        model = args.model_dir
        if not Path(model, "config.json").exists():
            print(f"writing a random-weight Llama ({args.layers} layers, hidden {args.hidden}) to {model}")
            make_model(Path(model), args.layers, args.hidden, args.vocab)
    workload = {"sessions": args.sessions, "turns": args.turns, "system_tokens": args.system_tokens,
                "first_user_tokens": args.first_user_tokens, "user_tokens": args.user_tokens,
                "output_tokens": args.output_tokens, "seed": args.seed}
    longest = args.system_tokens + args.first_user_tokens + (args.turns - 1) * (args.user_tokens + args.output_tokens)
    work = Path(tempfile.mkdtemp(prefix="kvprefetch-quick-ttft-"))
    raw: dict[str, list] = {m: [] for m in modes}
    print(f"load before: {load_avg()}  ({os.cpu_count()} CPUs)", flush=True)
    try:
        for rnd in range(args.repeats):
            # Interleaved rounds, every other one in reverse, so drift in the machine's load hits all modes alike.
            for mode in modes if rnd % 2 == 0 else modes[::-1]:
                spec = {
                    "model": model, "vocab": args.vocab, "workload": workload, "concurrency": args.concurrency,
                    "max_num_seqs": args.max_num_seqs, "engine_kv_bytes": args.engine_kv_mib << 20,
                    "max_num_batched_tokens": args.max_num_batched_tokens,
                    "max_model_len": longest + args.output_tokens + 64,
                }
                if mode != "recompute":
                    spec["kv_transfer_config"] = connector(args, mode, work / f"disk-{mode}-{rnd}")
                log = work / f"{mode}-{rnd}.log"
                t0 = time.perf_counter()
                with open(log, "w") as fh:
                    p = subprocess.run([sys.executable, __file__, "--child", json.dumps(spec)],
                                       stdout=subprocess.PIPE, stderr=fh, text=True,
                                       env=dict(os.environ, PYTHONUNBUFFERED="1"))
                line = next((x for x in p.stdout.splitlines() if x.startswith(MARK)), None)
                if p.returncode != 0 or line is None:
                    tail = "".join(log.read_text().splitlines(True)[-30:])
                    raise SystemExit(f"{mode}: engine failed (exit {p.returncode}); log tail:\n{tail}")
                res = json.loads(line[len(MARK):])
                raw[mode].append(res)
                row = summarize(mode, [res])
                print(f"round {rnd + 1} {mode:14s} ttft p50 reuse {_s(row['ttft_p50_reuse_s'])}, first turn "
                      f"{_s(row['ttft_p50_first_turn_s'])}, wall {row['wall_s']:.1f} s "
                      f"({time.perf_counter() - t0:.0f} s with startup; load {load_avg()})", flush=True)
                shutil.rmtree(work / f"disk-{mode}-{rnd}", ignore_errors=True)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    rows = [summarize(m, raw[m]) for m in modes]
    base = next((r for r in rows if r["mode"] == "recompute"), None)
    print()
    print(f"{'mode':14s} {'TTFT p50 reuse':>15s} {'p90 reuse':>10s} {'TTFT p50 1st':>13s} {'wall':>7s} "
          f"{'vs recompute':>13s} {'1st vs rec':>11s}")
    for r in rows:
        ratio = first_ratio = ""
        if base and r is not base:
            ratio = _ratio(r["ttft_p50_reuse_s"], base["ttft_p50_reuse_s"])
            first_ratio = _ratio(r["ttft_p50_first_turn_s"], base["ttft_p50_first_turn_s"])
        print(f"{r['mode']:14s} {_s(r['ttft_p50_reuse_s']):>15s} {_s(r['ttft_p90_reuse_s']):>10s} "
              f"{_s(r['ttft_p50_first_turn_s']):>13s} {r['wall_s']:6.1f}s {ratio:>13s} {first_ratio:>11s}")
    for r in rows:
        if r["counters"]:
            cost = {k: (float(f"{v:.3g}") if isinstance(v, float) else v) for k, v in r["cost"].items()}
            print(f"\n{r['mode']} counters: {json.dumps(r['counters'])}\n{r['mode']} cost model: {json.dumps(cost)}")
    print(f"\nload after: {load_avg()}")
    if args.json:
        Path(args.json).write_text(json.dumps({"args": vars(args), "rows": rows, "raw": raw}, indent=1))


if __name__ == "__main__":
    main()
