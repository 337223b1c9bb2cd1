"""One benchmark engine: a vLLM `LLMEngine` driven by JSON lines on stdin.

    python -m kvprefetch.testbed.engine_proc '<json spec>'

The engine core runs in this process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``): the driver adds requests at their
arrival times and steps the engine itself, and the scheduler's connector is read here directly. With the
``gpu-node`` topology (`place`) the model runs in vLLM's multiprocess executor's worker, as in a deployment,
and what the bench reads of the workers' connectors comes back through ``collective_rpc``. Each op is one
function in `OPS`, keyed by its request model (`kvprefetch.testbed.protocol`, shared with the caller); replies
are single lines behind `protocol.MARK` on stdout (vLLM logs to the same streams). When the spec names a cgroup,
the process moves itself into it before anything starts, so every thread and process it creates is throttled
there. The tests drive their engines through the same protocol (`generate`, `warm`).
"""

from __future__ import annotations

import contextlib
import functools
import glob
import itertools
import json
import os
import queue
import random
import sys
import threading
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from kvprefetch.testbed import protocol as P
from kvprefetch.testbed.agent_client import AgentClient
from kvprefetch.testbed.probes import CpuMeter, HelperCpuMeter, StepRecorder, calibrate, local_cpu_s, random_prompt
from kvprefetch.testbed.sessions import SessionSchedule
from kvprefetch.testbed.snapshots import merge_snapshots

if TYPE_CHECKING:
    from kvprefetch.store import TieredStore


def _reply(obj: Any) -> None:
    """One reply line: a model as its fields, a dict as it is."""
    if isinstance(obj, P.BaseModel):
        obj = obj.model_dump(mode="json")
    sys.stdout.write(P.MARK + json.dumps(obj) + "\n")
    sys.stdout.flush()


def _join_cgroup(path: str | None) -> None:
    if path:
        Path(path, "cgroup.procs").write_text(str(os.getpid()))


def _proc_io() -> dict[str, int]:
    """Bytes this process made the storage layer read/write (O_DIRECT included; page-cache hits excluded)."""
    out = {}
    try:
        for line in Path("/proc/self/io").read_text().splitlines():
            k, _, v = line.partition(":")
            out[k.strip()] = int(v)
    except OSError:
        pass
    return {"read_bytes": out.get("read_bytes", 0), "write_bytes": out.get("write_bytes", 0)}


# ---- the engine -----------------------------------------------------------------------------------------------
def build_engine(spec: P.EngineSpec):
    from vllm import EngineArgs, LLMEngine

    kwargs: dict[str, Any] = dict(
        model=spec.model,
        skip_tokenizer_init=True,
        dtype=spec.dtype,
        max_model_len=spec.max_model_len,
        kv_cache_memory_bytes=spec.kv_cache_bytes,
        max_num_seqs=spec.max_num_seqs,
        max_num_batched_tokens=spec.max_num_batched_tokens,
        enable_prefix_caching=spec.enable_prefix_caching,
        enforce_eager=True,
        seed=0,
    )
    if spec.load_format:
        from kvprefetch.loader.vllm_loader import LOAD_FORMAT, register

        if spec.load_format == LOAD_FORMAT:
            register()  # what the vllm.general_plugins entry point does (explicit: a venv may predate it)
        kwargs["load_format"] = spec.load_format
    if spec.model_loader_extra_config is not None:
        kwargs["model_loader_extra_config"] = spec.model_loader_extra_config
    if spec.kv_transfer_config:
        kwargs["kv_transfer_config"] = spec.kv_transfer_config
    kwargs.update(spec.engine_args)
    if isinstance(kwargs.get("kv_events_config"), dict):  # (EngineArgs takes the config object only)
        from vllm.config import KVEventsConfig

        kwargs["kv_events_config"] = KVEventsConfig(**kwargs["kv_events_config"])
    return LLMEngine.from_engine_args(EngineArgs(**kwargs))


def _live_connectors() -> list:
    try:
        from kvprefetch.vllm.connector import live_connectors
    except Exception:
        return []
    return live_connectors()


def _local_snapshot(_worker: Any = None) -> dict:
    """This process's connectors' counters and their stores' I/O stats, plus /proc/self/io (called in every
    worker process too, through `collective_rpc`; `_worker` is vLLM's worker object, unused)."""
    snap: dict[str, Any] = {"counters": {}, "store": {}, "io": {}, "proc": _proc_io()}
    conns = _live_connectors()
    if conns:
        from kvprefetch.vllm.metrics import snapshot_all

        snap["counters"] = snapshot_all()
    for c in conns:
        store = getattr(c, "store", None)
        if store is None:
            continue
        st = store.stats()
        for k, v in (st.get("store") or {}).items():
            snap["store"][k] = snap["store"].get(k, 0) + int(v)
        for key, io in (st.get("io") or {}).items():
            agg = snap["io"].setdefault(key, {"bytes": 0, "ops": 0, "busy_seconds": 0.0, "errors": 0})
            agg["bytes"] += int(io.get("bytes", 0))
            agg["ops"] += int(io.get("ops", 0))
            agg["busy_seconds"] += float(io.get("busy_seconds", 0.0))
            agg["errors"] += int(io.get("errors", 0))
            if key.startswith("disk/") and not key.endswith("/writeback"):  # a peak, not a count: not summed
                snap["peak_disk_reads_in_flight"] = max(snap.get("peak_disk_reads_in_flight", 0),
                                                        int(io.get("max_running", 0)))  # fmt: skip
    return snap


