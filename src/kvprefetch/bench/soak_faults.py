"""The serving soak's faults: when they come (`fault_schedule`) and what each one does (`Injector`), and the server
they act on (`ServedNode`: `kvprefetch serve` on a fixed port, stopped and started again as a fault needs).

Every fault runs to its end before the next one starts, so each one's effects can be read apart (TTFT, hits and
/metrics in its window). Kinds:

* ``redis_kill``: redis-server SIGKILLed, restarted empty 10 s later (the shared tier: misses, never errors);
* ``damage``: the next chunk files the node writes damaged as they land (a byte flipped, cut short, deleted);
* ``gc``: ``kvprefetch status --gc`` while the server runs;
* ``disk_full``: the disk tier's filesystem (a tmpfs of its own) filled for `full_s`, then freed;
* ``engine_kill``: a second engine (``kvprefetch serve`` on the same DRAM pool, disk and redis) started, made to
  read and write the node's tiers, and SIGKILLed with a request in flight;
* ``server_term``: the server SIGTERMed (first its main process, as Kubernetes stops a container; then its
  process group, as systemd stops a unit) and started again;
* ``server_kill``: the server's process group SIGKILLed (a crash) and started again: it comes back warm from the
  disk tier, its DRAM pool gone with it.
"""

from __future__ import annotations

import contextlib
import os
import random
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

from kvprefetch.bench.soak_load import complete_sync, prompt_words
from kvprefetch.bench.soak_report import RESTART_KINDS
from kvprefetch.testbed.client import shm_mapped_by_group, unlink_all
from kvprefetch.testbed.local_servers import RedisServer, free_port
from kvprefetch.testbed.server import OpenAIServer, parse_metrics

LIGHT_KINDS = ("redis_kill", "damage", "gc", "disk_full")
HEAVY_KINDS = ("engine_kill", *RESTART_KINDS)
FAULT_KINDS = LIGHT_KINDS + HEAVY_KINDS
REDIS_DOWN_S = 10.0
FULL_S = 30.0
DAMAGE_WAIT_S = 30.0  # a damage fault waits this long at most for the chunk files it damages
DAMAGE_POLL_S = 0.1  # how often it looks for new ones (a file is read back seconds after it lands)
FULL_TAIL_S = 1.0  # a full disk's last /metrics reading comes this long before it is freed
SECOND_ENGINE_CORE = "1"  # the second engines' model beside vLLM alone
EARLY_BY_S = 0.45  # the early kinds end by here (share of the run): the second half is one server life
EARLY_KINDS = (*RESTART_KINDS, "disk_full")  # (a full disk bites only while the disk tier is below its capacity)


@dataclass(frozen=True)
class Fault:
    at_s: float
    kind: str


