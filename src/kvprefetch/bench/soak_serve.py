"""`kvprefetch soak-serve` (`make soak-serve`): `kvprefetch serve` with every tier (DRAM pool, disk, a Redis shared
tier) held under a multi-turn load for a while, faults injected on a seeded schedule, every answer checked
against vLLM alone, and the server's resources sampled for leaks. One summary line; details in summary.json.

This first cut injects: redis-server SIGKILLed (restarted 10 s later), chunk files damaged (bytes flipped,
truncated, deleted), `kvprefetch status --gc`. (Issue 40 lists more: a full disk, a second engine SIGKILLed on the
pool, the server SIGTERMed and SIGKILLed and restarted.)

The load: `sessions` conversations at once, each a shared head of words and turns that append an answer and a
user message, sent with vLLM's OpenAI API (greedy, a few tokens); each prompt is sent to vLLM alone too, and the
two texts must be equal (the tiny model's tokenizer is one word a token, so equal text is equal tokens).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import random
import subprocess
import sys
import time
import uuid
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Annotated, Any

import psutil
import typer

from kvprefetch.bench.local_servers import RedisServer
from kvprefetch.bench.modes import remote_section
from kvprefetch.bench.server import OpenAIServer, free_port, metric_sum
from kvprefetch.tiers.dram import SHM_DIR

FAULT_KINDS = ("redis_kill", "damage", "gc")
REDIS_DOWN_S = 10.0
SAMPLE_S = 5.0
WORDS = 4000  # the tiny model's vocabulary is w0..w<vocab>: prompts use words under this


@dataclass(frozen=True)
class Fault:
    at_s: float
    kind: str


def fault_schedule(seconds: float, seed: int) -> list[Fault]:
    """Every kind at least twice, spread over the run (after a warm-up tenth, before the last tenth)."""
    rng = random.Random(seed)
    lo, hi = 0.1 * seconds, 0.8 * seconds
    per_kind = max(2, int(seconds // 300))
    faults = [Fault(rng.uniform(lo, hi), kind) for kind in FAULT_KINDS for _ in range(per_kind)]
    return sorted(faults, key=lambda f: f.at_s)


@dataclass
class Sample:
    t: float
    rss_mb: float
    fds: int
    threads: int
    shm_files: int
    disk_mb: float


@dataclass
class Answer:
    t: float
    ttft_s: float | None
    ok: bool
    right: bool | None  # equal to vLLM alone's (None: vLLM alone failed too)
    error: str = ""


@dataclass
class SoakResult:
    seconds: float
    faults: list[dict] = field(default_factory=list)
    answers: list[Answer] = field(default_factory=list)
    samples: list[Sample] = field(default_factory=list)
    metrics_moved: dict[str, float] = field(default_factory=dict)
    shm_left: list[str] = field(default_factory=list)

    def growth(self, attr: str) -> float:
        """Growth of a sampled resource over the run's second half (first vs last three samples of it), in %."""
        half = [getattr(s, attr) for s in self.samples if s.t >= self.seconds / 2]
        if len(half) < 4:
            return 0.0
        first, last = sorted(half[:3])[1], sorted(half[-3:])[1]
        return 100.0 * (last - first) / max(first, 1e-9)

    def summary(self) -> str:
        failed = sum(not a.ok for a in self.answers)
        wrong = sum(a.right is False for a in self.answers)
        growth = " ".join(f"{name}_growth={self.growth(attr):.1f}%"
                          for name, attr in (("rss", "rss_mb"), ("fd", "fds"), ("thread", "threads")))  # fmt: skip
        return (f"soak-serve: seconds={self.seconds:.0f} requests={len(self.answers)} failed={failed} wrong={wrong} "
                f"faults={len(self.faults)} {growth} shm_left={len(self.shm_left)}")  # fmt: skip


def prompt_words(rng: random.Random, n: int) -> str:
    return " ".join(f"w{rng.randrange(5, WORDS)}" for _ in range(n))


