"""`kvprefetch soak-serve` (`make soak-serve`): `kvprefetch serve` with every tier (DRAM pool, disk, a Redis shared
tier) held under a multi-turn load for a while, faults injected on a seeded schedule, every answer checked
against vLLM alone, the server's resources sampled for leaks and its /metrics and log read for every fault.

The run: the servers (ours on its own port for the whole run, and vLLM alone beside it), `sessions` conversations
at once (`kvprefetch.bench.soak_load`), the faults one after another (`kvprefetch.bench.soak_faults`), a sampler
(RSS, fds, threads of the server's process tree, /dev/shm, the disk tier's bytes, and the server's counters, every
5 s). What it found is judged and reported by `kvprefetch.bench.soak_report`: one summary line, a table per kind
of fault, summary.json, timeline.png; exit 1 when a check fails.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import random
import time
import uuid
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Annotated, Any

import psutil
import typer

from kvprefetch.bench.modes import remote_section
from kvprefetch.bench.soak_faults import (
    FAULT_KINDS,
    FULL_S,
    LIGHT_KINDS,
    Injector,
    ServedNode,
    fault_schedule,
    own_tmpfs,
)
from kvprefetch.bench.soak_load import Conversation, complete
from kvprefetch.bench.soak_report import (
    Answer,
    FaultRecord,
    MetricSample,
    Sample,
    SoakResult,
    by_condition,
    condition_table,
    count_log_lines,
    plot_timeline,
    stall_table,
)
from kvprefetch.testbed.local_servers import RedisServer
from kvprefetch.testbed.server import OpenAIServer, free_port
from kvprefetch.tiers.dram import SHM_DIR

SAMPLE_S = 5.0
# Each server's model on a core of its own (vLLM binds its OpenMP threads to every core otherwise, and two engines'
# spinning threads then make each other wait whole spin periods: TTFTs of 1 and 2 s on two cores).
OURS_ENV = {"VLLM_CPU_OMP_THREADS_BIND": "0"}
REF_ENV = {"VLLM_CPU_OMP_THREADS_BIND": "1"}
DISK_CAPACITY = 512 << 20  # full at about half of a 900 s run: the full disk (early) bites, growth (late) levels
DISK_FS_BYTES = 600 << 20  # the disk tier's own tmpfs: its capacity and room for files being written
ENGINE_KV_BYTES = 18 << 20  # one 4096-token context and a bit: the sessions' turns come back to the tiers
DRAM_BYTES = 16 << 20  # smaller than the conversations' chunks: turns read the disk tier too


def _tree(pid: int | None) -> list[psutil.Process]:
    if pid is None:
        return []
    try:
        root = psutil.Process(pid)
        return [root, *root.children(recursive=True)]
    except psutil.Error:
        return []


def sample(t: float, life: int, pid: int | None, disk: Path) -> Sample:
    rss = fds = threads = 0
    for p in _tree(pid):
        with contextlib.suppress(psutil.Error):
            rss += p.memory_info().rss
            fds += p.num_fds()
            threads += p.num_threads()
    disk_bytes = 0
    for f in disk.rglob("*.kv") if disk.exists() else []:
        with contextlib.suppress(FileNotFoundError):
            disk_bytes += f.stat().st_size
    return Sample(t, life, rss / 2**20, fds, threads, len(list(SHM_DIR.iterdir())), disk_bytes / 2**20)


@dataclass(frozen=True)
class SoakSettings:
    """What the run is asked for (the command's options): how long the load runs, the seed of the fault schedule
    and the prompts, conversations at once, the fault kinds, how long the disk stays full."""

    seconds: float
    seed: int = 0
    sessions: int = 4
    kinds: tuple[str, ...] = FAULT_KINDS
    full_s: float = FULL_S


class Soak:
    """The run: its servers, its load, its faults, its samples."""

    def __init__(self, settings: SoakSettings, out: Path):
        self.settings, self.out = settings, out
        self.work = out / "work"
        self.mount = self.work / "disk-fs" if "disk_full" in settings.kinds else None
        self.disk = (self.mount or self.work) / "disk"
        self.pool = f"kvpsoak-{uuid.uuid4().hex[:8]}"
        self.result = SoakResult(settings.seconds, settings.kinds, disk_capacity_mb=DISK_CAPACITY / 2**20)
        self.schedule = fault_schedule(settings.seconds, settings.seed, settings.kinds)
        self.conversations = [Conversation(settings.seed * 1000 + k) for k in range(settings.sessions)]
        self.t0 = 0.0

    def _serve_argv(self, redis: RedisServer | None) -> list[str]:
        import sys

        argv = [sys.executable, "-m", "kvprefetch.cli", "serve", "kvprefetch-tiny", "--served-model-name", "tiny",
                "--max-model-len", "4096", "--kv-cache-memory-bytes", str(ENGINE_KV_BYTES),
                "--max-num-seqs", "4"]  # fmt: skip
        if redis is None:
            return [*argv, "--no-connector"]
        remote = remote_section("redis", redis) | {"timeout_s": 1.0, "retry_after_s": 2.0}
        extra = {"tiers": ["dram", "disk", "remote"], "chunk_tokens": 256, "log_interval_s": 0,
                 "dram": {"pool_name": self.pool, "capacity_bytes": DRAM_BYTES, "keep_idle_s": 0},
                 "disk": {"path": str(self.disk), "capacity_bytes": DISK_CAPACITY}, "remote": remote}  # fmt: skip
        return [*argv, "--extra", json.dumps(extra)]

    def _now(self) -> float:
        return time.monotonic() - self.t0

    # ---- the load -----------------------------------------------------------------------------------------------
    async def _session(self, client: Any, ours: str, ref: str, k: int, stop: float) -> None:
        conv = self.conversations[k]
        while time.monotonic() < stop:
            prompt = conv.next_prompt()
            t = self._now()
            try:
                text, ttft = await complete(client, ours, prompt)
            except Exception as err:  # a failed request: counted (apart in a restart window), the session goes on
                why = f"{type(err).__name__}: {err}"[:200]
                self.result.answers.append(Answer(t, self._now(), None, False, None, why))
                await asyncio.sleep(1.0)
                continue
            t_end = self._now()
            ref_ttft = None
            try:
                expected, ref_ttft = await complete(client, ref, prompt)
                right: bool | None = expected == text
            except Exception:
                right = None
            self.result.answers.append(Answer(t, t_end, ttft, True, right, ref_ttft_s=ref_ttft))
            conv.answered(text)

    # ---- faults and samples -------------------------------------------------------------------------------------
    async def _faults(self, injector: Injector, stop: float) -> None:
        for f in self.schedule:
            await asyncio.sleep(max(0.0, self.t0 + f.at_s - time.monotonic()))
            if time.monotonic() >= stop:
                return
            start = self._now()
            try:
                what = await asyncio.to_thread(injector.run, f.kind)
            except Exception as err:  # the soak's own failure to inject: recorded, and a failed check
                what = f"FAILED to inject: {type(err).__name__}: {err}"[:300]
            self.result.faults.append(FaultRecord(f.kind, round(start, 1), round(self._now(), 1), what))

    def _read_metrics(self, node: ServedNode) -> None:
        values = node.scrape()
        if values is not None:
            self.result.metrics.append(MetricSample(round(self._now(), 1), node.life, values))

    async def _sampler(self, node: ServedNode, stop: float) -> None:
        while time.monotonic() < stop:
            t, life = self._now(), node.life
            self.result.samples.append(await asyncio.to_thread(sample, t, life, node.pid, self.disk))
            await asyncio.to_thread(self._read_metrics, node)
            await asyncio.sleep(SAMPLE_S)

    async def _drive(self, node: ServedNode, ref: OpenAIServer, injector: Injector) -> None:
        import httpx

        self.t0 = time.monotonic()
        stop = self.t0 + self.settings.seconds
        async with httpx.AsyncClient(timeout=120) as client:
            sessions = [self._session(client, node.url, ref.url, k, stop) for k in range(self.settings.sessions)]
            await asyncio.gather(*sessions, self._faults(injector, stop), self._sampler(node, stop))
        await asyncio.to_thread(self._read_metrics, node)

    # ---- the run ------------------------------------------------------------------------------------------------
    def run(self) -> SoakResult:
        self.work.mkdir(parents=True, exist_ok=True)
        with own_tmpfs(self.mount, DISK_FS_BYTES) if self.mount else contextlib.nullcontext():
            self._run_servers()
        time.sleep(2.0)  # the pool's watcher removes the pool once the last process detached (keep_idle_s 0)
        self.result.shm_left = sorted(p.name for p in SHM_DIR.glob(f"*{self.pool}*"))
        self._write()
        return self.result

    def _run_servers(self) -> None:
        redis = RedisServer(self.work)
        node = ServedNode(self._serve_argv(redis), self.out, free_port(), OURS_ENV)
        seed = self.settings.seed
        rng = random.Random(seed + 1)
        injector = Injector(node, redis, self.disk, self.mount, self.out, seed,
                            prompt_now=lambda: rng.choice(self.conversations).text,
                            read_metrics=lambda: self._read_metrics(node), full_s=self.settings.full_s)  # fmt: skip
        ref = None
        try:
            node.start()
            ref = OpenAIServer(self._serve_argv(None), self.out / "reference.log", free_port(), env=REF_ENV)
            node.wait_ready(900)
            injector.start_engines(sum(f.kind == "engine_kill" for f in self.schedule))
            for server in [ref, *injector.engines]:
                server.wait_ready(900)
            asyncio.run(self._drive(node, ref, injector))
        finally:
            injector.close()
            node.stop()
            if ref is not None:
                ref.stop()
            redis.kill()
            self.result.log_lines = count_log_lines(node.logs())

    def _write(self) -> None:
        r = self.result
        rows = by_condition(r)
        doc = {"summary": r.summary(), "checks": [{"check": n, "passed": ok, "detail": d} for n, ok, d in r.checks()],
               "conditions": rows, "faults": [asdict(f) for f in r.faults], "log_lines": r.log_lines,
               "shm_left": r.shm_left, "samples": [asdict(s) for s in r.samples],
               "metrics": [asdict(m) for m in r.metrics], "answers": [asdict(a) for a in r.answers]}  # fmt: skip
        (self.out / "summary.json").write_text(json.dumps(doc, indent=1))
        stalls = stall_table(r)
        (self.out / "conditions.md").write_text(condition_table(rows) + "\n" + (f"\n{stalls}\n" if stalls else ""))
        plot_timeline(r, self.out / "timeline.png")


def _kinds(value: str) -> tuple[str, ...]:
    if value == "light":
        return LIGHT_KINDS
    kinds = tuple(k.strip() for k in value.split(",") if k.strip())
    unknown = [k for k in kinds if k not in FAULT_KINDS]
    if unknown:
        raise typer.BadParameter(f"unknown fault kind(s) {', '.join(unknown)}; known: {', '.join(FAULT_KINDS)}, or "
                                 "'light' (the ones that do not restart or add an engine)")  # fmt: skip
    return kinds


FAULTS_HELP = f"Fault kinds (comma list; default all: {','.join(FAULT_KINDS)}), or 'light' ({','.join(LIGHT_KINDS)})."


def soak_serve(
    seconds: Annotated[float, typer.Option("--seconds", min=10, help="How long the load runs (SOAK_S).")] = 900,
    out: Annotated[Path, typer.Option("--out", help="Where summary.json, the plot and the logs go.")] = Path(
        "soak-serve-out"
    ),
    seed: Annotated[int, typer.Option("--seed", help="The fault schedule's and the prompts' seed.")] = 0,
    sessions: Annotated[int, typer.Option("--sessions", min=1, help="Conversations at once.")] = 4,
    faults: Annotated[str, typer.Option("--faults", help=FAULTS_HELP)] = ",".join(FAULT_KINDS),
    full_s: Annotated[float, typer.Option("--full-s", min=1, help="How long the disk stays full.")] = FULL_S,
) -> None:
    """`kvprefetch serve` under a multi-turn load with faults injected; every answer checked against vLLM alone."""
    result = Soak(SoakSettings(seconds, seed, sessions, _kinds(faults), full_s), out).run()
    print(result.summary())
    print(condition_table(by_condition(result)))
    if stalls := stall_table(result):
        print(stalls)
    failed = [(n, d) for n, ok, d in result.checks() if not ok]
    for name, detail in failed:
        print(f"FAILED: {name}: {detail}")
    if failed:
        raise typer.Exit(1)


def register(app: typer.Typer) -> None:
    app.command("soak-serve")(soak_serve)
