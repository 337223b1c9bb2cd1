"""vLLM's OpenAI server, with or without the connector, driven by vLLM's own benchmark client (`vllm bench serve`).

What a vLLM user runs, end to end: `kvprefetch serve` (or `vllm serve ... --kv-transfer-config`) starts vLLM's
OpenAI-compatible server with the connector; `vllm.benchmarks.serve` sends it requests as `vllm bench serve`
does and measures TTFT; the server's `/metrics` carries vLLM's metrics and kvprefetch's (`kvprefetch.vllm.stats`).
`compare_servers` runs the same rounds against one server per mode (the bench's modes, `kvprefetch.bench.modes`)
so a user can put kvprefetch's figures next to their own `vllm bench serve` runs.

The shipped tiny model (`testbed/models/tiny-llama`, dummy weights) has no tokenizer, and the OpenAI server and the
benchmark client both work on text: `write_word_tokenizer` makes one word per token id ("w0" ... "wN"), so any
id sequence decodes to text that encodes back to the same ids (what `prefix_repetition` prompts rely on).
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

TINY_MODEL = Path(__file__).parent / "models" / "tiny-llama"
# The other KV layouts vLLM serves, as small (issue 62): a sliding-window hybrid (Gemma 3 text: three layers with a
# 96-token window, then one full-attention layer; vLLM's hybrid KV cache manager gives it four KV cache groups) and
# MLA (DeepSeek V2: one latent KV per token, shared by every head). Dummy weights, like the Llama.
TINY_MODELS = {
    "kvprefetch-tiny": TINY_MODEL,
    "kvprefetch-tiny-hybrid": TINY_MODEL.parent / "tiny-gemma3",
    "kvprefetch-tiny-mla": TINY_MODEL.parent / "tiny-deepseek-v2",
}
# vLLM arguments for the tiny model: random weights, CPU-friendly dtype, no graph capture.
TINY_MODEL_ARGS = ("--load-format", "dummy", "--dtype", "float32", "--enforce-eager")
API_SERVER = ("-m", "vllm.entrypoints.openai.api_server")


def write_word_tokenizer(path: Path, vocab_size: int) -> None:
    """A word-level tokenizer over ``vocab_size`` ids (id i <-> word "w<i>"), saved for `AutoTokenizer`."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.WordLevel({f"w{i}": i for i in range(vocab_size)}, unk_token="w0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.decoder = decoders.WordPiece(prefix="##")  # joins words with single spaces
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="w0", bos_token="w1", eos_token="w2")
    fast.save_pretrained(str(path))


def tiny_model_dir(dest: Path) -> Path:
    """The shipped tiny model with a word-level tokenizer, in `dest` (idempotent)."""
    return with_word_tokenizer(TINY_MODEL, dest)


def with_word_tokenizer(model: Path, dest: Path) -> Path:
    """A model directory that has only its config (dummy weights), copied to `dest` with a word-level tokenizer
    beside it, for an OpenAI server (which needs one); idempotent."""
    dest.mkdir(parents=True, exist_ok=True)
    config = json.loads((model / "config.json").read_text())
    if not (dest / "config.json").exists() or json.loads((dest / "config.json").read_text()) != config:
        shutil.copy(model / "config.json", dest / "config.json")
    if not (dest / "tokenizer.json").exists():
        write_word_tokenizer(dest, int(config["vocab_size"]))
    return dest


def server_argv(model: str, transfer_config: dict[str, Any] | None, vllm_args: Sequence[str] = ()) -> list[str]:
    """The OpenAI server's command line (`python -m vllm.entrypoints.openai.api_server`, which needs no `vllm`
    distribution metadata, unlike the `vllm` command on a bare CPU-build install)."""
    argv = [sys.executable, *API_SERVER, "--model", model]
    if transfer_config is not None:
        argv += ["--kv-transfer-config", json.dumps(transfer_config)]
    return argv + list(vllm_args)