def _flush_here(_worker: Any = None) -> bool:
    return all(c.flush(timeout=300) for c in _live_connectors())


def _local_cpu_s(_worker: Any = None) -> dict[str, float | None]:
    """This process's CPU seconds (``own``) and its connector threads' (``helper``), for `collective_rpc`."""
    return {kind: local_cpu_s(kind) for kind in ("own", "helper")}


def _local_placement(_worker: Any = None) -> dict:
    """Which cores each thread of this process may run on: the main thread (``main``, the model's forward in a
    worker) and every Python thread by name (the connector's start with ``kvprefetch``)."""
    threads = {"main": sorted(os.sched_getaffinity(0))} if threading.current_thread() is threading.main_thread() else {}
    for t in threading.enumerate():
        if t.native_id is not None and t is not threading.main_thread():
            with contextlib.suppress(OSError):  # the thread ended meanwhile
                threads[t.name] = sorted(os.sched_getaffinity(t.native_id))
    return {"pid": os.getpid(), "threads": threads}


def pin_to_host(spec: P.EngineSpec) -> None:
    """The placement `place` describes, once the engine is built: every thread of this process and of its
    workers that no one bound (its mask still the whole machine) on the host cores, as if the process had taken
    them before it started any (vLLM bound the workers' OpenMP threads, the model's main thread among them, to
    the model's cores; the connector its own threads to ``io.cpus``)."""
    import psutil

    if spec.process.topology is None:
        return
    host, unbound = set(spec.process.topology.host_cpus), os.sched_getaffinity(0)
    me = psutil.Process()
    for proc in [me, *me.children(recursive=True)]:
        with contextlib.suppress(psutil.Error):
            for t in proc.threads():
                with contextlib.suppress(OSError):  # the thread ended meanwhile
                    if os.sched_getaffinity(t.id) == unbound:
                        os.sched_setaffinity(t.id, host)


def _scheduler_connector():
    for c in _live_connectors():
        if c.is_scheduler:
            return c
    return None


def place(spec: P.EngineSpec) -> P.EngineSpec:
    """A GPU node's division of labour on a CPU machine (`spec.process.topology`): the model's forward in vLLM's worker
    process(es) with their OpenMP threads bound to the model's cores (the "accelerator"), while this process (the
    client, the scheduler and its connector) and the connector threads of every process (``io.cpus``, set by the
    bench) run on the host cores. The workers are vLLM's multiprocess executor's, as in a `vllm serve`
    deployment, so the model does not share this process's interpreter lock. Without a topology every thread
    may run anywhere (tensor-parallel ranks still get a core each: `tp_cpu_env`). The host cores are taken once
    the engine is built (`pin_to_host`), so that its workers import torch and vLLM on every core (engines the
    bench starts together start in half the time on two cores)."""
    from kvprefetch.vllm.cpu import OMP_BIND, omp_threads_bind, tp_cpu_env

    topo, tp = spec.process.topology, spec.tensor_parallel_size
    if topo is None:
        os.environ.update(tp_cpu_env(tp))
        return spec
    os.environ[OMP_BIND] = omp_threads_bind(tp, list(topo.model_cpus))
    if topo.inproc:
        os.sched_setaffinity(0, topo.host_cpus)  # every thread this process starts from now on, there
        return spec
    return spec.model_copy(update={"engine_args": {"distributed_executor_backend": "mp"} | spec.engine_args})


class EngineChild:
    """The engine this process runs and what the ops need of it, wherever its workers run."""

    def __init__(self, engine):
        self.engine = engine
        self.driver = Driver(engine)
        self.workloads: dict[str, dict] = {}
        self.remote_workers = engine.vllm_config.parallel_config.distributed_executor_backend == "mp"

    def on_workers(self, fn: Callable[[Any], Any]) -> list:
        """fn run in every worker process (vLLM's multiprocess executor), or [] when the workers run here."""
        return list(self.engine.collective_rpc(fn)) if self.remote_workers else []

    def snapshot(self) -> dict:
        """The connector's counters (scheduler side here, worker sides wherever the workers run) and the stores'
        I/O stats, summed over this process and the worker processes."""
        parts = [_local_snapshot(), *self.on_workers(_local_snapshot)]
        snap = merge_snapshots(parts)
        peaks = [p["peak_disk_reads_in_flight"] for p in parts if "peak_disk_reads_in_flight" in p]
        if peaks:  # a peak, not a count: the largest process's, not their sum
            snap["peak_disk_reads_in_flight"] = max(peaks)
        sched = _scheduler_connector()
        if sched is not None:
            snap["ranks"] = {str(r): v for r, v in (sched.rank_stats() or {}).items()}  # per tensor-parallel rank
        return snap

    def cpu_s(self, kind: str) -> float | None:
        """CPU seconds of one kind summed over this process and the worker processes (None if one is unknown)."""
        vals = [p[kind] for p in [_local_cpu_s(), *self.on_workers(_local_cpu_s)]]
        return None if any(v is None for v in vals) else sum(vals)  # type: ignore[arg-type]

    def flush(self) -> bool:
        """Until every save started so far is in the store and written back, here and in every worker."""
        return all(self.on_workers(_flush_here)) and _flush_here()

    def reset_prefix_cache(self, attempts: int = 100) -> bool:
        """Empty the engine's prefix cache. vLLM refuses while a finished request's blocks are still held for
        the connector's save, and frees them only in a step, so step the (otherwise idle) engine between
        attempts."""
        for _ in range(attempts):
            if self.engine.reset_prefix_cache() is not False:
                return True
            self.engine.step()
            time.sleep(0.01)
        return False

    def workload(self, path: str) -> dict:
        if path not in self.workloads:
            self.workloads[path] = json.loads(Path(path).read_text())
        return self.workloads[path]


