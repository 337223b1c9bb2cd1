"""One benchmark engine: a vLLM `LLMEngine` in this process, driven by JSON lines on stdin.

    python -m kvprefetch.bench.engine_proc '<json spec>'

The engine runs in-process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``), so the scheduler and the worker share this
process: the driver adds requests at their arrival times and steps the engine itself, and the connector's
counters and its stores' I/O statistics are read here directly. Replies are single lines prefixed with
``@@KVB `` on stdout (vLLM logs to the same streams). When the spec names a cgroup, the process moves itself
into it before anything starts, so every thread it creates is throttled there.
"""

from __future__ import annotations

import contextlib
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
from typing import Any

import numpy as np

from kvprefetch.bench.sessions import SessionSchedule

MARK = "@@KVB "
_ENGINE: Any = None  # set in main; with vLLM's multiprocess executor its workers are other processes


def _reply(obj: Any) -> None:
    sys.stdout.write(MARK + json.dumps(obj) + "\n")
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
def build_engine(spec: dict):
    from vllm import EngineArgs, LLMEngine

    kwargs: dict[str, Any] = dict(
        model=spec["model"],
        skip_tokenizer_init=True,
        dtype=spec.get("dtype", "auto"),
        max_model_len=spec["max_model_len"],
        kv_cache_memory_bytes=spec["kv_cache_bytes"],
        max_num_seqs=spec["max_num_seqs"],
        max_num_batched_tokens=spec["max_num_batched_tokens"],
        enable_prefix_caching=True,
        enforce_eager=spec.get("enforce_eager", True),
        seed=0,
    )
    if spec.get("load_format"):
        kwargs["load_format"] = spec["load_format"]
    if spec.get("kv_transfer_config"):
        kwargs["kv_transfer_config"] = spec["kv_transfer_config"]
    kwargs.update(spec.get("engine_args") or {})
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


def _merge_snapshots(snaps: list[dict]) -> dict:
    out: dict[str, Any] = {"counters": {}, "store": {}, "io": {}, "proc": {}}
    for snap in snaps:
        for part in ("counters", "store", "proc"):
            for k, v in snap.get(part, {}).items():
                out[part][k] = out[part].get(k, 0) + v
        for key, io in snap.get("io", {}).items():
            agg = out["io"].setdefault(key, {})
            for k, v in io.items():
                agg[k] = agg.get(k, 0) + v
        if "peak_disk_reads_in_flight" in snap:
            out["peak_disk_reads_in_flight"] = max(out.get("peak_disk_reads_in_flight", 0),
                                                   snap["peak_disk_reads_in_flight"])  # fmt: skip
    return out


def counters_snapshot() -> dict:
    """The connector's counters (scheduler side here, worker sides wherever the workers run) and the stores' I/O
    stats, summed over this process and the worker processes."""
    snap = _merge_snapshots([_local_snapshot(), *_on_workers(_local_snapshot)])
    sched = _scheduler_connector()
    if sched is not None:
        snap["ranks"] = {str(r): v for r, v in (sched.rank_stats() or {}).items()}  # per tensor-parallel rank
    return snap


def _on_workers(fn: Callable[[Any], Any]) -> list:
    """fn run in every worker process (vLLM's multiprocess executor), or [] when the workers run here."""
    if _ENGINE is None or not _remote_workers(_ENGINE):
        return []
    return list(_ENGINE.collective_rpc(fn))


def _remote_workers(engine) -> bool:
    return engine.vllm_config.parallel_config.distributed_executor_backend == "mp"


def _scheduler_connector():
    for c in _live_connectors():
        if c.is_scheduler:
            return c
    return None