def fault_schedule(seconds: float, seed: int, kinds: tuple[str, ...] = FAULT_KINDS) -> list[Fault]:
    """Every kind at least twice (once more per 450 s beyond 900 s), in a seeded order on evenly spaced slots: the
    server's own restarts and the full disk between 10% and 45% of the run (its second half then measures one
    server life for leaks, and the disk tier is still filling when its filesystem fills up), the other kinds
    between 10% and 85%. A fault starts at its slot, or when the one before it ends."""
    rng = random.Random(seed)
    per_kind = max(2, int(seconds // 450))
    early = [k for k in kinds if k in EARLY_KINDS] * per_kind
    rest = [k for k in kinds if k not in EARLY_KINDS] * per_kind
    rng.shuffle(early)
    rng.shuffle(rest)

    def slots(ks: list[str], lo: float, hi: float) -> list[Fault]:
        step = (hi - lo) * seconds / max(len(ks), 1)
        return [Fault(lo * seconds + i * step + rng.uniform(0.0, 0.3 * step), k) for i, k in enumerate(ks)]

    return sorted(slots(early, 0.1, EARLY_BY_S) + slots(rest, 0.1, 0.85), key=lambda f: f.at_s)


# ---- the server ---------------------------------------------------------------------------------------------------
class ServedNode:
    """`kvprefetch serve` with the connector, on one port for the whole run, in a process group of its own; one log
    per life (`server-<life>.log`)."""

    def __init__(self, argv: list[str], out: Path, port: int, env: dict[str, str] | None = None):
        self.argv, self.out, self.port, self.env = argv, out, port, env
        self.url = f"http://127.0.0.1:{port}"
        self.life = -1
        self.server: OpenAIServer | None = None
        self.up = False  # ready and not being stopped: the sampler reads its metrics only then

    def start(self) -> None:
        self.life += 1
        self.server = OpenAIServer(self.argv, self.log_path(self.life), self.port, self.env, new_session=True)

    def wait_ready(self, timeout: float = 900) -> None:
        assert self.server is not None
        self.server.wait_ready(timeout)
        self.up = True

    def log_path(self, life: int) -> Path:
        return self.out / f"server-{life}.log"

    def logs(self) -> list[str]:
        return [self.log_path(i).read_text(errors="replace") for i in range(self.life + 1) if self.log_path(i).exists()]

    @property
    def pid(self) -> int | None:
        return self.server.proc.pid if self.server is not None and self.server.proc.poll() is None else None

    def scrape(self) -> dict[str, float] | None:
        """The counters the soak reads (`kvprefetch.bench.soak_report.MetricSample`), None while it is down."""
        if not self.up or self.server is None:
            return None
        try:
            return soak_metrics(parse_metrics(self.server.metrics_text()))
        except OSError:
            return None

    def terminate(self, group: bool, timeout: float = 90) -> tuple[float, int]:
        """SIGTERM to the main process or to the whole group; (seconds until it exited, vLLM shared-memory
        segments it left, unlinked). SIGKILL past the timeout."""
        assert self.server is not None
        self.up = False
        pgid = self.server.proc.pid
        segments = shm_mapped_by_group(pgid)
        t0 = time.monotonic()
        with contextlib.suppress(ProcessLookupError):
            (os.killpg if group else os.kill)(pgid, signal.SIGTERM)
        try:
            self.server.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(pgid, signal.SIGKILL)
            self.server.proc.wait()
        took = time.monotonic() - t0
        _wait_group_gone(pgid)
        self.server.stop()
        return took, unlink_all(segments)

    def kill(self) -> int:
        """SIGKILL to the whole group (a crash); the vLLM shared-memory segments it left, unlinked."""
        assert self.server is not None
        self.up = False
        return kill_group(self.server)

    def stop(self) -> None:
        self.up = False
        if self.server is not None:
            self.server.stop()


def kill_group(server: OpenAIServer) -> int:
    """SIGKILL a server's process group; unlink the vLLM message queues (/dev/shm/psm_*) its processes mapped,
    which only vLLM's own shutdown unlinks. Returns how many were left."""
    pgid = server.proc.pid
    segments = shm_mapped_by_group(pgid)
    with contextlib.suppress(ProcessLookupError):
        os.killpg(pgid, signal.SIGKILL)
    server.proc.wait()
    _wait_group_gone(pgid)
    server.stop()
    return unlink_all(segments)


def _wait_group_gone(pgid: int, timeout: float = 30) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            os.killpg(pgid, 0)
        except ProcessLookupError:
            return
        time.sleep(0.2)


def soak_metrics(m: dict) -> dict[str, float]:
    """/metrics (parsed) as the soak's counters: prompt tokens, hit tokens per tier, tier errors per kind, chunk
    writes to the disk tier (failed ones included; a chunk found already there is no write), the watchdog's
    releases and the re-asked requests served without parking (`WATCHDOG`)."""
    out: dict[str, float] = {"prompt": 0.0}
    for (name, labels), v in m.items():
        lab = dict(labels)
        if name == "vllm:prompt_tokens_by_source_total":
            out["prompt"] += v
            if lab.get("source") == "local_cache_hit":
                out["hit/engine"] = v
        elif name == "vllm:kvprefetch_hit_tokens_total":
            out[f"hit/{lab['tier']}"] = out.get(f"hit/{lab['tier']}", 0.0) + v
        elif name == "vllm:kvprefetch_tier_errors_total":
            key = f"err/{lab['tier']}/{lab['kind']}"
            out[key] = out.get(key, 0.0) + v
        elif name == "vllm:kvprefetch_io_ops_total" and (lab.get("tier"), lab.get("cls")) == ("disk", "writeback"):
            out["written"] = out.get("written", 0.0) + v
        elif name in WATCHDOG:
            out[WATCHDOG[name]] = out.get(WATCHDOG[name], 0.0) + v
    return out


# The connector's own bounds on a wait for KV (issue 59), as the soak's counters: a release by the watchdog names a
# cause of a stall not yet fixed where it is; a re-asked request served without parking, the cause that was.
WATCHDOG = {"vllm:kvprefetch_stalls_released_total": "released", "vllm:kvprefetch_reasked_unparked_total": "unparked"}


# ---- the disk tier's own filesystem -------------------------------------------------------------------------------
@contextlib.contextmanager
def own_tmpfs(mnt: Path, size_bytes: int) -> Iterator[Path]:
    """A tmpfs of its own at mnt for the block (root only: the disk_full fault fills it)."""
    mnt.mkdir(parents=True, exist_ok=True)
    if os.geteuid() != 0:
        raise PermissionError("the disk_full fault mounts a tmpfs for the disk tier: run as root, or leave it out "
                              "(--faults without disk_full)")  # fmt: skip
    subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size_bytes}", "tmpfs", str(mnt)], check=True)
    try:
        yield mnt
    finally:
        subprocess.run(["umount", "-l", str(mnt)], check=False)


def top_up(f: BinaryIO) -> int:
    """Write zeros to f until its filesystem is full (to the last 4 KiB); the bytes written."""
    n, block = 0, 1 << 20
    while block >= 4096:
        try:
            n += f.write(bytes(block))
        except OSError:  # ENOSPC: what is left is smaller than a block
            block //= 16
    return n


def keep_full(f: BinaryIO, until: float) -> int:
    """Top f's filesystem up every 0.2 s until `until` (time.monotonic()), taking what the disk tier frees by
    evicting; the bytes written."""
    n = 0
    while time.monotonic() < until:
        time.sleep(0.2)
        n += top_up(f)
    return n


# ---- damage -------------------------------------------------------------------------------------------------------
def damage(disk: Path, rng: random.Random, n: int = 8, wait_s: float = DAMAGE_WAIT_S) -> list[str]:
    """Flip a byte in, cut short or delete the next n chunk files the node writes, each as it lands (within
    `wait_s`): chunks of the conversations in progress, which their next turns read back from disk (while the server
    may be reading them), as a device that returns bad data for what it just wrote would.

    The files the node writes next, not the newest ones already there: with the soak's small DRAM tier, a chunk
    file is read back once, a few seconds after it is written, and rarely again (in a 90 s run, of the 28 files
    on disk at 11 s only the 3 newest were read after it, of 81 at 35 s the 11 newest), so a CI run's two faults of
    8 files drawn from the 32 newest showed nothing."""
    seen = set(disk.rglob("*.kv"))
    deadline = time.monotonic() + wait_s
    done: list[str] = []
    while len(done) < n and time.monotonic() < deadline:
        for f in sorted(set(disk.rglob("*.kv")) - seen):
            seen.add(f)
            if len(done) < n:
                done.append(f"{damage_file(f, rng)} {f.name[:12]}")
        time.sleep(DAMAGE_POLL_S)
    return done


def damage_file(f: Path, rng: random.Random) -> str:
    """Delete f, cut it short or flip one of its bytes (drawn by rng); how."""
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
    return how


# ---- the injector -------------------------------------------------------------------------------------------------
class Injector:
    """Runs one fault to its end and says what it did (one line for summary.json)."""

    def __init__(self, node: ServedNode, redis: RedisServer, disk: Path, mount: Path | None, out: Path, seed: int,
                 prompt_now: Callable[[], str], read_metrics: Callable[[], None], full_s: float = FULL_S):  # fmt: skip
        """`prompt_now`: a conversation's prompt in progress (what a second engine is asked); `read_metrics`: reads
        the server's /metrics into the run's samples now (before the server is stopped, its counters one last time;
        at a full disk's edges, so the chunk writes made while it was full are read from samples inside it)."""
        self.node, self.redis, self.disk, self.mount, self.out = node, redis, disk, mount, out
        self.rng = random.Random(seed)
        self.prompt_now, self.read_metrics, self.full_s = prompt_now, read_metrics, full_s
        self.done: dict[str, int] = {}
        self.engines: list[OpenAIServer] = []  # the second engines, one per engine_kill (`start_engines`)

    def start_engines(self, n: int) -> None:
        """Start the second engines now, beside the server (on a loaded machine vLLM takes minutes to start:
        started late, the fault would measure that instead)."""
        env = {"VLLM_CPU_OMP_THREADS_BIND": SECOND_ENGINE_CORE}
        for i in range(n):
            self.engines.append(OpenAIServer(self.node.argv, self.out / f"engine2-{i}.log", free_port(), env,
                                             new_session=True))  # fmt: skip

    def close(self) -> None:
        """Kill the second engines a run did not get to."""
        for eng in self.engines:
            if eng.proc.poll() is None:
                kill_group(eng)

    def run(self, kind: str) -> str:
        n = self.done.get(kind, 0)
        self.done[kind] = n + 1
        return getattr(self, kind)(n)

    def redis_kill(self, n: int) -> str:
        self.redis.kill()
        time.sleep(REDIS_DOWN_S)
        self.redis.start()
        return f"redis down {REDIS_DOWN_S:.0f} s"

    def damage(self, n: int) -> str:
        return ", ".join(damage(self.disk, self.rng)) or f"no chunk file written in {DAMAGE_WAIT_S:.0f} s"

    def gc(self, n: int) -> str:
        out = subprocess.run([sys.executable, "-m", "kvprefetch.cli", "status", "--gc"], capture_output=True,
                             text=True, timeout=120)  # fmt: skip
        return f"status --gc: exit {out.returncode}"

    def disk_full(self, n: int) -> str:
        """Another tenant fills the disk tier's filesystem, and keeps it full: the space the tier frees by evicting
        its own chunks is taken too (or the tier would simply write into it), until `full_s` has passed."""
        assert self.mount is not None, "disk_full needs the disk tier on its own tmpfs"
        filler = self.mount / ".soak-filler"
        deadline = time.monotonic() + self.full_s
        size = 0
        try:
            with open(filler, "wb", buffering=0) as f:
                size += top_up(f)
                self.read_metrics()  # full from here: the chunk writes from now on meet a full disk
                size += keep_full(f, deadline - FULL_TAIL_S)
                self.read_metrics()  # (writes that failed up to here have FULL_TAIL_S to be tallied)
                size += keep_full(f, deadline)
        finally:
            filler.unlink(missing_ok=True)
        return f"disk tier's filesystem kept full for {self.full_s:.0f} s (filler grew to {size / 2**20:.0f} MiB)"

    def engine_kill(self, n: int) -> str:
        """The n-th second engine (started with the server, idle since, attached to the node's pool as any engine
        on the node is) reads and writes the node's tiers, and is SIGKILLed with a request in flight."""
        eng = self.engines[n]
        answered, inflight = 0, None
        try:
            for prompt in (self.prompt_now(), prompt_words(self.rng, 600)):  # the node's chunks, then new ones
                complete_sync(eng.url, prompt)
                answered += 1
            inflight = threading.Thread(target=_killed_midway, args=(eng.url, prompt_words(self.rng, 1200)))
            inflight.start()
            time.sleep(0.3)
        finally:
            left = kill_group(eng)
            if inflight is not None:
                inflight.join(30)
        return (f"second engine on the node's pool answered {answered}, SIGKILLed mid-request ({left} vLLM shm "
                "segments it left unlinked)")  # fmt: skip

    def server_term(self, n: int) -> str:
        group = n % 2 == 1
        self.read_metrics()
        took, left = self.node.terminate(group)
        return self._restart(f"SIGTERM to the server's {'process group' if group else 'main process'}: exited in "
                             f"{took:.1f} s ({left} vLLM shm segments left)")  # fmt: skip

    def server_kill(self, n: int) -> str:
        self.read_metrics()
        left = self.node.kill()
        return self._restart(f"SIGKILL to the server's process group ({left} vLLM shm segments left, unlinked)")

    def _restart(self, what: str) -> str:
        t0 = time.monotonic()
        self.node.start()
        self.node.wait_ready(900)
        return f"{what}; restarted, ready in {time.monotonic() - t0:.0f} s"


def _killed_midway(url: str, prompt: str) -> None:
    """A request whose engine is killed under it: it fails, as it must."""
    with contextlib.suppress(Exception):
        complete_sync(url, prompt)
