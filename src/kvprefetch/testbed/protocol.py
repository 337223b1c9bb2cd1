"""What crosses the boundary between a benchmark (or test) process and the engine process it drives
(`kvprefetch.testbed.engine_proc`): the engine's spec, each op's request, and the replies the caller reads.

One protocol for the bench and the tests. Every message is a pydantic model on both sides: a field renamed in
one place fails validation at once (naming the field) instead of reading as a missing key deep in a run. The
spec travels as the engine process's argument; a request travels as one JSON line on its stdin, tagged with
its op; replies come back as one line each on stdout behind `MARK` (vLLM logs to the same streams).

A reply that a report stores as it is (a cell's records and counters, a calibration) stays a plain dict: the
results file types that side (`kvprefetch.results`); the replies the caller decides on are models here.
"""

from __future__ import annotations

import json
from typing import Any, ClassVar, Literal

from pydantic import BaseModel, ConfigDict

MARK = "@@KVB "


class _Wire(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


# ---- the engine ---------------------------------------------------------------------------------------------
class Placement(_Wire):
    """A GPU node's division of labour on a CPU machine (`kvprefetch.testbed.topology`): the model's forward on
    `model_cpus`, everything else (client, scheduler, connector threads) on `host_cpus`."""

    model_cpus: list[int]
    host_cpus: list[int]
    # the model in this process (vLLM's in-process executor), the whole process on host_cpus: a node that is one
    # core, with no worker process whose shared-memory queue busy-polls that core between steps
    inproc: bool = False


class ProcessSpec(_Wire):
    """Where and in what the engine process runs, set up before vLLM is imported."""

    cgroup: str | None = None  # the process joins this cgroup (v1 blkio) before anything starts
    netns: str | None = None  # ... and this network namespace (`kvprefetch.testbed.netns`)
    env: dict[str, str] = {}  # set in the engine process before vLLM is imported
    topology: Placement | None = None  # None: every thread on every core


class EngineSpec(_Wire):
    """One vLLM engine as the engine process builds it. `engine_args` passes further vLLM `EngineArgs` through
    as given (vLLM validates them); the fields here are the ones the bench and the tests decide."""

    model: str
    max_model_len: int = 8192
    kv_cache_bytes: int = 256 << 20
    max_num_seqs: int = 4
    max_num_batched_tokens: int = 8192
    dtype: str = "auto"
    load_format: str | None = None
    model_loader_extra_config: dict[str, Any] | None = None
    enable_prefix_caching: bool = True
    engine_args: dict[str, Any] = {}
    kv_transfer_config: dict[str, Any] | None = None
    process: ProcessSpec = ProcessSpec()

    @property
    def tensor_parallel_size(self) -> int:
        return int(self.engine_args.get("tensor_parallel_size", 1))


# ---- replies --------------------------------------------------------------------------------------------------
class _Reply(BaseModel):
    model_config = ConfigDict(extra="ignore", frozen=True)


class KeysReply(_Reply):
    keys: list[list[str]]  # keys[rank][i]: chunk i's key on each tensor-parallel rank, in hex (MLA: one list, every
    # rank's)


class GeometryReply(_Reply):
    """The engine's chunk as its connector uses it (every field None: no kvprefetch connector in the engine).
    `chunk_tokens` is the effective chunk size (`ConnectorSpec.chunk_tokens`: the configured one as whole KV
    blocks), the one to compute per-chunk figures from; `chunk_tokens_configured` is what the config asked."""

    chunk_bytes: int | None  # a chunk's bytes over every tensor-parallel rank (each rank stores its own part, or
    # one copy for all of them where every rank holds the same KV: MLA)
    tp_size: int | None
    chunk_tokens: int | None
    block_size: int | None
    chunk_tokens_configured: int | None = None
    # the kind of each of the engine's KV cache groups, as the connector serves them (one unless vLLM's hybrid KV
    # cache manager is on and the model mixes kinds of attention)
    kv_cache_groups: list[str] | None = None


class Bandwidth(_Reply):
    chunks: int
    bytes: int
    seconds: float
    bps: float | None


class Preloaded(_Reply):
    chunks: int
    in_dram: int
    seconds: float


class Seeded(_Reply):
    chunks: int
    written: int
    seconds: float


class ResetReply(_Reply):
    reset: bool


class Flushed(_Reply):
    flushed: bool


class Completion(_Reply):
    token_ids: list[int]
    logprobs: list[float]
    ttft: float | None = None


class Generated(_Reply):
    outputs: list[Completion]
    wall_s: float
    prefetches_landed: bool | None = None


class Warmed(_Reply):
    warm: dict[str, Any] | None
    now: dict[str, Any] | None
    leases: dict[str, Any] | None


class CountersReply(_Reply):
    """This process's connectors' counters (`kvprefetch.vllm.metrics.snapshot_all`), each role's store stats,
    the cost model's estimates, the per-rank stats; and `store`, the stores' stats summed over every process."""

    counters: dict[str, Any] = {}
    stores: dict[str, Any] = {}
    cost: dict[str, Any] | None = None
    ranks: dict[str, Any] | None = None
    store: dict[str, Any] = {}


class Calibration(_Reply):
    """The figures the bench decides on in a calibration's reply (`kvprefetch.testbed.probes.calibrate`); the
    reply itself is stored as it came (results.json's populate.calibration and mode_calibrations)."""

    prefill_tokens_per_s: float
    decode_step_s: float | None = None
    foreign_cpu_cores: float | None = None


class Done(_Reply):
    """The serve protocol: one request finished (its record)."""

    event: Literal["done"]
    rec: dict[str, Any]


class Served(_Reply):
    """The serve protocol's last message, after `End`: the engine's counters around the cell."""

    served: Literal[True]
    foreign_cpu_cores: float | None = None
    before: dict[str, Any] = {}
    after: dict[str, Any] = {}


def serve_message(msg: dict) -> Done | Served:
    return Done.model_validate(msg) if "event" in msg else Served.model_validate(msg)


# ---- requests -------------------------------------------------------------------------------------------------
class Request(_Wire):
    """One op. `reply` is the model its answer is read into (dict: kept as the engine sent it)."""

    op: ClassVar[str]
    reply: ClassVar[type[BaseModel] | None] = None


class Warmup(Request):
    op = "warmup"
    n: int
    tokens: int
    vocab: int


class Calibrate(Request):
    """The engine's prefill and decode speeds (`kvprefetch.testbed.probes.calibrate`); the reply is stored as is."""

    op = "calibrate"
    prompt_tokens: int
    repeats: int
    decode_tokens: int
    vocab: int
    seed: int | None = None


class Run(Request):
    """One level (or the prelude) of a workload file, driven at its arrival times."""

    op = "run"
    file: str
    level: int | Literal["prelude"]
    concurrency: int
    tag: str
    timeout_s: float = 1800
    flush: bool = False  # wait for every save afterwards (the prelude: its KV must be on disk)
    record_steps: bool = False
    salt: int = 0  # every prompt's first token changed by it (a workload without reuse, a later round)
    agent: bool = False  # the agent client's warm-up calls and lease samples
    warm_ttl_s: float | None = None  # the warm mode's warm-up calls (None: no calls)
    pressure_life_s: float | None = None  # the DRAM pressure (`kvprefetch.testbed.pressure`)
    only: list[str] | None = None  # run only these sessions (by sid) of the level or prelude


class Serve(Request):
    """Requests pushed one by one (`Add`) until `End` (the two-instance scenario)."""

    op = "serve"
    file: str
    level: int
    tag: str
    t0: float


class Add(Request):
    op = "add"
    i: int
    k: int
    arrival: float


class End(Request):
    op = "end"


class PromptIdentity(_Wire):
    """What a prompt is beyond its tokens, as a completion names it (the identity tests): a LoRA adapter (its name
    and directory), a cache salt, prompt embeddings (a safetensors file whose tensor "embeds" is the prompt: its
    tokens are then unused), an image (a file vLLM's processor reads; the prompt's tokens hold its placeholders)."""

    lora_name: str | None = None
    lora_path: str | None = None
    cache_salt: str | None = None
    embeds_file: str | None = None
    image_file: str | None = None


class Generate(Request):
    """Greedy completions with their logprobs (the exactness tests); `identities[i]`: prompt i's, if any."""

    op = "generate"
    reply = Generated
    prompts: list[list[int]]
    max_tokens: int = 8
    max_tokens_each: list[int] | None = None
    hold_until_prefetched: bool = False  # every request queued and every prefetch landed before the first step
    identities: list[PromptIdentity | None] | None = None
    transfer_params: list[dict[str, Any] | None] | None = None  # prompt i's kv_transfer_params, if any


class Warm(Request):
    """The warm-up API in-process (what POST /v1/kvprefetch/warm calls); `wait`: seconds to wait until the
    lease's chunks are all in DRAM."""

    op = "warm"
    reply = Warmed
    tokens: list[int]
    ttl_s: float = 30.0
    wait: float = 0.0
    identity: PromptIdentity | None = None  # (its adapter and cache salt)


class DiskBandwidth(Request):
    op = "disk_bandwidth"
    reply = Bandwidth
    max_chunks: int = 256
    seconds: float = 10.0
    rate_limit_bps: int | None = None
    threads: int | None = None
    stream_bps: float | None = None


class StreamLimit(Request):
    op = "stream_limit"
    bps: float | None


class SeedRemote(Request):
    op = "seed_remote"
    reply = Seeded
    src: str


class PreloadDram(Request):
    op = "preload_dram"
    reply = Preloaded
    max_chunks: int | None = None


class Geometry(Request):
    op = "geometry"
    reply = GeometryReply


class ChunkKeys(Request):
    """The scheduler connector's chunk keys of the whole chunks of `tokens`, every rank's (where a test finds a
    prompt's chunks in the tiers)."""

    op = "chunk_keys"
    reply = KeysReply
    tokens: list[int]


class Reset(Request):
    op = "reset"
    reply = ResetReply


class Flush(Request):
    op = "flush"
    reply = Flushed


class CoolDram(Request):
    op = "cool_dram"


class Counters(Request):
    op = "counters"
    reply = CountersReply


class Placements(Request):
    op = "placement"


class Exit(Request):
    op = "exit"


REQUESTS: dict[str, type[Request]] = {
    r.op: r
    for r in (Warmup, Calibrate, Run, Serve, Add, End, Generate, Warm, DiskBandwidth, StreamLimit, SeedRemote,
              PreloadDram, Geometry, ChunkKeys, Reset, Flush, CoolDram, Counters, Placements, Exit)
}  # fmt: skip


def encode(req: Request) -> str:
    """One request line (its op beside its fields)."""
    return json.dumps({"op": req.op, **req.model_dump(mode="json")})


def decode(line: str) -> Request:
    """A request line back into its model; ValueError names an unknown op or a bad field."""
    raw = json.loads(line)
    op = raw.pop("op", None)
    if op not in REQUESTS:
        raise ValueError(f"unknown op {op!r}")
    return REQUESTS[op].model_validate(raw)