class StepRecorder:
    """What each engine step ran and how long it took: the batch (per request, tokens scheduled and tokens
    already computed), the scheduler's share of the step, and how many requests were left waiting. The
    simulator's step model is checked against these (`kvprefetch.sim.stepcheck`): it separates an error in
    step costs from one in scheduling."""

    def __init__(self, engine):
        self.records: list[dict] | None = None
        self.available = False
        self._last: tuple[Any, float, int] | None = None
        sched = getattr(getattr(getattr(engine, "engine_core", None), "engine_core", None), "scheduler", None)
        if sched is None:  # not vLLM's in-process engine core: nothing to record
            return
        schedule = sched.schedule

        def timed(*args, **kwargs):
            if self.records is None:  # not recording: the plain call
                return schedule(*args, **kwargs)
            t = time.perf_counter()
            out = schedule(*args, **kwargs)
            self._last = (out, time.perf_counter() - t, len(sched.waiting))
            return out

        sched.schedule = timed
        self.available = True

    def step_done(self, start: float, seconds: float) -> None:
        """Record the step that just ran (`start` on the cell's clock)."""
        if self.records is None or self._last is None:
            return
        out, sched_s, waiting = self._last
        self._last = None
        try:
            n = out.num_scheduled_tokens
            batch = [[n.get(r.req_id, 0), r.num_computed_tokens] for r in out.scheduled_new_reqs]
            cached = out.scheduled_cached_reqs
            batch += [
                [n.get(rid, 0), done] for rid, done in zip(cached.req_ids, cached.num_computed_tokens, strict=True)
            ]
        except (
            AttributeError,
            TypeError,
            ValueError,
        ):  # another vLLM's scheduler output: a diagnostic, never a failure
            self.records, self.available = None, False
            return
        if batch:
            self.records.append({"t": start, "s": seconds, "sched_s": sched_s, "waiting": waiting, "batch": batch})


class Driver:
    """Adds each turn at its arrival time, steps the engine, and timestamps every output token."""

    def __init__(self, engine):
        self.engine = engine
        self.steps = StepRecorder(engine)
        self._prefill: dict[str, tuple[int, int]] = {}
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
                        self._prefill[rid] = (int(ps.num_local_cached_tokens), int(ps.num_external_cached_tokens))
                return out

            core.get_output = wrapped

    def run(
        self, sessions: list[dict], concurrency: int, timeout_s: float, tag: str, record_steps: bool = False
    ) -> dict:
        """Run one level's sessions; with `record_steps`, the result also holds every engine step (`steps`)."""
        from vllm import SamplingParams

        eng = self.engine
        clock = time.perf_counter
        t0 = clock()
        schedule = SessionSchedule(sessions, concurrency)
        recs: dict[str, dict] = {}
        live: set[str] = set()
        errors: list[str] = []

        def submit(now: float) -> None:
            for arrival, i, k in schedule.pop_due(now):
                turn = sessions[i]["turns"][k]
                rid = f"{tag}-{sessions[i]['sid']}-t{k}"
                recs[rid] = {
                    "sid": sessions[i]["sid"], "turn": k, "session": i, "prompt_tokens": len(turn["tokens"]),
                    "arrival": arrival, "submitted": now, "token_times": [], "error": None,
                }  # fmt: skip
                sp = SamplingParams(max_tokens=int(turn["max_tokens"]), temperature=0.0, ignore_eos=True)
                try:
                    eng.add_request(rid, {"prompt_token_ids": turn["tokens"]}, sp)
                    live.add(rid)
                except Exception as err:  # a request the engine refuses counts as an error, not a crash
                    recs[rid]["error"] = f"{type(err).__name__}: {err}"
                    finish(rid, now)

        def finish(rid: str, now: float) -> None:
            rec = recs[rid]
            rec["finish"] = now
            schedule.turn_done(rec["session"], rec["turn"], now, ok=rec["error"] is None)

        self.steps.records = [] if record_steps and self.steps.available else None
        schedule.start_sessions(0.0)
        deadline = t0 + timeout_s
        while schedule.waiting() or live:
            now = clock() - t0
            schedule.start_sessions(now)
            submit(now)
            if clock() > deadline:
                for rid in list(live):
                    recs[rid]["error"] = "timeout"
                    live.discard(rid)
                with contextlib.suppress(Exception):
                    eng.abort_request([r for r, v in recs.items() if v["error"] == "timeout"])
                errors.append(f"cell timed out after {timeout_s:.0f}s")
                break
            if live:
                started = clock()
                outs = eng.step()
                self.steps.step_done(started - t0, clock() - started)
                now = clock() - t0
                for o in outs:
                    rid = o.request_id
                    rec = recs.get(rid)
                    if rec is None:
                        continue
                    c = o.outputs[0] if o.outputs else None
                    n = len(c.token_ids) if c is not None else 0
                    rec["token_times"] += [now] * (n - len(rec["token_times"]))
                    if o.finished:
                        live.discard(rid)
                        reason = getattr(c, "finish_reason", None) if c is not None else None
                        if reason not in ("length", "stop") or not rec["token_times"]:
                            rec["error"] = f"finish_reason={reason}"
                        rec["cached_tokens"] = int(o.num_cached_tokens or 0)
                        local, ext = self._prefill.pop(rid, (None, None))
                        rec["cached_local"], rec["cached_external"] = local, ext
                        finish(rid, now)
            else:
                nxt = schedule.next_event_s()
                wait = (nxt - now) if nxt is not None else 0.01
                time.sleep(min(max(wait, 0.0), 0.05))
        wall = clock() - t0
        steps, self.steps.records = self.steps.records, None
        out = []
        for rec in recs.values():
            tt = rec.pop("token_times")
            rec["first_token"] = tt[0] if tt else None
            rec["output_tokens"] = len(tt)
            rec["itl"] = [b - a for a, b in itertools.pairwise(tt)]
            rec.pop("session", None)
            out.append(rec)
        res = {"records": out, "wall_s": wall, "errors": errors}
        if record_steps:
            res["steps"] = steps or []
        return res


