"""Where the bench's engines run: a GPU node's division of labour, emulated on CPU cores.

On a GPU node the model computes on the accelerator while the host's cores run the client, vLLM's scheduler and
the connector's reads, checksums and copies: overlapping storage with compute costs the model nothing. On a CPU
machine the model computes on the same cores, so an unseparated bench charges every byte the connector moves
to the model's forward pass, a cost no GPU deployment pays. The ``gpu-node`` topology gives the model cores of
its own (vLLM's multiprocess executor, its workers' OpenMP threads bound there: the "accelerator") and the
rest to the host side (the engine's client and scheduler process, and the connector's threads in every process,
through ``io.cpus``). ``shared`` runs everything everywhere, as an unpinned CPU deployment does.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Literal

TopologyKind = Literal["gpu-node", "shared"]
TOPOLOGIES: tuple[TopologyKind, ...] = ("gpu-node", "shared")


@dataclass(frozen=True)
class Topology:
    kind: TopologyKind
    model_cpus: tuple[int, ...] = ()  # the "accelerator": the model's OpenMP threads (gpu-node only)
    host_cpus: tuple[int, ...] = ()  # client, scheduler, connector threads (gpu-node only)
    note: str = ""  # why a gpu-node topology was asked and not obtained

    def spec(self) -> dict | None:
        """The engine child's ``topology`` (`kvprefetch.testbed.engine_proc.place`), or None (shared)."""
        if self.kind != "gpu-node":
            return None
        return {"model_cpus": list(self.model_cpus), "host_cpus": list(self.host_cpus)}

    def io_cpus(self) -> list[int] | None:
        """The connector's threads' cores (the store config's ``io.cpus``)."""
        return list(self.host_cpus) if self.kind == "gpu-node" else None

    def sentence(self) -> str:
        if self.kind == "gpu-node":
            return (f"a GPU node's division of labour: the model computes on core(s) {_cores(self.model_cpus)} "
                    f"(vLLM's multiprocess executor, OpenMP bound there), the client, the scheduler and the "
                    f"connector's threads run on core(s) {_cores(self.host_cpus)}")  # fmt: skip
        return "shared: the model, the scheduler and the connector's threads share every core" + (
            f" ({self.note})" if self.note else ""
        )

    def to_json(self) -> dict:
        return {"kind": self.kind, "model_cpus": list(self.model_cpus), "host_cpus": list(self.host_cpus),
                "note": self.note, "sentence": self.sentence()}  # fmt: skip


def plan_topology(asked: TopologyKind, tp_size: int = 1, cpus: set[int] | None = None) -> Topology:
    """The topology for a run: with ``gpu-node``, a quarter of the cores (at least one) for the host side and
    the rest, at least one per tensor-parallel rank, for the model; too few cores falls back to ``shared``."""
    if asked not in TOPOLOGIES:
        raise ValueError(f"topology must be one of {', '.join(TOPOLOGIES)}, got {asked!r}")
    if asked == "shared":
        return Topology("shared")
    cores = sorted(cpus if cpus is not None else os.sched_getaffinity(0))
    host = max(1, len(cores) // 4)
    if len(cores) - host < tp_size:
        return Topology("shared", note=f"gpu-node needs {tp_size + 1} cores for TP {tp_size}, this process has "
                                       f"{len(cores)}")  # fmt: skip
    return Topology("gpu-node", tuple(cores[:-host]), tuple(cores[-host:]))


def _cores(cpus: tuple[int, ...]) -> str:
    return ",".join(str(c) for c in cpus)