class Requests:
    """The requests a driver has in the engine, each a record the bench reads: when it arrived and was submitted,
    when each output token came, how it finished, and how much of its prompt was cached where."""

    def __init__(self, engine, tag: str, prefill: dict[str, tuple[int, int]]):
        self.engine, self.tag, self._prefill = engine, tag, prefill
        self.recs: dict[str, dict] = {}
        self.live: set[str] = set()

    def add(self, sessions: list[dict], i: int, k: int, arrival: float, now: float) -> str:
        """Turn k of session i into the engine; its id (not live if the engine refused it: a failed record)."""
        from vllm import SamplingParams

        turn = sessions[i]["turns"][k]
        rid = f"{self.tag}-{sessions[i]['sid']}-t{k}"
        self.recs[rid] = {
            "sid": sessions[i]["sid"], "turn": k, "session": i, "prompt_tokens": len(turn["tokens"]),
            "arrival": arrival, "submitted": now, "token_times": [], "error": None,
        }  # fmt: skip
        # (a turn marked "save" asks the connector to save it whatever its save_policy: `declared_stored`)
        extra = {"kv_transfer_params": {"save": True}} if turn.get("save") else None
        sp = SamplingParams(max_tokens=int(turn["max_tokens"]), temperature=0.0, ignore_eos=True, extra_args=extra)
        try:
            self.engine.add_request(rid, {"prompt_token_ids": turn["tokens"]}, sp)
        except Exception as err:  # a request the engine refuses counts as an error, not a crash
            self.recs[rid]["error"] = f"{type(err).__name__}: {err}"
            return rid
        self.live.add(rid)
        return rid

    def outputs(self, outs: list, now: float) -> list[str]:
        """One engine step's outputs recorded at `now`; the ids of the requests that finished in it."""
        finished = []
        for o in outs:
            rec = self.recs.get(o.request_id)
            if rec is None or o.request_id not in self.live:
                continue
            c = o.outputs[0] if o.outputs else None
            n = len(c.token_ids) if c is not None else 0
            rec["token_times"] += [now] * (n - len(rec["token_times"]))
            if o.finished:
                self.live.discard(o.request_id)
                reason = getattr(c, "finish_reason", None) if c is not None else None
                if reason not in ("length", "stop") or not rec["token_times"]:
                    rec["error"] = f"finish_reason={reason}"
                rec["cached_tokens"] = int(o.num_cached_tokens or 0)
                rec["cached_local"], rec["cached_external"] = self._prefill.pop(o.request_id, (None, None))
                rec["output_ids"] = list(c.token_ids) if c is not None else []
                finished.append(o.request_id)
        return finished

    def abort_live(self) -> list[str]:
        """Every request still in the engine aborted and marked a timeout (the cell ran out of time)."""
        aborted = sorted(self.live)
        with contextlib.suppress(Exception):
            self.engine.abort_request(aborted)
        for rid in aborted:
            self.recs[rid]["error"] = "timeout"
        self.live.clear()
        return aborted


def final_record(rec: dict) -> dict:
    """A finished request's record as the bench stores it: first token, output count and inter-token gaps in
    place of the token times."""
    out = {k: v for k, v in rec.items() if k not in ("token_times", "session")}
    tt = rec["token_times"]
    return out | {"first_token": tt[0] if tt else None, "output_tokens": len(tt),
                  "itl": [b - a for a, b in itertools.pairwise(tt)]}  # fmt: skip


