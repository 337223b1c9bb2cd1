"""What the scheduler-side connector tells the workers each step, and what the workers report back.

Plain dataclasses of ints and bytes: vLLM pickles them between processes when the executor is multi-process.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from kvprefetch.vllm.compat import KVConnectorMetadata, KVConnectorWorkerMetadata


@dataclass
class LoadJob:
    """Copy chunks from the store into blocks ``block_ids[i]`` (per chunk; -1 = block already there). Tensor-
    parallel rank r copies its own part of chunk i, stored under ``keys[r][i]``."""

    req_id: str
    keys: list[list[bytes]]
    block_ids: list[list[int]]
    is_async: bool  # True: load between steps, report via get_finished; False: this step, layer by layer
    cancelled: bool = False  # the request finished first: copy nothing, just report it finished
    # Async: the scheduler's process is reading the chunks into DRAM (prefetch): wait for them to appear there
    # until the scheduler reports its reads settled, instead of reading them a second time.
    awaits_prefetch: bool = False
    on_disk: int = 0  # chunks that were below DRAM when planned (sync mode: the worker reads them itself)

    @property
    def num_chunks(self) -> int:
        return len(self.block_ids)


@dataclass
class SaveJob:
    """Copy whole chunks out of blocks ``block_ids[i]`` and put them into the store; rank r's part of chunk i
    goes under ``keys[r][i]``."""

    job_id: int
    req_id: str
    keys: list[list[bytes]]
    block_ids: list[list[int]]
    write_back: bool = True  # False: into DRAM only (save_policy probation, a prefix seen once)


@dataclass
class KVPrefetchMetadata(KVConnectorMetadata):
    loads: list[LoadJob] = field(default_factory=list)
    saves: list[SaveJob] = field(default_factory=list)
    # Finished requests whose blocks the scheduler holds until their saves are done (request_finished -> True).
    await_saves: list[str] = field(default_factory=list)
    # Requests preempted this step: their blocks may be reused, so in-flight saves from them must finish first.
    preempted: list[str] = field(default_factory=list)
    step_tokens: int = 0  # tokens this step computes (the worker times the forward: prefill speed)
    # Async loads whose scheduler-side reads are all done (arrived or failed): stop waiting, read what's missing.
    settled: list[str] = field(default_factory=list)
    # Async loads of requests that finished first: stop copying.
    cancel_loads: list[str] = field(default_factory=list)
    # Async loads past their request's deadline (`SchedulerSide._release_late_loads`): report them finished now,
    # the chunks not copied yet as load errors (vLLM computes them), and copy nothing more.
    release_loads: list[str] = field(default_factory=list)

    def is_empty(self) -> bool:
        return not (self.loads or self.saves or self.await_saves or self.preempted or self.settled
                    or self.cancel_loads or self.release_loads)


@dataclass
class KVPrefetchWorkerMeta(KVConnectorWorkerMetadata):
    """Per step, from each worker (vLLM aggregates the workers' records): save jobs whose source blocks are no
    longer needed (count of workers done), the rates the cost model learns from, and per-rank counts."""

    saves_done: dict[int, int] = field(default_factory=dict)
    load_bytes: int = 0
    load_seconds: float = 0.0
    step_tokens: int = 0
    forward_seconds: float = 0.0
    disk_bytes: int = 0  # chunks the worker read from below DRAM itself (sync mode), and the time it took
    disk_seconds: float = 0.0
    ranks: dict[int, dict[str, int]] = field(default_factory=dict)  # rank -> RANK_COUNTERS increments

    def is_empty(self) -> bool:
        return not (self.saves_done or self.load_bytes or self.step_tokens or self.disk_bytes or self.ranks)

    def aggregate(self, other: KVConnectorWorkerMetadata) -> KVConnectorWorkerMetadata:
        assert isinstance(other, KVPrefetchWorkerMeta)
        out = KVPrefetchWorkerMeta(
            dict(self.saves_done), self.load_bytes, self.load_seconds, self.step_tokens, self.forward_seconds,
            self.disk_bytes, self.disk_seconds, {r: dict(v) for r, v in self.ranks.items()},
        )
        for k, v in other.saves_done.items():
            out.saves_done[k] = out.saves_done.get(k, 0) + v
        out.load_bytes += other.load_bytes
        out.load_seconds = max(out.load_seconds, other.load_seconds)
        out.forward_seconds = max(out.forward_seconds, other.forward_seconds)
        out.disk_bytes += other.disk_bytes
        out.disk_seconds = max(out.disk_seconds, other.disk_seconds)
        for r, values in other.ranks.items():
            mine = out.ranks.setdefault(r, {})
            for name, n in values.items():
                mine[name] = mine.get(name, 0) + n
        return out
