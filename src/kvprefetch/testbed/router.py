"""vllm-router (vllm-project/router, `pip install vllm-router`; `make setup` pins it) in front of `kvprefetch serve`
nodes, and what those nodes need to be routed on: KV events with a replay endpoint.

The router's `kv_aware` policy indexes each worker's KV events (vLLM's ZeroMQ publisher, `--kv-events-config`) and
sends a request where most of its prompt's blocks already are, crediting a block in a slower tier less
(`--kv-penalty-host/-disk/-external`). kvprefetch publishes its DRAM (`CPU`) and disk (`STORAGE`) chunks on the same
stream (`kvprefetch.vllm.events`), so a prefix the engine evicted from its GPU KV still draws its session back to
the node that holds it. What the router needs to see that, found on loopback:

- the prompt as token ids (`"prompt": [ids]` on /v1/completions): on a text prompt the router does not route on
  KV for HTTP workers (`vllm_router_kv_routing_inputs_total{result="preparation_rejected"}`);
- neither ``return_token_ids`` (vLLM's field for the answer's ids) nor ``kv_transfer_params`` (a per-request lease)
  in the request: with either, 0.1.17 counts the token ids as an input but looks nothing up in its index (no
  `vllm_router_kv_placement_lookups_total`) and routes by load alone. Compare answers by their text; lease on the
  nodes (``keep_warm_s`` in their config);
- `--kv-event-block-size` equal to the engines' block size (128 tokens on vLLM's CPU build): the router hashes a
  block's `token_ids` chained through `parent_block_hash`, so another size indexes nothing that matches;
- a replay endpoint per worker (`--kv-event-replay-source`): a gap in a worker's sequence numbers heals only by a
  replay; without one the router's index of that worker stays short of what the worker holds. A router started
  after a worker published does not ask for what came before the first batch it hears (0.1.17: one started after
  eight sessions' first turns sent 4 of 8 second turns home, 5 placement misses): start it before the load;
- its metrics on `--prometheus-port` (its own /metrics on the serving port proxies a worker's).
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import time
import urllib.request
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Literal

from kvprefetch.testbed.server import answers, free_port, log_tail, parse_metrics

Policy = Literal["random", "round_robin", "cache_aware", "kv_aware", "power_of_two", "consistent_hash",
                 "sticky_least_loaded"]  # fmt: skip
ROUTER_VERSION = "0.1.17"  # pyproject's `router` extra


@dataclass(frozen=True)
class KvEventsPorts:
    """Where one `kvprefetch serve` node publishes its KV events (vLLM's `KVEventsConfig`): the PUB socket, bound
    on every interface, and the ROUTER socket that answers replay requests (the last `buffer_steps` engine steps'
    batches), so a subscriber that missed batches, or came late, can ask for them by sequence number."""

    publish: int
    replay: int
    topic: str = ""  # vLLM's default: a subscriber to "" hears every topic
    buffer_steps: int = 10_000
    host: str = "127.0.0.1"  # where a subscriber reaches the node

    @classmethod
    def free(cls, topic: str = "") -> KvEventsPorts:
        return cls(free_port(), free_port(), topic)

    def config(self) -> dict[str, Any]:
        """`--kv-events-config` (vLLM's `KVEventsConfig` fields)."""
        return {
            "enable_kv_cache_events": True, "publisher": "zmq",
            "endpoint": f"tcp://*:{self.publish}", "replay_endpoint": f"tcp://*:{self.replay}",
            "buffer_steps": self.buffer_steps, "topic": self.topic,
        }  # fmt: skip

    @property
    def source(self) -> str:
        return f"tcp://{self.host}:{self.publish}"

    @property
    def replay_source(self) -> str:
        return f"tcp://{self.host}:{self.replay}"


def serve_node_argv(
    model: str, events: KvEventsPorts | None, sets: Mapping[str, Any] = {}, vllm_args: Sequence[str] = (), *,
    extra: Mapping[str, Any] | None = None, connector: bool = True,
) -> list[str]:
    """`kvprefetch serve MODEL` as a user runs it, publishing KV events (every tier's) on `events`' ports; `sets`
    are its `--set KEY=VALUE` (dotted keys; values as JSON), `extra` its `--extra` JSON object; `connector` False:
    `--no-connector` (vLLM alone). Host and port are `OpenAIServer`'s to add."""
    argv = [sys.executable, "-m", "kvprefetch.cli", "serve", model]
    if not connector:
        argv.append("--no-connector")
    if extra is not None:
        argv += ["--extra", json.dumps(dict(extra))]
    for key, value in sets.items():
        argv += ["--set", f"{key}={value if isinstance(value, str) else json.dumps(value)}"]
    if events is not None:
        argv += ["--kv-events-config", json.dumps(events.config())]
    return argv + list(vllm_args)


@dataclass(frozen=True)
class RouterWorker:
    """One worker behind the router: its HTTP URL and, for `kv_aware`, where its KV events come from."""

    url: str
    events: KvEventsPorts | None = None


@dataclass(frozen=True)
class Penalties:
    """How much of a block's prefill a hit in each tier is credited (`--kv-penalty-*`); None: the router's default
    (host 0.8, external 0.6, disk 0.3)."""

    host: float | None = None
    disk: float | None = None
    external: float | None = None

    def argv(self) -> list[str]:
        given = (("host", self.host), ("disk", self.disk), ("external", self.external))
        return [arg for flag, value in given if value is not None for arg in (f"--kv-penalty-{flag}", str(value))]


@dataclass(frozen=True)
class HealthChecks:
    """How the router checks its workers. Every second, and a second (not the default 30) between start-up checks:
    a test's router is up as soon as its workers are, and takes a dead one out within seconds."""

    interval_s: int = 1
    failure_threshold: int = 3
    success_threshold: int = 1
    startup_check_interval_s: int = 1
    startup_timeout_s: int = 120

    def argv(self) -> list[str]:
        return ["--health-check-interval-secs", str(self.interval_s),
                "--health-failure-threshold", str(self.failure_threshold),
                "--health-success-threshold", str(self.success_threshold),
                "--worker-startup-check-interval", str(self.startup_check_interval_s),
                "--worker-startup-timeout-secs", str(self.startup_timeout_s)]  # fmt: skip


@dataclass(frozen=True)
class RouterSpec:
    """A vllm-router's command line, typed. Ports 0: `VllmRouter` picks free ones."""

    workers: tuple[RouterWorker, ...]
    policy: Policy = "kv_aware"
    block_size: int = 128  # the engines' (vLLM's CPU build: 128)
    model: str | None = None  # --kv-event-model: the workers' shared model identity
    penalties: Penalties = Penalties()
    port: int = 0
    prometheus_port: int = 0
    health: HealthChecks = HealthChecks()
    log_level: str = "info"
    extra_args: tuple[str, ...] = field(default=())

    def with_free_ports(self) -> RouterSpec:
        return replace(self, port=self.port or free_port(), prometheus_port=self.prometheus_port or free_port())

    def argv(self) -> list[str]:
        """The arguments after `vllm-router`."""
        argv = ["--host", "127.0.0.1", "--port", str(self.port), "--policy", self.policy,
                "--worker-urls", *(w.url for w in self.workers),
                "--prometheus-host", "127.0.0.1", "--prometheus-port", str(self.prometheus_port),
                *self.health.argv(), "--log-level", self.log_level]  # fmt: skip
        if self.policy == "kv_aware":
            argv += ["--kv-event-block-size", str(self.block_size)]
            for w in self.workers:
                if w.events is not None:
                    argv += ["--kv-event-source", f"{w.url}={w.events.source}",
                             "--kv-event-replay-source", f"{w.url}={w.events.replay_source}"]  # fmt: skip
            if self.model is not None:
                argv += ["--kv-event-model", self.model]
            argv += self.penalties.argv()
        return argv + list(self.extra_args)


def router_executable() -> str:
    """The `vllm-router` launcher of this interpreter's environment (else the one on PATH)."""
    beside = Path(sys.executable).with_name("vllm-router")
    found = str(beside) if beside.exists() else shutil.which("vllm-router")
    if found is None:
        raise RuntimeError(f"vllm-router is not installed (pip install vllm-router=={ROUTER_VERSION}; "
                           "`make setup` installs the `router` extra)")  # fmt: skip
    return found


class VllmRouter:
    """One vllm-router process (the Python launcher runs the Rust router in-process). It leads a process group of
    its own, so `stop` leaves nothing behind; as a context manager it is stopped however the block ends."""

    def __init__(self, spec: RouterSpec, log_path: Path, env: Mapping[str, str] | None = None):
        self.spec = spec.with_free_ports()
        self.url = f"http://127.0.0.1:{self.spec.port}"
        self.metrics_url = f"http://127.0.0.1:{self.spec.prometheus_port}/metrics"
        self.log_path = log_path
        argv = [router_executable(), *self.spec.argv()]
        self._log = open(log_path, "w")  # noqa: SIM115  (closed in stop())
        self.proc = subprocess.Popen(argv, stdout=self._log, stderr=subprocess.STDOUT, start_new_session=True,
                                     env=dict(os.environ) | dict(env or {}))  # fmt: skip

    def __enter__(self) -> VllmRouter:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def wait_ready(self, timeout: float = 120) -> VllmRouter:
        """Until the router answers /readiness (it binds its port only once its workers answered their health
        checks) and its Prometheus exporter answers too."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"vllm-router exited ({self.proc.returncode}); log tail:\n{self.tail()}")
            if answers(self.url + "/readiness") and answers(self.metrics_url):
                return self
            time.sleep(0.3)
        raise TimeoutError(f"vllm-router not ready in {timeout:.0f} s; log tail:\n{self.tail()}")

    def metrics_text(self) -> str:
        with urllib.request.urlopen(self.metrics_url, timeout=10) as r:
            return r.read().decode()

    def metrics(self) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
        """The router's own metrics (its Prometheus port) as {(sample name, sorted labels): value}."""
        return parse_metrics(self.metrics_text())

    def tail(self, n: int = 60) -> str:
        return log_tail(self._log, self.log_path, n)

    def stop(self, timeout: float = 15) -> int:
        """SIGTERM to its process group (the router drains and exits), SIGKILL past `timeout`. Idempotent."""
        if self.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                self.kill()
        with contextlib.suppress(ProcessLookupError):  # anything the launcher left in its group
            os.killpg(self.proc.pid, signal.SIGKILL)
        self._log.close()
        return int(self.proc.returncode)

    def kill(self) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait()