class Driver:
    """Adds each turn at its arrival time, steps the engine, and timestamps every output token."""

    def __init__(self, engine):
        self.engine = engine
        self.steps = StepRecorder(engine)
        self.prefill: dict[str, tuple[int, int]] = {}
        core = getattr(engine, "engine_core", None)
        get_output = getattr(core, "get_output", None)
        if get_output is not None:
            # Per-request split of cached prompt tokens (engine prefix cache vs connector), which vLLM reports
            # only on the engine-core outputs.
            def wrapped():
                out = get_output()
                for o in getattr(out, "outputs", ()) or ():
                    ps = getattr(o, "prefill_stats", None)
                    if ps is not None:
                        rid = str(o.request_id).rsplit("-", 1)[0]
                        self.prefill[rid] = (int(ps.num_local_cached_tokens), int(ps.num_external_cached_tokens))
                return out

            core.get_output = wrapped

    def run(
        self,
        sessions: list[dict],
        concurrency: int,
        timeout_s: float,
        tag: str,
        record_steps: bool = False,
        client: AgentClient | None = None,
    ) -> dict:
        """Run one level's sessions; with `record_steps`, the result also holds every engine step (`steps`);
        `client` is told when sessions start and turns arrive and finish (the agent workload's warm-up calls and
        lease samples)."""
        cell = _Cell(self, sessions, concurrency, tag, client)
        self.steps.records = [] if record_steps and self.steps.available else None
        errors = cell.drive(timeout_s)
        steps, self.steps.records = self.steps.records, None
        res = {"records": [final_record(r) for r in cell.requests.recs.values()], "wall_s": cell.wall_s,
               "errors": errors}  # fmt: skip
        if record_steps:
            res["steps"] = steps or []
        return res


class _Cell:
    """One `Driver.run`: its sessions' schedule, the requests in the engine, the client to tell."""

    def __init__(self, driver: Driver, sessions: list[dict], concurrency: int, tag: str,
                 client: AgentClient | None):  # fmt: skip
        self.driver, self.sessions, self.client = driver, sessions, client
        self.schedule = SessionSchedule(sessions, concurrency)
        self.requests = Requests(driver.engine, tag, driver.prefill)
        self.clock = time.perf_counter
        self.t0 = self.clock()
        self.wall_s = 0.0

    def now(self) -> float:
        return self.clock() - self.t0

    def drive(self, timeout_s: float) -> list[str]:
        """Until every session's last turn finished (or the timeout: the requests left are aborted); the errors."""
        deadline = self.t0 + timeout_s
        errors = []
        while self.schedule.waiting() or self.requests.live:
            self.start(self.now())
            if self.clock() > deadline:
                self.requests.abort_live()
                errors.append(f"cell timed out after {timeout_s:.0f}s")
                break
            if self.requests.live:
                self.step()
            else:
                self.idle()
        self.wall_s = self.now()
        return errors

    def start(self, now: float) -> None:
        """Sessions whose time came started, and turns whose time came submitted."""
        client = self.client
        for i in self.schedule.start_sessions(now):
            if client is not None:
                client.session_started(i, now)
        if client is not None:
            client.sample(now)
        for arrival, i, k in self.schedule.pop_due(now):
            if client is not None:
                client.turn_arriving(i, k, now)
            rid = self.requests.add(self.sessions, i, k, arrival, now)
            if rid not in self.requests.live:
                self.finish(rid, now)

    def step(self) -> None:
        started = self.clock()
        outs = self.driver.engine.step()
        self.driver.steps.step_done(started - self.t0, self.clock() - started)
        now = self.now()
        for rid in self.requests.outputs(outs, now):
            self.finish(rid, now)

    def finish(self, rid: str, now: float) -> None:
        rec = self.requests.recs[rid]
        rec["finish"] = now
        self.schedule.turn_done(rec["session"], rec["turn"], now, ok=rec["error"] is None)
        if self.client is not None and rec["error"] is None:
            self.client.turn_finished(rec["session"], rec["turn"], now)

    def idle(self) -> None:
        """Nothing in the engine: sleep until the next arrival (at most 50 ms)."""
        nxt = self.schedule.next_event_s()
        wait = (nxt - self.now()) if nxt is not None else 0.01
        time.sleep(min(max(wait, 0.0), 0.05))


# ---- the stores -----------------------------------------------------------------------------------------------
def _tiered(connector: Any) -> TieredStore:
    """A connector's store as the `TieredStore` it is: the testbed puts it in the states a cell starts from
    through the store's own calls (`preload_dram`, `cool_dram`, ...), which the connector's narrower view of it
    (`kvprefetch.vllm.store_api`) does not name."""
    from kvprefetch.store import TieredStore

    store = connector.store
    if not isinstance(store, TieredStore):
        raise TypeError(f"the connector's store is a {type(store).__name__}, not a TieredStore")
    return store


def _disk_keys(root: Path) -> list[bytes]:
    from kvprefetch.tiers.disk import chunk_keys

    return chunk_keys(root)


def preload_dram(max_chunks: int | None = None) -> dict:
    """Read every chunk of the disk tier into the shared DRAM pool (the `dram` mode's starting state)."""
    c = _scheduler_connector()
    if c is None:
        raise RuntimeError("preload_dram needs the kvprefetch connector")
    store = _tiered(c)
    keys = _disk_keys(Path(store.config.disk.path))[:max_chunks]
    t = time.perf_counter()
    in_dram = store.preload_dram(keys)
    return {"chunks": len(keys), "in_dram": in_dram, "seconds": time.perf_counter() - t}