class Conversation:
    """One session: a head of `head` words, then turns of `turn` words, each appending the last answer; a new
    conversation once it would pass `max_words` (~1.5 tokens a word: under the server's 4096-token context)."""

    def __init__(self, seed: int, head: int = 600, turn: int = 40, max_words: int = 2000):
        self.rng = random.Random(seed)
        self.head, self.turn, self.max_words = head, turn, max_words
        self.text = prompt_words(self.rng, head)

    def next_prompt(self) -> str:
        if len(self.text.split()) + self.turn > self.max_words:
            self.text = prompt_words(self.rng, self.head)  # a new conversation on the same session
        self.text += " " + prompt_words(self.rng, self.turn)
        return self.text

    def answered(self, answer: str) -> None:
        self.text += " " + answer.strip()


def _tree(pid: int) -> list[psutil.Process]:
    try:
        root = psutil.Process(pid)
        return [root, *root.children(recursive=True)]
    except psutil.Error:
        return []


def sample(t: float, pid: int, disk: Path) -> Sample:
    rss = fds = threads = 0
    for p in _tree(pid):
        with contextlib.suppress(psutil.Error):
            rss += p.memory_info().rss
            fds += p.num_fds()
            threads += p.num_threads()
    disk_bytes = sum(f.stat().st_size for f in disk.rglob("*.kv") if f.is_file()) if disk.exists() else 0
    return Sample(t, rss / 2**20, fds, threads, len(list(SHM_DIR.iterdir())), disk_bytes / 2**20)


