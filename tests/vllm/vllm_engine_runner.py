"""A vLLM CPU engine in its own process, driven by JSON lines on stdin (used by the tests and the TTFT bench).

    python engine_runner.py '<json engine spec>'

Replies are printed as one line each, prefixed with ``@@KVP `` (vLLM logs to the same streams). The engine
runs in-process (VLLM_ENABLE_V1_MULTIPROCESSING=0) so the connector's counters are readable here.
"""

from __future__ import annotations

import contextlib
import glob
import json
import os
import sys
import time

MARK = "@@KVP "


def make_model(path: str, layers: int = 4, hidden: int = 256, heads: int = 4, kv_heads: int = 2, seed: int = 0):
    """A small random Llama checkpoint (float32 safetensors): real, non-uniform logits, fast on a CPU."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    cfg = LlamaConfig(
        vocab_size=2048,
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        head_dim=hidden // heads,
        max_position_embeddings=8192,
        initializer_range=0.02,
        torch_dtype="float32",
    )
    LlamaForCausalLM(cfg).to(torch.float32).save_pretrained(path, safe_serialization=True)


def _flush_connectors(_worker=None) -> bool:
    """Wait for every write-back of this process's connectors (also run on each worker via collective_rpc)."""
    from kvprefetch.vllm.connector import live_connectors

    return all(c.flush(timeout=60) for c in live_connectors())


def _reply(obj) -> None:
    sys.stdout.write(MARK + json.dumps(obj) + "\n")
    sys.stdout.flush()


def main() -> None:
    spec = json.loads(sys.argv[1])
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    from kvprefetch.vllm.cpu import tp_cpu_env

    os.environ.update(tp_cpu_env(int((spec.get("engine_args") or {}).get("tensor_parallel_size", 1))))
    from vllm import LLM, SamplingParams

    kwargs = dict(
        model=spec["model"],
        skip_tokenizer_init=True,
        dtype="float32",
        max_model_len=spec.get("max_model_len", 8192),
        enforce_eager=True,
        kv_cache_memory_bytes=spec.get("kv_cache_bytes", 256 << 20),
        max_num_seqs=spec.get("max_num_seqs", 4),
        max_num_batched_tokens=spec.get("max_num_batched_tokens", 8192),
        enable_prefix_caching=spec.get("prefix_caching", False),
        seed=0,
    )
    if spec.get("kv_transfer_config"):
        kwargs["kv_transfer_config"] = spec["kv_transfer_config"]
    if spec.get("load_format"):
        from kvprefetch.loader.vllm_loader import register

        register()  # what the vllm.general_plugins entry point does (explicit: the test venv may predate it)
        kwargs["load_format"] = spec["load_format"]
        kwargs["model_loader_extra_config"] = spec.get("model_loader_extra_config", {})
    kwargs.update(spec.get("engine_args") or {})  # e.g. tensor_parallel_size
    shm_before = set(glob.glob("/dev/shm/vllm_dist_*"))
    llm = LLM(**kwargs)
    # vLLM's CPU build leaves its TP>1 shared-memory segments behind when the process ends: remove this
    # engine's (created while it started) at exit.
    shm_mine = set(glob.glob("/dev/shm/vllm_dist_*")) - shm_before
    _reply({"ready": True})
    for line in sys.stdin:
        cmd = json.loads(line)
        op = cmd["op"]
        if op == "generate":
            sp = SamplingParams(max_tokens=cmd.get("max_tokens", 8), temperature=0.0, logprobs=1, ignore_eos=True)
            sps = [sp] * len(cmd["prompts"])
            if cmd.get("max_tokens_each"):
                sps = [
                    SamplingParams(max_tokens=m, temperature=0.0, logprobs=1, ignore_eos=True)
                    for m in cmd["max_tokens_each"]
                ]
            t0 = time.perf_counter()
            prompts = [{"prompt_token_ids": p} for p in cmd["prompts"]]
            if cmd.get("hold_until_prefetched"):
                # Every request arrives (its prefetch starts) before the engine takes a step, and the engine
                # waits until every read into DRAM has finished: whether a queued request's chunks are in DRAM
                # when the scheduler reaches it is then certain, not a race.
                from kvprefetch.vllm.connector import live_connectors

                llm.enqueue(prompts, sps, use_tqdm=False)
                landed = all(c.wait_for_prefetches(timeout=120) for c in live_connectors())
                outs = llm.wait_for_completion(use_tqdm=False)
            else:
                landed = None
                outs = llm.generate(prompts, sps, use_tqdm=False)
            wall = time.perf_counter() - t0
            res = []
            for o in outs:
                c = o.outputs[0]
                lps = [float(d[t].logprob) for t, d in zip(c.token_ids, c.logprobs or [], strict=False)]
                m = getattr(o, "metrics", None)
                ttft = getattr(m, "first_token_latency", None) if m is not None else None
                res.append({"token_ids": list(c.token_ids), "logprobs": lps, "ttft": ttft})
            _reply({"outputs": res, "wall_s": wall, "prefetches_landed": landed})
        elif op == "counters":
            from kvprefetch.vllm.connector import live_connectors
            from kvprefetch.vllm.metrics import snapshot_all

            stores, cost, ranks = {}, None, None
            for c in live_connectors():
                if c.store is not None:
                    stores[c.counters.role] = c.store.stats().get("store")
                cost = c.cost_snapshot() or cost
                ranks = c.rank_stats() or ranks
            _reply({"counters": snapshot_all(), "stores": stores, "cost": cost, "ranks": ranks})
        elif op == "warm":
            # The warm-up API in-process (what POST /v1/kvprefetch/warm calls); "wait": until the lease's chunks
            # are all in DRAM (or the timeout), so that a test knows where the next request finds them.
            from kvprefetch.vllm.connector import live_connectors

            sched = next(c for c in live_connectors() if c.is_scheduler)
            counts = sched.warm(cmd["tokens"], cmd.get("ttl_s", 30.0))
            now = counts
            deadline = time.monotonic() + cmd.get("wait", 0)
            while now is not None and now.in_dram < now.chunks and time.monotonic() < deadline:
                time.sleep(0.01)
                now = sched.warm_status(counts.id)
            _reply({"warm": counts.as_json(), "now": now.as_json() if now else None, "leases": sched.lease_stats()})
        elif op == "flush":
            # Every write-back finished: this process's connectors' and, with TP > 1, the worker processes'.
            ok = _flush_connectors() and all(llm.collective_rpc(_flush_connectors))
            _reply({"flushed": ok})
        elif op == "exit":
            _reply({"bye": True})
            break
    del llm
    for f in shm_mine:
        with contextlib.suppress(OSError):
            os.unlink(f)
    os._exit(0)  # skip interpreter teardown of the engine's threads


if __name__ == "__main__":
    main()