def cool_dram(child: EngineChild) -> dict:
    """Drop every chunk of the disk tier from the DRAM pool (writes flushed first): a cell then starts with
    only the disk tier warm, as the first round's did. The leases of the cell before end first (they would carry
    its chunks into this one); nothing else is pinned between cells. Without a disk tier (the two-node
    scenario's diskless nodes) every unpinned chunk goes: the tier below (the pool) holds what the node wrote."""
    c = _scheduler_connector()
    if c is None:
        return {"dropped": 0}
    store = _tiered(c)
    child.flush()  # (every process's: with the workers in other processes, they save)
    leases = c.end_leases()
    keys = _disk_keys(Path(store.config.disk.path)) if store.config.disk_enabled else None  # None: every chunk
    return {"dropped": store.cool_dram(keys), "leases_ended": leases}


PROBE_MIN_S = 2.0
"""A disk probe reads for at least this long (its chunks again, dropped from its DRAM between passes): a kernel
read throttle lets a short burst through above its rate, so a probe over a small store measured a faster disk
than the cells later got."""


def disk_read_bandwidth(max_chunks: int, seconds: float, rate_limit_bps: int | None = None,
                        threads: int | None = None, stream_bps: float | None = None) -> dict:  # fmt: skip
    """Cold reads disk -> DRAM through a fresh store on the same disk directory (this process's throttle), for
    `PROBE_MIN_S` at least and `seconds` at most; `threads` reads in flight (default: the connector's), each
    stream capped at `stream_bps` (the emulated array's)."""
    c = _scheduler_connector()
    if c is None:
        raise RuntimeError("disk_read_bandwidth needs the kvprefetch connector")
    from kvprefetch.store import TieredStore

    cfg = c.store.config
    name = f"{c.store.dram.name}-probe-{random.randrange(1 << 30):x}"  # the bench removes its pools by prefix
    cfg = cfg.model_copy(update={"dram": cfg.dram.model_copy(update={"pool_name": name, "backing": "shm"})})
    given = {"read_rate_limit_bps": rate_limit_bps, "read_stream_bps": stream_bps, "threads": threads}
    io = {k: int(v) for k, v in given.items() if v}  # what is not given stays as the connector's store has it
    cfg = cfg.model_copy(update={"io": cfg.io.model_copy(update=io)})
    chunk_bytes = c.store.chunk_bytes
    keys = _disk_keys(Path(cfg.disk.path))
    random.Random(0).shuffle(keys)
    keys = keys[:max_chunks]
    cfg = cfg.model_copy(update={"dram": cfg.dram.model_copy(update={"capacity_bytes": (len(keys) + 8) * (
        chunk_bytes + 8192)})})  # fmt: skip
    store = TieredStore(cfg, chunk_bytes=chunk_bytes)
    done, elapsed = 0, 0.0
    t = time.perf_counter()
    try:
        while keys:
            for i in range(0, len(keys), 16):
                batch = keys[i : i + 16]
                h = store.prefetch(batch)
                h.wait(timeout=600)
                done += sum(1 for v in h.results().values() if v)
                store.cool_dram(batch)  # read from disk again in the next pass
                if time.perf_counter() - t > seconds:
                    break
            elapsed = time.perf_counter() - t
            if elapsed >= min(PROBE_MIN_S, seconds) or not done:
                break
    finally:
        store.close()
        with contextlib.suppress(Exception):
            store.dram.destroy()
    nbytes = done * chunk_bytes
    return {"chunks": done, "bytes": nbytes, "seconds": elapsed, "bps": nbytes / elapsed if elapsed > 0 else None}


def _stream_limit_here(bps: float | None, _worker: Any = None) -> int:
    """Cap each disk read stream of this process's connectors' stores (None: uncapped); how many were set."""
    stores = [_tiered(c) for c in _live_connectors() if c.store is not None]
    for store in stores:
        store.set_disk_stream_limit(bps)
    return len(stores)


def set_stream_limit(child: EngineChild, bps: float | None) -> dict:
    """The emulated array's per-stream cap, here and in every worker (a regime sweep changes it between
    regimes on engines already running)."""
    return {"stores": _stream_limit_here(bps) + sum(child.on_workers(functools.partial(_stream_limit_here, bps)))}


def seed_remote(src: str) -> dict:
    """Copy every chunk of a disk tier directory into this engine's remote tier (the remote mode's start),
    through a DRAM slot that is given back unpublished: the chunks land in the remote tier only."""
    from kvprefetch.tiers.disk import DiskTier

    c = _scheduler_connector()
    store = _tiered(c) if c is not None and c.store is not None else None
    if store is None or store.remote is None:
        raise RuntimeError("seed_remote needs the kvprefetch connector with a remote tier")
    keys = _disk_keys(Path(src))
    t = time.perf_counter()
    written = store.seed_remote(keys, DiskTier(src, 1 << 50, direct_io=False, fsync=False))
    return {"chunks": len(keys), "written": written, "seconds": time.perf_counter() - t}