def damage(disk: Path, rng: random.Random, n: int = 3) -> list[str]:
    """Flip bytes in, truncate or delete n random chunk files (while the server may be reading them)."""
    files = sorted(disk.rglob("*.kv"))
    done = []
    for f in rng.sample(files, min(n, len(files))):
        how = rng.choice(("flip", "truncate", "delete"))
        with contextlib.suppress(FileNotFoundError):
            if how == "delete":
                f.unlink()
            elif how == "truncate":
                with open(f, "r+b") as fh:
                    fh.truncate(max(0, f.stat().st_size // 2))
            else:
                with open(f, "r+b") as fh:
                    fh.seek(rng.randrange(max(1, f.stat().st_size)))
                    b = fh.read(1)
                    fh.seek(-len(b), 1)
                    fh.write(bytes([(b[0] if b else 0) ^ 0xFF]))
        done.append(f"{how} {f.name[:12]}")
    return done


async def _complete(client: Any, url: str, prompt: str, max_tokens: int) -> tuple[str, float]:
    t0 = time.monotonic()
    ttft, text = None, []
    async with client.stream("POST", f"{url}/v1/completions", json={"model": "tiny", "prompt": prompt,
                             "max_tokens": max_tokens, "temperature": 0, "stream": True}) as r:  # fmt: skip
        r.raise_for_status()
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            if ttft is None:
                ttft = time.monotonic() - t0
            text.append(json.loads(line[6:])["choices"][0]["text"])
    return "".join(text), ttft if ttft is not None else time.monotonic() - t0


class Soak:
    """The run: its servers, its load, its faults, its samples."""

    def __init__(self, seconds: float, out: Path, seed: int = 0, sessions: int = 4, max_tokens: int = 8):
        self.seconds, self.out, self.seed, self.sessions, self.max_tokens = seconds, out, seed, sessions, max_tokens
        self.work = out / "work"
        self.disk = self.work / "disk"
        self.pool = f"kvpsoak-{uuid.uuid4().hex[:8]}"
        self.result = SoakResult(seconds)
        self.t0 = 0.0

    def _serve_argv(self, redis: RedisServer | None) -> list[str]:
        argv = [sys.executable, "-m", "kvprefetch.cli", "serve", "kvprefetch-tiny", "--served-model-name", "tiny",
                "--max-model-len", "4096", "--kv-cache-memory-bytes", str(32 << 20), "--max-num-seqs", "4"]  # fmt: skip
        if redis is None:
            return [*argv, "--no-connector"]
        remote = remote_section("redis", redis) | {"timeout_s": 1.0, "retry_after_s": 2.0}
        extra = {"tiers": ["dram", "disk", "remote"], "chunk_tokens": 256, "log_interval_s": 0,
                 "dram": {"pool_name": self.pool, "capacity_bytes": "48MiB", "keep_idle_s": 0},
                 "disk": {"path": str(self.disk), "capacity_bytes": "256MiB"}, "remote": remote}  # fmt: skip
        return [*argv, "--extra", json.dumps(extra)]

    async def _session(self, client: Any, ours: str, ref: str, k: int, stop: float) -> None:
        conv = Conversation(self.seed * 1000 + k)
        while time.monotonic() < stop:
            prompt = conv.next_prompt()
            t = time.monotonic() - self.t0
            try:
                text, ttft = await _complete(client, ours, prompt, self.max_tokens)
            except Exception as err:  # a failed request: counted, the session goes on
                self.result.answers.append(Answer(t, None, False, None, f"{type(err).__name__}: {err}"[:200]))
                await asyncio.sleep(1.0)
                continue
            try:
                expected, _ = await _complete(client, ref, prompt, self.max_tokens)
                right: bool | None = expected == text
            except Exception:
                right = None
            self.result.answers.append(Answer(t, ttft, True, right))
            conv.answered(text)

    async def _faults(self, redis: RedisServer, stop: float) -> None:
        rng = random.Random(self.seed)
        for f in fault_schedule(self.seconds, self.seed):
            await asyncio.sleep(max(0.0, self.t0 + f.at_s - time.monotonic()))
            if time.monotonic() >= stop:
                return
            what = await asyncio.to_thread(self._inject, f.kind, redis, rng)
            self.result.faults.append({"at_s": round(time.monotonic() - self.t0, 1), "kind": f.kind, "what": what})

    def _inject(self, kind: str, redis: RedisServer, rng: random.Random) -> str:
        if kind == "redis_kill":
            redis.kill()
            time.sleep(REDIS_DOWN_S)
            redis.start()
            return f"redis down {REDIS_DOWN_S:.0f} s"
        if kind == "damage":
            return ", ".join(damage(self.disk, rng)) or "no chunk file yet"
        out = subprocess.run([sys.executable, "-m", "kvprefetch.cli", "status", "--gc"], capture_output=True,
                             text=True, timeout=120)  # fmt: skip
        return f"status --gc: exit {out.returncode}"

    async def _sampler(self, pid: int, stop: float) -> None:
        while time.monotonic() < stop:
            self.result.samples.append(await asyncio.to_thread(sample, time.monotonic() - self.t0, pid, self.disk))
            await asyncio.sleep(SAMPLE_S)

    async def _drive(self, ours: OpenAIServer, ref: OpenAIServer, redis: RedisServer) -> None:
        import httpx

        self.t0 = time.monotonic()
        stop = self.t0 + self.seconds
        async with httpx.AsyncClient(timeout=120) as client:
            await asyncio.gather(*(self._session(client, ours.url, ref.url, k, stop) for k in range(self.sessions)),
                                 self._faults(redis, stop), self._sampler(ours.proc.pid, stop))  # fmt: skip

    def run(self) -> SoakResult:
        self.work.mkdir(parents=True, exist_ok=True)
        redis = RedisServer(self.work)
        ours = ref = None
        try:
            ours = OpenAIServer(self._serve_argv(redis), self.out / "server.log", free_port())
            ref = OpenAIServer(self._serve_argv(None), self.out / "reference.log", free_port())
            ours.wait_ready(900)
            ref.wait_ready(900)
            before = ours.metrics()
            asyncio.run(self._drive(ours, ref, redis))
            after = ours.metrics()
            self.result.metrics_moved = _moved(before, after)
        finally:
            for s in (ours, ref):
                if s is not None:
                    s.stop()
            redis.kill()
        time.sleep(2.0)  # the pool's watcher removes the pool once the last process detached (keep_idle_s 0)
        self.result.shm_left = sorted(p.name for p in SHM_DIR.glob(f"*{self.pool}*"))
        self._write()
        return self.result

    def _write(self) -> None:
        r = self.result
        doc = {"summary": r.summary(), "faults": r.faults, "metrics_moved": r.metrics_moved, "shm_left": r.shm_left,
               "samples": [asdict(s) for s in r.samples], "answers": [asdict(a) for a in r.answers]}  # fmt: skip
        (self.out / "summary.json").write_text(json.dumps(doc, indent=1))
        plot_timeline(r, self.out / "timeline.png")


def windows(answers: list[Answer], width_s: float = 10.0) -> list[tuple[float, float, float]]:
    """(window start, TTFT p50, TTFT p99) per `width_s` window of the answers that completed."""
    import numpy as np

    by: dict[int, list[float]] = {}
    for a in answers:
        if a.ok and a.ttft_s is not None:
            by.setdefault(int(a.t // width_s), []).append(a.ttft_s)
    return [(k * width_s, float(np.percentile(v, 50)), float(np.percentile(v, 99))) for k, v in sorted(by.items())]


def plot_timeline(result: SoakResult, path: Path) -> str:
    """TTFT p50/p99 per 10 s window, the faults marked, and the server's RSS on a second axis."""
    from kvprefetch.bench.plotting import figure, save

    fig, ax = figure()
    w = windows(result.answers)
    ax.plot([t for t, _, _ in w], [p * 1e3 for _, p, _ in w], "o-", label="TTFT p50")
    ax.plot([t for t, _, _ in w], [p * 1e3 for _, _, p in w], "s--", label="TTFT p99")
    for f in result.faults:
        ax.axvline(f["at_s"], color={"redis_kill": "red", "damage": "orange"}.get(f["kind"], "gray"), alpha=0.5)
    ax.set_xlabel("seconds (faults: red redis killed, orange chunk files damaged, gray status --gc)")
    ax.set_ylabel("TTFT per 10 s window (ms)")
    rss = ax.twinx()
    rss.plot([x.t for x in result.samples], [x.rss_mb for x in result.samples], color="green", alpha=0.6)
    rss.set_ylabel("server RSS (MiB, green)")
    return save(fig, ax, path)


def _moved(before: dict, after: dict) -> dict[str, float]:
    """kvprefetch's error and load counters, as they moved over the run (by tier where they have one)."""
    out: dict[str, float] = {}
    for name in ("vllm:kvprefetch_io_errors_total", "vllm:kvprefetch_load_error_chunks_total",
                 "vllm:kvprefetch_loaded_chunks_total", "vllm:kvprefetch_saved_chunks_total"):  # fmt: skip
        for tier in ("", "dram", "disk", "remote"):
            labels = {"tier": tier} if tier else {}
            d = metric_sum(after, name, **labels) - metric_sum(before, name, **labels)
            if d:
                out[name.removeprefix("vllm:kvprefetch_") + (f"{{tier={tier}}}" if tier else "")] = d
    return out



def soak_serve(
    seconds: Annotated[float, typer.Option("--seconds", min=10, help="How long the load runs (SOAK_S).")] = 900,
    out: Annotated[Path, typer.Option("--out", help="Where summary.json and the logs go.")] = Path("soak-serve-out"),
    seed: Annotated[int, typer.Option("--seed", help="The fault schedule's and the prompts' seed.")] = 0,
    sessions: Annotated[int, typer.Option("--sessions", min=1, help="Conversations at once.")] = 4,
) -> None:
    """`kvprefetch serve` under a multi-turn load with faults injected; every answer checked against vLLM alone."""
    result = Soak(seconds, out, seed, sessions).run()
    print(result.summary())
    failed = sum(not a.ok for a in result.answers)
    wrong = sum(a.right is False for a in result.answers)
    if failed or wrong or result.shm_left:
        raise typer.Exit(1)


def register(app: typer.Typer) -> None:
    app.command("soak-serve")(soak_serve)
