"""Where the bench's engines run (`kvprefetch.testbed.topology`) and the store's threads' cores (``io.cpus``)."""

from __future__ import annotations

import os
import threading

import pytest

from kvprefetch.io.engine import IOClass, IOEngine
from kvprefetch.testbed.topology import plan_topology


def test_gpu_node_gives_the_host_a_quarter_of_the_cores_and_the_model_the_rest():
    t = plan_topology("gpu-node", cpus={0, 1})
    assert (t.kind, t.model_cpus, t.host_cpus) == ("gpu-node", (0,), (1,))
    t = plan_topology("gpu-node", cpus=set(range(16)))
    assert t.model_cpus == tuple(range(12)) and t.host_cpus == (12, 13, 14, 15)
    assert t.spec() == {"model_cpus": list(range(12)), "host_cpus": [12, 13, 14, 15]}
    assert t.io_cpus() == [12, 13, 14, 15]


def test_too_few_cores_fall_back_to_shared_and_say_why():
    t = plan_topology("gpu-node", cpus={0})
    assert t.kind == "shared" and t.spec() is None and t.io_cpus() is None and "needs 2 cores" in t.note
    t = plan_topology("gpu-node", tp_size=2, cpus={0, 1})  # TP 2 takes both cores for the model
    assert t.kind == "shared" and "TP 2" in t.sentence()
    assert plan_topology("shared", cpus={0, 1}).spec() is None
    with pytest.raises(ValueError, match="topology must be one of"):
        plan_topology("gpu", cpus={0, 1})  # type: ignore[arg-type]


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs two cores to tell a binding from none")
def test_io_threads_run_on_the_configured_cores_whatever_their_creator_is_bound_to():
    first, last = min(os.sched_getaffinity(0)), max(os.sched_getaffinity(0))
    seen: dict[str, set[int]] = {}

    def create() -> None:  # a creator bound elsewhere, as a CPU worker's main thread is (to the model's cores)
        os.sched_setaffinity(0, {first})
        io = IOEngine(threads=2, name="kvprefetch-io-test", cpus=[last])
        try:
            both = threading.Barrier(2, timeout=10)  # one op on each worker: both have started (pinned first)
            tickets = [io.submit("disk", IOClass.DEMAND, both.wait) for _ in range(2)]
            for ticket in tickets:
                ticket.result(10)
            for t in io._threads:
                seen[t.name] = os.sched_getaffinity(t.native_id)
            seen["creator"] = os.sched_getaffinity(0)
        finally:
            io.close()

    t = threading.Thread(target=create)
    t.start()
    t.join()
    assert seen.pop("creator") == {first}
    assert seen and all(cpus == {last} for cpus in seen.values()), seen


def test_a_cell_waits_for_another_engines_polling_to_stop_but_not_for_its_own():
    import time
    from pathlib import Path

    from kvprefetch.bench.lab import ENGINE_SETTLE_S, Lab, Progress
    from kvprefetch.bench.options import BenchOptions, EngineOptions
    from kvprefetch.bench.plan import plan_bench
    from kvprefetch.bench.populate import RunFiles

    plan = plan_bench(BenchOptions(modes=["ondemand", "prefetch"], concurrency=[2],
                                   engine=EngineOptions(topology="gpu-node")))  # fmt: skip
    lab = Lab(plan, RunFiles("t", Path()), Progress(None), print, print)
    assert plan.topology.kind == "gpu-node"

    def settle(mode: str) -> float:
        t0 = time.monotonic()
        lab.settle(mode)
        return time.monotonic() - t0

    assert settle("prefetch") < 0.05  # nothing ran yet
    lab.ran("ondemand")
    assert settle("ondemand") < 0.05  # the levels of one mode follow each other on its own engine
    assert ENGINE_SETTLE_S - 0.1 <= settle("prefetch") <= ENGINE_SETTLE_S + 0.5
    time.sleep(ENGINE_SETTLE_S)  # finished long enough ago
    assert settle("prefetch") < 0.05