def serve(child: EngineChild, sessions: list[dict], t0: float, tag: str, inbox: queue.Queue) -> dict:
    """Requests pushed by a coordinator in the parent (the two-instance scenario): `Add` (session i, turn k,
    arrival in seconds since t0 on the shared monotonic clock) until `End`; each finished request is sent
    back as an event at once, so the coordinator can route the session's next turn to another engine."""

    def now() -> float:
        return time.monotonic() - t0

    engine = child.engine
    before, cpu = child.snapshot(), CpuMeter(child.cpu_s)
    requests = Requests(engine, tag, child.driver.prefill)

    def done(rid: str) -> None:
        rec = requests.recs[rid]
        rec["finish"] = now()
        _reply({"event": "done", "rec": final_record(rec) | {"session": rec["session"]}})

    def handle(req: P.Request) -> bool:
        """False once the coordinator said `End`."""
        if isinstance(req, P.End):
            return False
        assert isinstance(req, P.Add)
        rid = requests.add(sessions, req.i, req.k, req.arrival, now())
        if rid not in requests.live:
            done(rid)
        return True

    serving = True
    while serving:
        with contextlib.suppress(queue.Empty):
            while serving:
                serving = handle(inbox.get(timeout=0.02) if not requests.live else inbox.get_nowait())
        if serving and requests.live:
            for rid in requests.outputs(engine.step(), now()):
                done(rid)
    for rid in requests.abort_live():  # the coordinator gave up (cell timeout)
        done(rid)
    return {"served": True, "foreign_cpu_cores": cpu.foreign_cores(), "before": before, "after": child.snapshot()}


def _read_until_end(inbox: queue.Queue) -> None:
    """Feed stdin's lines to a serve loop, up to and including its `End` (then stdin is main()'s again)."""
    for line in sys.stdin:
        req = P.decode(line)
        inbox.put(req)
        if isinstance(req, P.End):
            return
    inbox.put(P.End())


# ---- the ops ------------------------------------------------------------------------------------------------
def op_run(child: EngineChild, req: P.Run) -> dict:
    """One level (or the prelude) of the workload file, with the counters and CPU meters around it."""
    w = child.workload(req.file)
    conn = _scheduler_connector()
    sessions = w["prelude"] if req.level == "prelude" else w["levels"][str(req.level)]
    if req.level == "prelude" and conn is not None:  # (another connector is not asked)
        sessions = declared_stored(sessions)
    if req.only is not None:
        sessions = [s for s in sessions if s["sid"] in set(req.only)]
    if req.salt:
        sessions = salted(sessions, req.salt, child.engine.model_config.get_vocab_size())
    before = child.snapshot()
    cpu, helpers = CpuMeter(child.cpu_s), HelperCpuMeter(child.cpu_s)
    agent = AgentClient(sessions, conn, req.warm_ttl_s, req.tag) if req.agent else None
    pressure = None
    if req.pressure_life_s is not None and conn is not None:
        from kvprefetch.testbed.pressure import DramPressure

        pressure = DramPressure(conn.store.dram, req.pressure_life_s).start()
    try:
        res = child.driver.run(sessions, req.concurrency, req.timeout_s, req.tag, req.record_steps, client=agent)
    finally:
        dropped = pressure.stop() if pressure is not None else None
    if agent is not None:
        res["agent"] = agent.summary() | {"pressure_dropped_chunks": dropped}
    res["foreign_cpu_cores"] = cpu.foreign_cores()
    if req.flush:
        res["flushed"] = child.flush()
    res["helper_cpu_s"] = helpers.seconds()  # after the flush: the write-back is theirs too
    res["before"], res["after"] = before, child.snapshot()
    return res


def declared_stored(sessions: list[dict]) -> list[dict]:
    """The prelude's sessions with every turn marked to be saved (``kv_transfer_params {"save": true}``): the
    prelude stands for the conversations so far, which the workload declares stored, however often the connector's
    save_policy would have had to see them first (``seen``: a prompt seen once is not saved)."""
    return [s | {"turns": [t | {"save": True} for t in s["turns"]]} for s in sessions]


def salted(sessions: list[dict], salt: int, vocab: int) -> list[dict]:
    """The sessions with every turn's first token changed by `salt`: prompts nothing has seen (a workload with
    no reuse, measured again in a later round, must not find what the earlier round saved)."""
    out = []
    for s in sessions:
        turns = [t | {"tokens": [4 + (t["tokens"][0] - 4 + 7919 * salt) % (vocab - 4), *t["tokens"][1:]]}
                 if t["tokens"] else t for t in s["turns"]]  # fmt: skip
        out.append(s | {"turns": turns})
    return out


def op_serve(child: EngineChild, req: P.Serve) -> dict:
    """Requests pushed one by one from the parent until `End` (see `serve`)."""
    sessions = child.workload(req.file)["levels"][str(req.level)]
    inbox: queue.Queue = queue.Queue()
    reader = threading.Thread(target=_read_until_end, args=(inbox,), daemon=True)
    _reply({"serving": True})
    reader.start()
    res = serve(child, sessions, req.t0, req.tag, inbox)
    reader.join()
    return res


def op_warmup(child: EngineChild, req: P.Warmup) -> dict:
    sessions = [{"sid": f"w{k}", "arrival_s": 0.0, "turns": [{"tokens": random_prompt(
        req.tokens, req.vocab, 500 + k), "max_tokens": 4}]} for k in range(req.n)]  # fmt: skip
    return child.driver.run(sessions, req.n, 600, "warm") | {"records": []}