def random_prompt(n: int, vocab: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(4, vocab) for _ in range(n)]


def calibrate(driver: Driver, prompt_tokens: int, repeats: int, decode_tokens: int, vocab: int, seed: int = 0) -> dict:
    """Prefill and decode speeds of this engine, as the simulator's calibration needs them.

    - prefill of a fresh prompt, alone (``prefill_tokens_per_s``);
    - prefill of 256 new tokens on that prompt, now in the engine's prefix cache (``extend_s``): with the first,
      it separates the per-token cost from the attention cost;
    - the time to first token of a 16-token prompt (``request_floor_s``): the per-request cost outside the model;
    - the time to first token of that prompt once more, its KV now only in the DRAM tier (``reload_s``, the
      engine's prefix cache reset): the connector's load path into the engine, end to end;
    - one decode step of a short sequence alone (``decode_step_s``), of sixteen short ones together
      (``decode_wide_step_s``: the per-sequence cost of a step) and of four long ones together
      (``decode_batch_step_s``: with the others, the time to read the batch's KV).

    `seed` picks the prompts: an engine whose store holds another engine's calibration (a mode's engine on a copy
    of the populated disk tier) needs prompts of its own, or its "fresh" prefill is a load.

    Every sample starts once the previous one's KV is saved (the store flushed), so no write-back runs beside it.
    The fastest sample is the estimate: on a shared machine other processes only ever slow a sample down, and
    the CPU time they took during the calibration is reported next to it (``foreign_cpu_cores``).
    """
    cpu0 = CpuMeter()
    speeds, extends, reloads, not_fresh = [], [], [], 0
    extend_tokens = 256
    for k in range(repeats):
        prompt = random_prompt(prompt_tokens, vocab, seed + 1000 + k)
        rec = _first_token(driver, f"cal{k}", prompt)
        if rec is not None and rec.get("cached_tokens"):  # found in a cache: a load, not a prefill
            not_fresh += 1
        elif rec is not None:
            speeds.append(prompt_tokens / (rec["first_token"] - rec["arrival"]))
        flush_stores()
        ttft = _ttft(driver, f"ext{k}", prompt + random_prompt(extend_tokens, vocab, seed + 2000 + k))
        if ttft is not None:
            extends.append(ttft)
        flush_stores()
        if _reset_prefix_cache(driver.engine):
            rec = _first_token(driver, f"rel{k}", prompt)
            if rec is not None and rec.get("cached_external"):
                reloads.append((rec["first_token"] - rec["arrival"], int(rec["cached_external"])))
    floors = []
    for k in range(repeats):
        ttft = _ttft(driver, f"floor{k}", random_prompt(16, vocab, seed + 4000 + k))
        if ttft is not None:
            floors.append(ttft)
    steps = []
    for k in range(2):
        d = _one_turn(f"dec{k}", random_prompt(256, vocab, seed + 900 + k), decode_tokens)
        itl = sorted(driver.run([d], 1, 600, f"dec{k}")["records"][0]["itl"])
        if itl:
            steps.append(itl[len(itl) // 2])
    wide = 16
    short = [_one_turn(f"decw{k}", random_prompt(256, vocab, seed + 950 + k), decode_tokens) for k in range(wide)]
    wide_itl = _together_itl(driver.run(short, wide, 600, "decw")["records"])
    batch = 4
    long = [
        _one_turn(f"decb{k}", random_prompt(prompt_tokens, vocab, seed + 3000 + k), decode_tokens) for k in range(batch)
    ]
    batch_itl = _together_itl(driver.run(long, batch, 600, "decb")["records"])
    reload_s, reload_tokens = min(reloads) if reloads else (None, None)
    return {
        "prefill_tokens_per_s": max(speeds) if speeds else None,
        "prefill_samples": speeds,
        "prefill_not_fresh": not_fresh,  # samples dropped: the prompt was already cached (see `seed`)
        "prompt_tokens": prompt_tokens,
        "extend_tokens": extend_tokens,
        "extend_offset": prompt_tokens,
        "extend_s": min(extends) if extends else None,
        "extend_samples": extends,
        "request_floor_s": min(floors) if floors else None,
        "request_floor_samples": floors,
        "decode_step_s": min(steps) if steps else None,
        "decode_step_samples": steps,
        "decode_step_ctx": 256,
        "decode_batch": batch,
        "decode_batch_ctx": prompt_tokens,
        "decode_batch_step_s": batch_itl,
        "decode_wide": wide,
        "decode_wide_step_s": wide_itl,
        "reload_s": reload_s,
        "reload_tokens": reload_tokens,
        "reload_samples": [t for t, _ in reloads],
        "foreign_cpu_cores": cpu0.foreign_cores(),
    }


def _one_turn(sid: str, tokens: list[int], max_tokens: int) -> dict:
    """A session of one turn, due at once."""
    return {"sid": sid, "arrival_s": 0.0, "turns": [{"tokens": tokens, "max_tokens": max_tokens}]}


def _first_token(driver: Driver, sid: str, tokens: list[int]) -> dict | None:
    """The record of one prompt run alone for one token (None if it failed)."""
    r = driver.run([_one_turn(sid, tokens, 1)], 1, 600, sid)["records"][0]
    return None if r["first_token"] is None else r


def _ttft(driver: Driver, sid: str, tokens: list[int]) -> float | None:
    """Time to first token of one prompt run alone (None if it failed)."""
    r = _first_token(driver, sid, tokens)
    return None if r is None else r["first_token"] - r["arrival"]


def _together_itl(recs: list[dict]) -> float | None:
    """Median gap between tokens over the steps where every sequence of a batch was decoding (after the last
    prefill)."""
    start = max((r["first_token"] or 0.0) for r in recs)
    gaps = sorted(
        x
        for r in recs
        if r["first_token"] is not None
        for x, end in zip(r["itl"], r["first_token"] + np.cumsum(r["itl"]), strict=True)
        if end - x >= start
    )
    return gaps[len(gaps) // 2] if gaps else None


def _reset_prefix_cache(engine, attempts: int = 100) -> bool:
    """Empty the engine's prefix cache. vLLM refuses while a finished request's blocks are still held for the
    connector's save, and frees them only in a step, so step the (otherwise idle) engine between attempts."""
    for _ in range(attempts):
        if engine.reset_prefix_cache() is not False:
            return True
        engine.step()
        time.sleep(0.01)
    return False


class CpuMeter:
    """CPU time other processes took on this machine since creation, in cores (0 = the machine was ours)."""

    def __init__(self):
        self.t0 = time.monotonic()
        self.busy0 = _machine_busy_s()
        self.own0 = _engine_cpu_s("own")

    def foreign_cores(self) -> float | None:
        busy, own = _machine_busy_s(), _engine_cpu_s("own")
        dt_s = time.monotonic() - self.t0
        if busy is None or own is None or self.busy0 is None or self.own0 is None or dt_s <= 0:
            return None
        return max(0.0, ((busy - self.busy0) - (own - self.own0)) / dt_s)


def _local_cpu_s(_worker: Any = None) -> dict[str, float | None]:
    """This process's CPU seconds (``own``) and its connector threads' (``helper``)."""
    return {"own": _own_cpu_s(), "helper": _helper_cpu_s()}


def _engine_cpu_s(kind: str) -> float | None:
    """CPU seconds of one kind summed over this process and the worker processes (None if one is unknown)."""
    parts = [_local_cpu_s(), *_on_workers(_local_cpu_s)]
    vals = [p[kind] for p in parts]
    return None if any(v is None for v in vals) else sum(vals)  # type: ignore[arg-type]


def _machine_busy_s() -> float | None:
    try:
        fields = Path("/proc/stat").read_text().splitlines()[0].split()[1:]
    except (OSError, IndexError):
        return None
    vals = [int(x) for x in fields]
    busy = sum(vals[:8]) - vals[3] - (vals[4] if len(vals) > 4 else 0)  # all but idle and iowait
    return busy / os.sysconf("SC_CLK_TCK")


def _own_cpu_s() -> float | None:
    """The process's CPU seconds, its ended threads included: the scheduler's exact runtime (the same clock as
    `_thread_cpu_s`; ``os.times()`` is tick-sampled and scaled, and its difference from the threads' sum could
    exceed what it measures on a busy machine)."""
    try:
        return time.process_time()
    except OSError:
        return None


class HelperCpuMeter:
    """CPU seconds the connector's own threads took since creation: its loads, saves and storage I/O.

    That is the process's CPU less the main thread's and the native threads' (the model's OpenMP workers) and
    the other Python threads': threads that ended meanwhile (each step's loader) are counted too. On a CPU
    engine this is time the model did not get; the simulator charges it, per byte moved, to the steps. The
    threads are read one after another while they run, so a reading is good to a few hundredths of a second.
    """

    def __init__(self):
        self.start = _engine_cpu_s("helper")

    def seconds(self) -> float | None:
        now = _engine_cpu_s("helper")
        return None if now is None or self.start is None else round(max(0.0, now - self.start), 3)


def _helper_cpu_s() -> float | None:
    """Process CPU seconds not spent by the main thread, by native threads or by Python threads not ours."""
    total = _own_cpu_s()
    if total is None:
        return None
    try:
        tids = os.listdir("/proc/self/task")
    except OSError:  # no /proc: a diagnostic that is missing, never a failed cell
        return None
    ours = {t.native_id for t in threading.enumerate() if t.name.startswith("kvprefetch")}
    others = 0.0
    for tid in tids:
        if int(tid) not in ours:  # includes the main thread
            others += _thread_cpu_s(tid)
    return total - others


def _thread_cpu_s(tid: str) -> float:
    """One thread's CPU seconds: its exact runtime from schedstat (nanoseconds), else its utime + stime ticks."""
    try:
        return int(Path(f"/proc/self/task/{tid}/schedstat").read_text().split()[0]) / 1e9
    except (OSError, IndexError, ValueError):
        pass
    try:
        fields = Path(f"/proc/self/task/{tid}/stat").read_text().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return 0.0  # the thread ended between the listing and the read
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime, stime


def _disk_keys(root: Path) -> list[bytes]:
    keys = []
    for f in sorted(root.glob("??/*.kv")):
        try:
            keys.append(bytes.fromhex(f.name[:64]))
        except ValueError:
            continue
    return keys


def preload_dram(max_chunks: int | None = None) -> dict:
    """Read every chunk of the disk tier into the shared DRAM pool (the `dram` mode's starting state)."""
    c = _scheduler_connector()
    if c is None:
        raise RuntimeError("preload_dram needs the kvprefetch connector")
    store = c.store
    keys = _disk_keys(Path(store.config.disk.path))[:max_chunks]
    t = time.perf_counter()
    for i in range(0, len(keys), 256):
        store.prefetch(keys[i : i + 256]).wait(timeout=600)
    in_dram = sum(store.dram.contains_many(keys)) if keys else 0
    return {"chunks": len(keys), "in_dram": in_dram, "seconds": time.perf_counter() - t}


def cool_dram() -> dict:
    """Drop every chunk of the disk tier from the DRAM pool (writes flushed first): a cell then starts with
    only the disk tier warm, as the first round's did. Pinned chunks stay (none between cells)."""
    c = _scheduler_connector()
    if c is None:
        return {"dropped": 0}
    store = c.store
    flush_stores()  # (every process's: with TP > 1 the workers save)
    keys = _disk_keys(Path(store.config.disk.path))
    return {"dropped": sum(1 for k in keys if store.dram.discard(k))}


def disk_read_bandwidth(max_chunks: int, seconds: float, rate_limit_bps: int | None = None) -> dict:
    """Cold reads disk -> DRAM through a fresh store on the same disk directory (this process's throttle)."""
    c = _scheduler_connector()
    if c is None:
        raise RuntimeError("disk_read_bandwidth needs the kvprefetch connector")
    from kvprefetch.store import TieredStore

    cfg = c.store.config
    name = f"{c.store.dram.name}-probe-{random.randrange(1 << 30):x}"  # the bench removes its pools by prefix
    cfg = cfg.model_copy(update={"dram": cfg.dram.model_copy(update={"pool_name": name, "backing": "shm"})})
    if rate_limit_bps:
        cfg = cfg.model_copy(update={"io": cfg.io.model_copy(update={"read_rate_limit_bps": int(rate_limit_bps)})})
    chunk_bytes = c.store.chunk_bytes
    keys = _disk_keys(Path(cfg.disk.path))
    random.Random(0).shuffle(keys)
    keys = keys[:max_chunks]
    cfg = cfg.model_copy(update={"dram": cfg.dram.model_copy(update={"capacity_bytes": (len(keys) + 8) * (
        chunk_bytes + 8192)})})  # fmt: skip
    store = TieredStore(cfg, chunk_bytes=chunk_bytes)
    done = 0
    t = time.perf_counter()
    try:
        for i in range(0, len(keys), 16):
            h = store.prefetch(keys[i : i + 16])
            h.wait(timeout=600)
            done += sum(1 for v in h.results().values() if v)
            if time.perf_counter() - t > seconds:
                break
        elapsed = time.perf_counter() - t
    finally:
        store.close()
        with contextlib.suppress(Exception):
            store.dram.destroy()
    nbytes = done * chunk_bytes
    return {"chunks": done, "bytes": nbytes, "seconds": elapsed, "bps": nbytes / elapsed if elapsed > 0 else None}


def serve(engine, driver: Driver, sessions: list[dict], t0: float, tag: str, inbox: queue.Queue) -> dict:
    """Requests pushed by a coordinator in the parent (the two-instance scenario): ``add`` (session i, turn k,
    arrival in seconds since t0 on the shared monotonic clock) until ``end``; each finished request is sent
    back as an event at once, so the coordinator can route the session's next turn to another engine."""
    from vllm import SamplingParams

    def now() -> float:
        return time.monotonic() - t0

    before, cpu = counters_snapshot(), CpuMeter()
    recs: dict[str, dict] = {}
    live: set[str] = set()
    ending = False

    def done(rid: str) -> None:
        live.discard(rid)
        rec = recs[rid]
        tt = rec.pop("token_times")
        rec["finish"] = now()
        rec["first_token"] = tt[0] if tt else None
        rec["output_tokens"] = len(tt)
        rec["itl"] = [b - a for a, b in itertools.pairwise(tt)]
        _reply({"event": "done", "rec": rec})

    def handle(cmd: dict) -> None:
        nonlocal ending
        if cmd.get("op") == "end":
            ending = True
            return
        i, k = int(cmd["i"]), int(cmd["k"])
        turn = sessions[i]["turns"][k]
        rid = f"{tag}-{sessions[i]['sid']}-t{k}"
        recs[rid] = {"sid": sessions[i]["sid"], "turn": k, "session": i, "prompt_tokens": len(turn["tokens"]),
                     "arrival": float(cmd["arrival"]), "submitted": now(), "token_times": [],
                     "error": None}  # fmt: skip
        sp = SamplingParams(max_tokens=int(turn["max_tokens"]), temperature=0.0, ignore_eos=True)
        try:
            engine.add_request(rid, {"prompt_token_ids": turn["tokens"]}, sp)
            live.add(rid)
        except Exception as err:
            recs[rid]["error"] = f"{type(err).__name__}: {err}"
            done(rid)

    while True:
        try:
            while True:
                handle(inbox.get_nowait())
        except queue.Empty:
            pass
        if ending:
            break
        if not live:
            with contextlib.suppress(queue.Empty):
                handle(inbox.get(timeout=0.02))
            continue
        outs = engine.step()
        t = now()
        for o in outs:
            rec = recs.get(o.request_id)
            if rec is None or o.request_id not in live:
                continue
            c = o.outputs[0] if o.outputs else None
            n = len(c.token_ids) if c is not None else 0
            rec["token_times"] += [t] * (n - len(rec["token_times"]))
            if o.finished:
                reason = getattr(c, "finish_reason", None) if c is not None else None
                if reason not in ("length", "stop") or not rec["token_times"]:
                    rec["error"] = f"finish_reason={reason}"
                rec["cached_tokens"] = int(o.num_cached_tokens or 0)
                rec["cached_local"], rec["cached_external"] = driver._prefill.pop(o.request_id, (None, None))
                done(o.request_id)
    aborted = sorted(live)
    if aborted:  # the coordinator gave up (cell timeout)
        with contextlib.suppress(Exception):
            engine.abort_request(aborted)
        for rid in aborted:
            recs[rid]["error"] = "timeout"
            done(rid)
    return {"served": True, "foreign_cpu_cores": cpu.foreign_cores(), "before": before, "after": counters_snapshot()}


def _read_until_end(inbox: queue.Queue) -> None:
    """Feed stdin's lines to a serve loop, up to and including its ``end`` (then stdin is main()'s again)."""
    for line in sys.stdin:
        cmd = json.loads(line)
        inbox.put(cmd)
        if cmd.get("op") == "end":
            return
    inbox.put({"op": "end"})


def seed_remote(src: str) -> dict:
    """Copy every chunk of a disk tier directory into this engine's remote tier (the remote mode's start),
    through a DRAM slot that is given back unpublished: the chunks land in the remote tier only."""
    from kvprefetch.tiers.disk import DiskTier

    c = _scheduler_connector()
    store = getattr(c, "store", None)
    if store is None or store.remote is None:
        raise RuntimeError("seed_remote needs the kvprefetch connector with a remote tier")
    disk = DiskTier(src, 1 << 50, direct_io=False, fsync=False)
    keys = _disk_keys(Path(src))
    t, written = time.perf_counter(), 0
    for key in keys:
        slot = store.dram.allocate(key, store.chunk_bytes)
        if slot is None:
            continue
        try:
            disk.read_into(key, store.dram.image(slot))
            store.remote.write(key, store.dram.image(slot)[: store.image_bytes])
            written += 1
        finally:
            store.dram.abort(slot)
    return {"chunks": len(keys), "written": written, "seconds": time.perf_counter() - t}


def _flush_here(_worker: Any = None) -> bool:
    return all(c.flush(timeout=300) for c in _live_connectors())


def flush_stores() -> bool:
    """Until every save started so far is in the store and written back, in this process and every worker."""
    return all(_on_workers(_flush_here)) and _flush_here()


def place(spec: dict, tp: int) -> dict:
    """A GPU node's division of labour on a CPU machine (`spec["topology"]`: ``model_cpus``, ``host_cpus``):
    the model's forward in vLLM's worker process(es) with their OpenMP threads bound to the model's cores (the
    "accelerator"), while this process (the client, the scheduler and its connector) and the connector threads
    of every process (``io.cpus``, set by the bench) run on the host cores. The workers are vLLM's multiprocess
    executor's, as in a `vllm serve` deployment, so the model does not share this process's interpreter lock."""
    from kvprefetch.vllm.cpu import OMP_BIND, omp_threads_bind

    topo = spec["topology"]
    os.sched_setaffinity(0, set(topo["host_cpus"]))  # threads started from here on inherit it
    os.environ[OMP_BIND] = omp_threads_bind(tp, list(topo["model_cpus"]))
    args = dict(spec.get("engine_args") or {})
    args.setdefault("distributed_executor_backend", "mp")
    return spec | {"engine_args": args}


def main() -> None:
    spec = json.loads(sys.argv[1])
    _join_cgroup(spec.get("cgroup"))
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    os.environ.update(spec.get("env") or {})
    tp = int((spec.get("engine_args") or {}).get("tensor_parallel_size", 1))
    if spec.get("topology"):
        spec = place(spec, tp)
    else:
        from kvprefetch.vllm.cpu import tp_cpu_env

        os.environ.update(tp_cpu_env(tp))
    global _ENGINE
    try:
        engine = _ENGINE = build_engine(spec)
    except Exception as err:
        _reply({"error": f"engine start failed: {type(err).__name__}: {err}", "trace": traceback.format_exc()})
        os._exit(3)
    driver = Driver(engine)
    workloads: dict[str, dict] = {}
    _reply({"ready": True, "pid": os.getpid()})
    for line in sys.stdin:
        cmd = json.loads(line)
        op = cmd.pop("op")
        try:
            if op == "exit":
                _reply({"bye": True})
                break
            if op == "run":
                path = cmd["file"]
                if path not in workloads:
                    workloads[path] = json.loads(Path(path).read_text())
                w = workloads[path]
                sessions = w["prelude"] if cmd["level"] == "prelude" else w["levels"][str(cmd["level"])]
                before = counters_snapshot()
                cpu, helpers = CpuMeter(), HelperCpuMeter()
                res = driver.run(sessions, int(cmd["concurrency"]), float(cmd.get("timeout_s", 1800)),
                                 str(cmd.get("tag", cmd["level"])), bool(cmd.get("record_steps")))  # fmt: skip
                res["foreign_cpu_cores"] = cpu.foreign_cores()
                if cmd.get("flush"):
                    res["flushed"] = flush_stores()
                res["helper_cpu_s"] = helpers.seconds()  # after the flush: the write-back is theirs too
                res["before"], res["after"] = before, counters_snapshot()
                _reply(res)
            elif op == "serve":
                path = cmd["file"]
                if path not in workloads:
                    workloads[path] = json.loads(Path(path).read_text())
                inbox: queue.Queue = queue.Queue()
                reader = threading.Thread(target=_read_until_end, args=(inbox,), daemon=True)
                _reply({"serving": True})
                reader.start()
                res = serve(engine, driver, workloads[path]["levels"][str(cmd["level"])], float(cmd["t0"]),
                            str(cmd.get("tag", cmd["level"])), inbox)  # fmt: skip
                reader.join()
                _reply(res)
            elif op == "seed_remote":
                _reply(seed_remote(cmd["src"]))
            elif op == "warmup":
                sessions = [{"sid": f"w{k}", "arrival_s": 0.0, "turns": [{"tokens": random_prompt(
                    cmd["tokens"], cmd["vocab"], 500 + k), "max_tokens": 4}]} for k in range(cmd["n"])]  # fmt: skip
                _reply(driver.run(sessions, cmd["n"], 600, "warm") | {"records": []})
            elif op == "calibrate":
                names = ("prompt_tokens", "repeats", "decode_tokens", "vocab", "seed")
                _reply(calibrate(driver, **{k: cmd[k] for k in names if k in cmd}))
            elif op == "reset":
                _reply({"reset": _reset_prefix_cache(engine)})
            elif op == "flush":
                _reply({"flushed": flush_stores()})
            elif op == "cool_dram":
                _reply(cool_dram())
            elif op == "preload_dram":
                _reply(preload_dram(cmd.get("max_chunks")))
            elif op == "disk_bandwidth":
                _reply(
                    disk_read_bandwidth(cmd.get("max_chunks", 256), cmd.get("seconds", 10.0), cmd.get("rate_limit_bps"))
                )
            elif op == "geometry":
                c = _scheduler_connector()
                _reply(
                    {
                        # A chunk's bytes over every tensor-parallel rank (each rank stores its own part).
                        "chunk_bytes": c.geo.chunk_bytes * c.namespace.tp_size if c else None,
                        "tp_size": c.namespace.tp_size if c else None,
                        "chunk_tokens": c.keyer.chunk_tokens if c else None,
                        "block_size": c.block_size if c else None,
                    }
                )
            elif op == "counters":
                _reply(counters_snapshot())
            else:
                _reply({"error": f"unknown op {op!r}"})
        except Exception as err:
            _reply({"error": f"{type(err).__name__}: {err}", "trace": traceback.format_exc()})
    os._exit(0)  # skip interpreter teardown of the engine's threads


if __name__ == "__main__":
    main()
