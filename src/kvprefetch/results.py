"""What a `kvprefetch bench` run's results.json holds for its readers: the typed, versioned part of it.

The bench writes results.json (`kvprefetch.bench.runner`); the simulator replays a run from it (`kvprefetch sim
--scenario bench`, `--calibration`) and the report draws from it. The file carries much more (per-run samples,
machine and version details, notes) than the simulator needs; `BenchResults` names the part that readers rely
on, so that a renamed key fails in one place, and the simulator needs nothing of the bench package to read it.
Unknown keys are ignored; a file written by a newer schema than this module knows is refused.

SCHEMA_VERSION counts changes that break a reader; the bench writes it under `SCHEMA_KEY` (the key's name and
its value 1 predate this module, so every results.json the bench has written reads as version 1).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

SCHEMA_KEY = "kvprefetch_bench"
FIRST_VERSION = 1  # a file without the key: runs older than it, all version 1
SCHEMA_VERSION = 2
"""1: the first. 2: `regime.whitepaper_storage_share` left out (the report computes it from the run's levels; a
version-1 file's is still read)."""


class View(BaseModel):
    """A typed read of part of a JSON document: unknown keys ignored (a reader names only what it reads), and
    immutable (a read answers; it does not change what it read)."""

    model_config = ConfigDict(extra="ignore", frozen=True)


class ModelInfo(View):
    vocab_size: int


class MachineInfo(View):
    cpus: int | None = None


class Topology(View):
    """Where the run's threads computed (`kvprefetch.testbed.topology`): `shared`, the connector's threads on the
    model's cores; `gpu-node`, on cores of their own (as host threads beside a GPU's compute)."""

    kind: str = "shared"
    sentence: str | None = None  # where the engines ran, said for the report

    @property
    def separates_io(self) -> bool:
        """The connector's threads ran on cores the model did not compute on."""
        return self.kind == "gpu-node"


class RunConfig(View):
    concurrency: list[int]
    max_num_batched_tokens: int
    max_num_seqs: int = 256
    engine_kv_cache_tokens: int | None = None
    engine_block_tokens: int | None = None
    dram_tier_bytes: int | None = None
    topology: Topology = Topology()


class Regime(View):
    """The storage regime the run obtained, and the populating engine's first speed samples."""

    read_bps: float | None = None
    # The emulated array (`kvprefetch.bench.regime.stream_bps`): reads it takes in flight to reach read_bps, and
    # the parallel modes' reads in flight (absent: storage read at full speed by any reader)
    array_streams: float = 1.0
    io_threads: int | None = None
    chunk_bytes: int
    chunk_tokens: int
    prefill_tokens_per_s: float | None = None
    decode_step_s: float | None = None


class PreludeCounters(View):
    """What the connector did while the prelude populated the store, before any mode ran."""

    helper_cpu_s: float | None = None
    loaded_chunks: float | None = None
    saved_chunks: float | None = None
    bytes_disk_read: float | None = None
    bytes_disk_written: float | None = None


class Populate(View):
    calibration: dict[str, Any] | None = None  # the engine's `calibrate` op, as it answered
    prelude: PreludeCounters = PreludeCounters()


class Row(View):
    """One (mode, concurrency) cell: medians over the run's rounds (`kvprefetch.bench.rounds.aggregate`), and
    what the report reads of it beside the simulator: where it ran (regime, engine KV size), its spread over
    the rounds (`*_min`, `*_max`: absent for one round) and why it did not run."""

    mode: str
    concurrency: int
    status: str = "ok"
    reason: str | None = None  # why a cell did not run (status not "ok")
    regime: Any = None  # the regime asked: R as given (a number or "native"); a sweep's cells name theirs
    engine_kv_bytes: int | None = None  # an engine-memory sweep's cells: the engine's KV cache
    engine_kv_share: int | float | None = None  # ... as a share of the full size (1: the full size)
    repeats: int = 1  # rounds that measured the cell
    ttft_p50_s: float | None = None
    ttft_p50_s_min: float | None = None
    ttft_p50_s_max: float | None = None
    ttft_p90_s: float | None = None
    output_tok_s: float | None = None
    output_tok_s_min: float | None = None
    output_tok_s_max: float | None = None
    hit_ratio: float | None = None  # of prompt tokens: loaded by the connector
    prompt_tokens: float | None = None
    share_computed: float | None = None  # of prompt tokens: computed by the engine
    share_engine: float | None = None  # ... found in the engine's own prefix cache
    helper_cpu_s: float | None = None  # CPU seconds of the connector's threads in the cell
    foreign_cpu_cores: float | None = None  # CPU the machine's other processes took meanwhile, in cores

    def tokens(self, share: float | None) -> int | None:
        """Prompt tokens of the cell in one of its shares."""
        if share is None or self.prompt_tokens is None:
            return None
        return round(float(share) * int(self.prompt_tokens))


class Paired(View):
    """Two cells' figure compared round by round (`kvprefetch.bench.rounds.paired`): the median of the rounds'
    ratios, their range, how many rounds both measured and the verdict ('lower', 'higher', 'tie', 'one round')."""

    ratio: float
    min: float
    max: float
    n: int
    verdict: str

    @classmethod
    def of(cls, paired: dict[str, Any] | None) -> Paired | None:
        """The view of a `paired` answer (None where the cells had no round in common)."""
        return None if paired is None else cls.model_validate(paired)


class BenchResults(View):
    version: int = Field(default=SCHEMA_VERSION, alias=SCHEMA_KEY)
    model: ModelInfo
    machine: MachineInfo = MachineInfo()
    config: RunConfig
    workload: dict[str, Any]  # every knob that shaped the workload (`kvprefetch.workload.replay`), as declared
    regime: Regime
    populate: Populate = Populate()
    mode_calibrations: dict[str, dict[str, Any]] = Field(default_factory=dict)
    rows: list[Row] = Field(default_factory=list)

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> BenchResults:
        version = data.get(SCHEMA_KEY, FIRST_VERSION)
        if not isinstance(version, int) or version > SCHEMA_VERSION:
            raise ValueError(f"results schema version {version!r}: this kvprefetch reads up to {SCHEMA_VERSION}")
        return cls.model_validate({k: v for k, v in data.items() if v is not None} | {SCHEMA_KEY: version})

    @classmethod
    def load(cls, path: str | Path) -> BenchResults:
        return cls.from_json(json.loads(Path(path).read_text()))

    def engine_calibrations(self) -> dict[str, dict[str, Any]]:
        """Every engine's calibration in the run, by engine: the populating engine's ("populate"), before any mode
        ran, then each simulated mode's engine's, measured after its cells (older runs have only the first)."""
        return {"populate": self.populate.calibration or {}, **self.mode_calibrations}

    def ok_rows(self) -> list[Row]:
        """The cells that ran and measured a TTFT."""
        return [r for r in self.rows if r.status == "ok" and r.ttft_p50_s is not None]