def op_calibrate(child: EngineChild, req: P.Calibrate) -> dict:
    return calibrate(child, **req.model_dump(exclude_none=True))


def op_geometry(child: EngineChild, req: P.Geometry) -> P.GeometryReply:
    c = _scheduler_connector()
    if c is None:
        return P.GeometryReply(chunk_bytes=None, tp_size=None, chunk_tokens=None, block_size=None)
    spec = c.spec
    parts = 1 if spec.replicated else spec.namespace.tp_size  # (MLA: one copy for every rank)
    return P.GeometryReply(chunk_bytes=spec.geo.chunk_bytes * parts, tp_size=spec.namespace.tp_size,
                           chunk_tokens=spec.chunk_tokens, block_size=spec.block_size,
                           chunk_tokens_configured=spec.settings.chunk_tokens,
                           kv_cache_groups=[g.kind for g in spec.groups.groups])  # fmt: skip


def op_chunk_keys(child: EngineChild, req: P.ChunkKeys) -> P.KeysReply:
    c = _scheduler_connector()
    if c is None:
        raise RuntimeError("chunk_keys needs the kvprefetch connector")
    keyers = [c.keyer] if c.spec.replicated else c.keyer.rank_keyers()  # (MLA: one copy for every rank)
    return P.KeysReply(keys=[[k.hex() for k in keyer.keys(req.tokens)] for keyer in keyers])


def op_generate(child: EngineChild, req: P.Generate) -> P.Generated:
    """Greedy completions with each token's logprob, in the prompts' order. `hold_until_prefetched`: every
    request arrives (its prefetch starts) before the engine takes a step, and the engine waits until every read
    into DRAM has finished, so whether a queued request's chunks are in DRAM when the scheduler reaches it is
    certain, not a race."""
    from vllm import SamplingParams

    engine = child.engine
    each = req.max_tokens_each or [req.max_tokens] * len(req.prompts)
    identities = req.identities or [None] * len(req.prompts)
    params = req.transfer_params or [None] * len(req.prompts)
    t0 = time.perf_counter()
    ids = [f"gen-{next(_GENERATIONS)}" for _ in req.prompts]
    for rid, p, n, who, tp in zip(ids, req.prompts, each, identities, params, strict=True):
        extra = {"kv_transfer_params": tp} if tp else None
        sp = SamplingParams(max_tokens=n, temperature=0.0, logprobs=1, ignore_eos=True, extra_args=extra)
        prompt, lora = _prompt(p, who)
        engine.add_request(rid, prompt, sp, lora_request=lora)
    landed = None
    if req.hold_until_prefetched:
        landed = all(c.wait_for_prefetches(timeout=120) for c in _live_connectors())
    done: dict[str, Any] = {}
    while len(done) < len(ids):
        for o in engine.step():
            if o.finished:
                done[o.request_id] = o
    return P.Generated(outputs=[_completion(done[rid]) for rid in ids], wall_s=time.perf_counter() - t0,
                       prefetches_landed=landed)  # fmt: skip


_GENERATIONS = itertools.count()
_LORA_IDS: dict[tuple[str, str], int] = {}  # (name, path) -> vLLM's per-process adapter id


def _prompt(tokens: list[int], who: P.PromptIdentity | None) -> tuple[dict[str, Any], Any]:
    """vLLM's prompt and LoRA request for a prompt of `tokens` with an identity (`P.PromptIdentity`; None: tokens
    alone, for the base model)."""
    who = who or P.PromptIdentity()
    prompt: dict[str, Any] = {"prompt_token_ids": tokens}
    if who.embeds_file:
        from safetensors.torch import load_file

        prompt = {"prompt_embeds": load_file(who.embeds_file)["embeds"]}
    if who.image_file:
        from PIL import Image

        prompt["multi_modal_data"] = {"image": Image.open(who.image_file).convert("RGB")}
    if who.cache_salt:
        prompt["cache_salt"] = who.cache_salt
    lora = None
    if who.lora_name:
        from vllm.lora.request import LoRARequest

        assert who.lora_path, "an adapter needs its directory"
        lora_id = _LORA_IDS.setdefault((who.lora_name, who.lora_path), len(_LORA_IDS) + 1)
        lora = LoRARequest(who.lora_name, lora_id, who.lora_path)
    return prompt, lora


def _completion(out: Any) -> P.Completion:
    c = out.outputs[0]
    lps = [float(d[t].logprob) for t, d in zip(c.token_ids, c.logprobs or [], strict=False)]
    return P.Completion(token_ids=list(c.token_ids), logprobs=lps)


