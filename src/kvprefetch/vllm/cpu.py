"""vLLM's CPU build and tensor parallelism: one OpenMP core set per rank.

vLLM's CPU worker binds each tensor-parallel rank's OpenMP threads to ``VLLM_CPU_OMP_THREADS_BIND`` (core sets
separated by ``|``, one per rank); left to itself it wants a NUMA node per rank and refuses ("Not enough
allowed NUMA nodes") on a one-node machine. `tp_cpu_env` splits the cores this process may use evenly.
"""

from __future__ import annotations

import os

OMP_BIND = "VLLM_CPU_OMP_THREADS_BIND"


def omp_threads_bind(tp_size: int, cpus: list[int] | None = None) -> str:
    """``"0|1"`` for two ranks on cores 0 and 1; ``"0-7|8-15"`` for two on sixteen (leftover cores unused)."""
    cores = sorted(cpus if cpus is not None else os.sched_getaffinity(0))
    if tp_size < 1 or len(cores) < tp_size:
        raise ValueError(f"tensor_parallel_size {tp_size} needs {tp_size} cores or more; this process has {len(cores)}")
    per = len(cores) // tp_size
    sets = [cores[r * per : (r + 1) * per] for r in range(tp_size)]
    return "|".join(_ranges(s) for s in sets)


def _ranges(cores: list[int]) -> str:
    out: list[str] = []
    start = prev = cores[0]
    for c in [*cores[1:], None]:
        if c is not None and c == prev + 1:
            prev = c
            continue
        out.append(str(start) if start == prev else f"{start}-{prev}")
        if c is not None:
            start = prev = c
    return ",".join(out)


def tp_cpu_env(tp_size: int, environ: dict[str, str] | None = None) -> dict[str, str]:
    """The variables a CPU engine with ``tp_size`` ranks needs that ``environ`` (default: this process's)
    does not set already: ``VLLM_CPU_OMP_THREADS_BIND`` for TP > 1, else nothing."""
    env = os.environ if environ is None else environ
    if tp_size <= 1 or env.get(OMP_BIND):
        return {}
    return {OMP_BIND: omp_threads_bind(tp_size)}