def free_port() -> int:
    """A TCP port free now on every interface, below the kernel's ephemeral range. A port the kernel picked from
    that range (bind to port 0) can be handed to another socket's outgoing connection between this check and the
    server's own bind: an engine failed to start in CI with 'Address already in use' on such a port."""
    low = _ephemeral_low()
    for _ in range(200):
        port = random.randrange(max(1024, low - 12000), low)
        if port in _HANDED_OUT:
            continue
        with socket.socket() as s:
            try:
                s.bind(("", port))
            except OSError:
                continue
        _HANDED_OUT.add(port)
        return port
    with socket.socket() as s:  # no luck below the range: the kernel's pick
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


_HANDED_OUT: set[int] = set()  # never the same port twice to one process's servers


def _ephemeral_low() -> int:
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


class OpenAIServer:
    """One vLLM OpenAI server process (its engine core is its child); `stop()` sends SIGTERM as an operator would."""

    def __init__(
        self,
        argv: Sequence[str],
        log_path: Path,
        port: int,
        env: dict[str, str] | None = None,
        new_session: bool = False,
        netns: str | None = None,
        reach: str = "127.0.0.1",
    ):
        """`new_session`: the server leads a process group of its own (to be signalled as a whole, as systemd or a
        container runtime stops a service). `netns`: it runs in that network namespace (a node's), listening on
        its every address, and is reached at `reach` (the node's front-end address, `netns.Fabric.link_host`)."""
        self.port = port
        self.url = f"http://{reach}:{port}"
        self.log_path = log_path
        self._log = open(log_path, "w")  # noqa: SIM115  (closed in stop())
        full_env = dict(os.environ) | {"PYTHONUNBUFFERED": "1"} | (env or {})
        where = ["ip", "netns", "exec", netns] if netns else []  # it execs the server: the pid is the server's
        self.proc = subprocess.Popen(
            [*where, *argv, "--host", "0.0.0.0" if netns else "127.0.0.1", "--port", str(port)],
            stdout=self._log, stderr=subprocess.STDOUT, env=full_env, start_new_session=new_session,
        )  # fmt: skip

    def wait_ready(self, timeout: float = 600) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"vLLM server exited ({self.proc.returncode}); log tail:\n{self.tail()}")
            if answers(self.url + "/health"):
                return
            time.sleep(0.5)
        raise TimeoutError(f"vLLM server not ready in {timeout:.0f} s; log: {self.log_path}")

    def metrics_text(self) -> str:
        with urllib.request.urlopen(self.url + "/metrics", timeout=30) as r:
            return r.read().decode()

    def metrics(self) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
        """/metrics as {(sample name, sorted labels): value}."""
        return parse_metrics(self.metrics_text())

    def tail(self, n: int = 60) -> str:
        return log_tail(self._log, self.log_path, n)

    def terminate(self) -> None:
        """SIGTERM, as an operator (or Kubernetes) stops a server; `stop` waits for the exit."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)

    def stop(self, timeout: float = 120) -> int:
        """SIGTERM, then wait (SIGKILL only past the timeout). Returns the exit status."""
        if self.proc.poll() is None:
            self.terminate()
            try:
                self.proc.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._log.close()
        return int(self.proc.returncode)


def answers(url: str) -> bool:
    """The URL answers 200 now (a server's readiness probe; an unreachable one is a no, not an error)."""
    with contextlib.suppress(OSError), urllib.request.urlopen(url, timeout=2) as r:
        return r.status == 200
    return False


def log_tail(log: IO[str], path: Path, n: int = 60) -> str:
    """The last `n` lines of a process's log (what this process wrote to it flushed first); "" if unreadable."""
    if not log.closed:
        log.flush()
    try:
        return "".join(path.read_text(errors="replace").splitlines(True)[-n:])
    except OSError:
        return ""


def parse_metrics(text: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    from prometheus_client.parser import text_string_to_metric_families

    return {
        (s.name, tuple(sorted(s.labels.items()))): float(s.value)
        for fam in text_string_to_metric_families(text)
        for s in fam.samples
    }


def metric_sum(metrics: dict, name: str, **labels: str) -> float:
    """Sum of a metric's samples whose labels include `labels`."""
    want = set(labels.items())
    return sum(v for (n, lab), v in metrics.items() if n == name and want <= set(lab))


@dataclass
class BenchRound:
    """One `vllm bench serve` run: its saved result (TTFT per request, completed/failed)."""

    name: str
    result: dict[str, Any]

    @property
    def completed(self) -> int:
        return int(self.result["completed"])

    @property
    def failed(self) -> int:
        return int(self.result.get("failed", 0))

    @property
    def mean_ttft_ms(self) -> float:
        return float(self.result["mean_ttft_ms"])


@dataclass
class PrefixWorkload:
    """vLLM's `prefix_repetition` dataset: `num_prefixes` shared prefixes, each with `num_prompts/num_prefixes`
    random suffixes; the same seed gives the same prompts, so a second round repeats the first exactly."""

    num_prompts: int = 8
    prefix_len: int = 1024
    suffix_len: int = 256
    num_prefixes: int = 4
    output_len: int = 4
    concurrency: int = 2
    seed: int = 1

    def args(self) -> list[str]:
        return [
            "--dataset-name", "prefix_repetition",
            "--prefix-repetition-prefix-len", str(self.prefix_len),
            "--prefix-repetition-suffix-len", str(self.suffix_len),
            "--prefix-repetition-num-prefixes", str(self.num_prefixes),
            "--prefix-repetition-output-len", str(self.output_len),
            "--num-prompts", str(self.num_prompts),
            "--max-concurrency", str(self.concurrency),
            "--seed", str(self.seed),
            "--ignore-eos",
        ]  # fmt: skip


_BENCH_MAIN = """
import json, sys, time, urllib.request
from vllm.benchmarks.serve import add_cli_args, main
from vllm.utils.argparse_utils import FlexibleArgumentParser
jobs = json.loads(sys.argv[1])
for url in dict.fromkeys(job["url"] for job in jobs):
    # The servers start while this process imports vLLM; no run starts before every server is up, so no run
    # shares the CPU with another server's start-up.
    deadline = time.monotonic() + jobs[0]["ready_timeout"]
    while True:
        try:
            if urllib.request.urlopen(url + "/health", timeout=2).status == 200:
                break
        except OSError:
            pass
        if time.monotonic() > deadline:
            sys.exit("server not ready: " + url)
        time.sleep(0.5)
for job in jobs:
    p = FlexibleArgumentParser()
    add_cli_args(p)
    main(p.parse_args(job["args"]))
    print("@@done " + job["name"], flush=True)
"""


@dataclass
class BenchJob:
    """One `vllm bench serve` run: which server, under which name (its result is OUT/<name>.json)."""

    url: str
    name: str


class VllmBenchClient:
    """vLLM's benchmark client (`vllm.benchmarks.serve`, what `vllm bench serve` runs) for a list of runs, one
    after the other, in one process of its own (the `vllm` command itself needs the `vllm` distribution metadata
    that scripts/setup.sh registers; the module's entry point does not).

    It starts at once and waits for every server's /health itself, so its vLLM import overlaps the servers'
    start-up; runs never overlap each other, so one server's TTFT is not measured while another one works."""

    def __init__(
        self, jobs: Sequence[BenchJob], model: str, workload: PrefixWorkload, out: Path, ready_timeout: float = 900
    ):
        self.jobs = list(jobs)
        self.out = out
        out.mkdir(parents=True, exist_ok=True)
        payload = [
            {
                "url": j.url, "name": j.name, "ready_timeout": ready_timeout,
                "args": ["--backend", "vllm", "--base-url", j.url, "--model", model, "--tokenizer", model,
                         *workload.args(), "--save-result", "--result-dir", str(out),
                         "--result-filename", f"{j.name}.json"],
            }
            for j in self.jobs
        ]  # fmt: skip
        self.log = out / "vllm-bench.log"
        self._fh = open(self.log, "w")  # noqa: SIM115  (closed in wait())
        self.proc = subprocess.Popen(
            [sys.executable, "-c", _BENCH_MAIN, json.dumps(payload)], stdout=self._fh, stderr=subprocess.STDOUT
        )

    def wait(self, timeout: float = 1800) -> dict[str, BenchRound]:
        try:
            rc = self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
            rc = -9
        self._fh.close()
        rounds = {}
        for j in self.jobs:
            path = self.out / f"{j.name}.json"
            if rc != 0 or not path.exists():
                tail = "".join(self.log.read_text(errors="replace").splitlines(True)[-40:])
                raise RuntimeError(f"vllm bench serve failed ({rc}) at {j.name}; log {self.log}:\n{tail}")
            rounds[j.name] = BenchRound(j.name, json.loads(path.read_text()))
        return rounds

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        self._fh.close()


def tiny_server_args(kv_cache_bytes: int, max_model_len: int, max_num_seqs: int) -> list[str]:
    """vLLM arguments for the tiny model, with the engine's own KV (its prefix cache) sized explicitly."""
    return [
        *TINY_MODEL_ARGS,
        "--kv-cache-memory-bytes", str(kv_cache_bytes),
        "--max-model-len", str(max_model_len),
        "--max-num-seqs", str(max_num_seqs),
        "--seed", "0",
    ]  # fmt: skip


@dataclass
class ServeComparison:
    """`compare_servers`' outcome: every round's result, each server's /metrics before and after, exit codes."""

    rounds: dict[str, BenchRound]  # "<server>-<round>"
    metrics_text: dict[str, str]  # each server's /metrics after its rounds
    metrics_before: dict[str, dict] = field(default_factory=dict)
    metrics_after: dict[str, dict] = field(default_factory=dict)
    exit_codes: dict[str, int] = field(default_factory=dict)  # after SIGTERM
    logs: dict[str, Path] = field(default_factory=dict)


def compare_servers(
    servers: dict[str, list[str]],
    model: str,
    workload: PrefixWorkload,
    work: Path,
    rounds: Sequence[str] = ("cold", "warm"),
    timeout: float = 900,
) -> ServeComparison:
    """Start one OpenAI server per argv at once, run `rounds` of the same `prefix_repetition` workload against
    each in turn with vLLM's client (a round repeats the previous one's prompts exactly: "warm" finds what "cold"
    left in the engine's prefix cache and in kvprefetch's tiers), then stop every server with SIGTERM."""
    live: dict[str, OpenAIServer] = {}
    client: VllmBenchClient | None = None
    try:
        for name, argv in servers.items():
            live[name] = OpenAIServer(argv, work / f"server-{name}.log", free_port())
        # Round by round, the servers in turn: a drift in the machine's load over the run hits every server alike.
        jobs = [BenchJob(s.url, f"{name}-{r}") for r in rounds for name, s in live.items()]
        client = VllmBenchClient(jobs, model, workload, work / "results", ready_timeout=timeout)
        for s in live.values():
            s.wait_ready(timeout)
        before = {name: s.metrics() for name, s in live.items()}
        results = client.wait(timeout=timeout)
        text = {name: s.metrics_text() for name, s in live.items()}
        out = ServeComparison(results, text, before, {n: parse_metrics(t) for n, t in text.items()})
        for s in live.values():  # all at once: each takes vLLM's shutdown grace periods
            s.terminate()
        for name, s in live.items():
            out.exit_codes[name] = s.stop()
            out.logs[name] = s.log_path
        return out
    finally:
        if client is not None:
            client.kill()
        for s in live.values():
            s.stop()