def op_warm(child: EngineChild, req: P.Warm) -> P.Warmed:
    """The warm-up API in-process (what POST /v1/kvprefetch/warm calls), then up to `wait` seconds until the
    lease's chunks are all in DRAM (or the timeout), so that a test knows where the next request finds them."""
    sched = _scheduler_connector()
    if sched is None:
        raise RuntimeError("warm needs the kvprefetch connector")
    identity = None
    if req.identity is not None:
        from kvprefetch.vllm.identity import Identity, named_identity

        identity = named_identity(req.identity.lora_name, req.identity.lora_path, req.identity.cache_salt)
        if not isinstance(identity, Identity):
            raise RuntimeError(f"the warm-up's identity cannot be keyed: {identity}")
    counts = sched.warm(req.tokens, req.ttl_s, identity=identity)
    now = counts
    deadline = time.monotonic() + req.wait
    while now is not None and now.in_dram < now.chunks and time.monotonic() < deadline:
        time.sleep(0.01)
        now = sched.warm_status(counts.id)
    return P.Warmed(warm=counts.as_json() if counts else None, now=now.as_json() if now else None,
                    leases=sched.lease_stats())  # fmt: skip


def op_counters(child: EngineChild, req: P.Counters) -> P.CountersReply:
    """This process's connectors' counters (the scheduler's, and the workers' where they run here), each role's
    store stats, the cost model's estimates; and from `EngineChild.snapshot`, the per-rank stats and the stores'
    stats summed over every process."""
    from kvprefetch.vllm.metrics import snapshot_all

    conns = _live_connectors()
    stores, cost = {}, None
    for c in conns:
        if c.store is not None:
            stores[c.counters.role] = c.store.stats().get("store")
        cost = c.cost_snapshot() or cost
    snap = child.snapshot()
    return P.CountersReply(counters=snapshot_all() if conns else {}, stores=stores, cost=cost,
                           ranks=snap.get("ranks") or None, store=snap["store"])  # fmt: skip


def op_placement(child: EngineChild, req: P.Placements) -> dict:
    return {"engine": _local_placement(), "workers": child.on_workers(_local_placement)}


OPS: dict[type[P.Request], Callable[[EngineChild, Any], Any]] = {
    P.Run: op_run,
    P.Serve: op_serve,
    P.Warmup: op_warmup,
    P.Calibrate: op_calibrate,
    P.Geometry: op_geometry,
    P.ChunkKeys: op_chunk_keys,
    P.Generate: op_generate,
    P.Warm: op_warm,
    P.Counters: op_counters,
    P.Placements: op_placement,
    P.SeedRemote: lambda child, req: seed_remote(req.src),
    P.Reset: lambda child, req: P.ResetReply(reset=child.reset_prefix_cache()),
    P.Flush: lambda child, req: P.Flushed(flushed=child.flush()),
    P.CoolDram: lambda child, req: cool_dram(child),
    P.PreloadDram: lambda child, req: preload_dram(req.max_chunks),
    P.DiskBandwidth: lambda child, req: disk_read_bandwidth(
        req.max_chunks, req.seconds, req.rate_limit_bps, req.threads, req.stream_bps
    ),
    P.StreamLimit: lambda child, req: set_stream_limit(child, req.bps),
}


def start(spec: P.EngineSpec) -> tuple[EngineChild, Callable[[], None]]:
    """The engine this process runs (placed, in its cgroup, with the spec's environment), and what to do at
    exit: vLLM's CPU build leaves its tensor-parallel shared-memory segments (/dev/shm/vllm_dist_*) behind when
    the process ends, so those this engine created are removed."""
    _join_cgroup(spec.process.cgroup)
    if spec.process.netns:
        from kvprefetch.testbed.netns import join

        join(spec.process.netns)
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    os.environ.update(spec.process.env)
    spec = place(spec)
    shm_before = set(glob.glob("/dev/shm/vllm_dist_*"))
    child = EngineChild(build_engine(spec))
    pin_to_host(spec)
    shm_mine = set(glob.glob("/dev/shm/vllm_dist_*")) - shm_before

    def cleanup() -> None:
        # vLLM's executor unlinks its shared-memory queues (/dev/shm/psm_*) only when shut down; the workers
        # exit with it. (A killed engine leaves them: the parent ends its process group.)
        with contextlib.suppress(Exception):
            child.engine.engine_core.shutdown()
        for f in shm_mine:
            with contextlib.suppress(OSError):
                os.unlink(f)

    return child, cleanup


def answer(child: EngineChild, req: P.Request) -> None:
    """One request answered: its op's reply, or an error reply (the op failed)."""
    try:
        _reply(OPS[type(req)](child, req))
    except Exception as err:
        _reply({"error": f"{type(err).__name__}: {err}", "trace": traceback.format_exc()})


def main() -> None:
    spec = P.EngineSpec.model_validate_json(sys.argv[1])
    try:
        child, cleanup = start(spec)
    except Exception as err:
        _reply({"error": f"engine start failed: {type(err).__name__}: {err}", "trace": traceback.format_exc()})
        os._exit(3)
    _reply({"ready": True, "pid": os.getpid()})
    for line in sys.stdin:
        try:
            req = P.decode(line)
        except ValueError as err:  # an unknown op or a bad field: said, and the engine carries on
            _reply({"error": f"bad request: {err}"})
            continue
        if isinstance(req, P.Exit):
            cleanup()
            _reply({"bye": True})
            break
        answer(child, req)
    os._exit(0)  # skip interpreter teardown of the engine's threads


if __name__ == "__main__":
    main()
