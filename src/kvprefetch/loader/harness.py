"""One weight load into a real vLLM model, in this process: what loadbench times and the exactness tests hash.

    python -m kvprefetch.loader.harness '{"model": DIR, "load_format": "kvprefetch", "extra": {...}}'

Builds the vLLM model for the checkpoint on the CPU (a world of one, no engine: seconds instead of the ~40 s
of an engine start), then runs the loader's `load_weights` alone, timed, and prints one JSON line: seconds,
the process's CPU seconds in that time (all threads, user and kernel), the loader's counters (with its time
split: waits for bytes, vLLM's copies, the reads' span) and its timeline (every block, every wait), and with
"hashes": true a blake3 per parameter (what "byte-identical to the default loader" is checked with). With
"cgroup", the process first joins that cgroup (the bench's read throttle). With "tp": {"rank", "size", "init"}
it is one rank of a tensor-parallel group (one process per rank, the same "init" rendezvous URL), and with
"loads": [{model, load_format, ...}, ...] it runs several loads in turn.
"""

from __future__ import annotations

import atexit
import json
import os
import sys
import tempfile
import time
from pathlib import Path

MARK = "@@LOAD "


def _own_rendezvous() -> str:
    """A world of one's rendezvous file (torch's FileStore), removed when this process exits (one was left in /tmp
    per load)."""
    path = tempfile.mktemp(prefix="kvp-dist-")
    atexit.register(lambda: Path(path).unlink(missing_ok=True))
    return f"file://{path}"


def load_once(model: str, load_format: str, extra: dict | None = None, hashes: bool = False,
              dtype: str = "auto", tp: dict | None = None) -> dict:  # fmt: skip
    import blake3
    import torch
    from vllm.config import set_current_vllm_config
    from vllm.distributed import init_distributed_environment, initialize_model_parallel
    from vllm.distributed.parallel_state import model_parallel_is_initialized
    from vllm.engine.arg_utils import EngineArgs
    from vllm.model_executor.model_loader import get_model_loader
    from vllm.utils.torch_utils import set_default_torch_dtype

    size = tp["size"] if tp else 1
    args = EngineArgs(model=model, skip_tokenizer_init=True, dtype=dtype, enforce_eager=True,
                      load_format=load_format, model_loader_extra_config=extra or {},
                      tensor_parallel_size=size)  # fmt: skip
    cfg = args.create_engine_config()
    with set_current_vllm_config(cfg):
        if not model_parallel_is_initialized():
            rank = tp["rank"] if tp else 0
            rendezvous = tp["init"] if tp else _own_rendezvous()
            os.environ.setdefault("VLLM_DIST_IDENT", os.path.basename(rendezvous))  # as vLLM's CPU worker sets it
            init_distributed_environment(world_size=size, rank=rank, local_rank=rank,
                                         distributed_init_method=rendezvous, backend="gloo")  # fmt: skip
            initialize_model_parallel(size, 1)
        loader = get_model_loader(cfg.load_config)
        with set_default_torch_dtype(cfg.model_config.dtype), torch.device("cpu"):
            model = loader.create_model(vllm_config=cfg, model_config=cfg.model_config)
        cpu0, t0 = os.times(), time.perf_counter()
        loader.load_weights(model, cfg.model_config)
        seconds, cpu1 = time.perf_counter() - t0, os.times()
    cpu_s = (cpu1.user - cpu0.user) + (cpu1.system - cpu0.system)  # every thread of the process, kernel included
    out: dict = {"seconds": seconds, "cpu_s": cpu_s, "load_format": load_format}
    last = getattr(loader, "last_load", None)  # only the kvprefetch loader keeps counters
    if last is not None:
        out["counters"] = last.summary()
        out["timeline"] = last.timeline()
    if hashes:
        out["hashes"] = {
            name: blake3.blake3(p.detach().reshape(-1).contiguous().view(torch.uint8).numpy().tobytes()).hexdigest()
            for name, p in model.state_dict().items()
        }
    return out


def main() -> None:
    spec = json.loads(sys.argv[1])
    if spec.get("cgroup"):
        Path(spec["cgroup"], "cgroup.procs").write_text(str(os.getpid()))
    from kvprefetch.loader.vllm_loader import register

    register()  # as the entry point does in an engine; explicit here so a stale install cannot skip it
    try:
        loads = spec.get("loads") or [spec]  # several loads in one process: one vLLM import, one TP group
        res = [load_once(s["model"], s["load_format"], s.get("extra"), s.get("hashes", False), s.get("dtype", "auto"),
                         spec.get("tp")) for s in loads]  # fmt: skip
        res = res if "loads" in spec else res[0]
    except Exception as err:
        res = {"error": f"{type(err).__name__}: {err}"}
    sys.stdout.write(MARK + json.dumps(res) + "\n")
    sys.stdout.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
