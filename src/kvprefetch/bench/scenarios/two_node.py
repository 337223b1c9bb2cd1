"""`kvprefetch bench --scenario two-node` (issue 41): two nodes, one pool, over shaped links.

The run after phase 1 (`kvprefetch.bench.populate`, which measured this engine's prefill speed and wrote the
prelude to a disk tier), in place of the single scenario:

1. **cluster** (`kvprefetch.testbed.cluster`): a pool namespace with the pool's server (`--remote-backend`:
   redis-server, or a Mooncake Store's master and the process holding its memory), node-a and node-b each joined
   to it by a link shaped to `two_node.link_rate` (derived from the prefill speed), the link's rate measured once
   from node-a.
2. **nodes**: per mode, an engine in each node's namespace, each on its own core (launched two modes at a time:
   ten engines starting at once outgrow a 24 GiB machine).
3. **rounds**: every mode's levels, the modes interleaved within a round. Before each pool mode's cells the pool
   holds the prelude alone (emptied, then seeded from node-a), so no mode or round finds what another wrote;
   each cell starts with empty engine prefix caches and DRAM tiers (`local-only`: the DRAM of the
   node that served each conversation's prelude holds it, as that node computed it). Turns alternate nodes
   (`modes.route`) but in `same-node`. Every request's tokens are compared with `recompute`'s of the same round.
4. **faults** (`--faults`): `pool-prefetch` at the highest level, in passes, while the links go down for 10 s
   and the pool's server is SIGKILLed and restarted empty; every request is recorded with the fault windows
   (`two_node_report.fault_timeline`).

Its section of results.json is `two_node`; its rows are the lab's (`Lab.run_cells`), with the figures of two
nodes (`_figures`).
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

from kvprefetch.bench.lab import START_FAILURES, Lab
from kvprefetch.bench.modes import StoreSizing, node_transfer_config, route
from kvprefetch.bench.options import TwoNodeOptions
from kvprefetch.bench.plan import BenchPlan
from kvprefetch.bench.populate import Populated, remove_pool, seed_remote
from kvprefetch.bench.scenarios.base import Scenario, Sections, Stage
from kvprefetch.bench.two_node import link_rate
from kvprefetch.modes import MODE
from kvprefetch.testbed import protocol as P
from kvprefetch.testbed.alternating import drive_alternating, session_plan
from kvprefetch.testbed.client import EngineProcess
from kvprefetch.testbed.cluster import NODES, TwoNodeCluster, node_placement

POOL_RETRY_S = 1.0
"""The pool's `retry_after_s` here: after a failed call a node answers misses without asking for this long. A
short pause (the product's default is 5 s) so that hits come back soon after the pool does; each retry while it
is still down costs one `timeout_s`."""
FAULT_RECORD_KEYS = ("pass", "engine", "sid", "turn", "arrival", "first_token", "finish", "prompt_tokens",
                     "cached_tokens", "cached_external", "error")
"""What results.json keeps of each request of the fault run."""
LAUNCH_MODES = 2  # modes whose engines start at once
POOL_DB = 1  # the pool modes' Redis database (emptied and seeded again before each mode's cells in each round)
POOL_TIMEOUT_S = 1.0  # the pool's `timeout_s`: a call to a link that went down fails after this long
MOONCAKE_MIN_SEGMENT = 1 << 30  # the Mooncake pool's memory, at least


def mooncake_segment_bytes(pop: Populated, plan: BenchPlan) -> int:
    """The Mooncake pool's memory: the prelude and every chunk the rounds and the fault passes may write, twice
    over (a Mooncake pool evicts when full, Redis here grows), at least `MOONCAKE_MIN_SEGMENT`."""
    w = plan.workload
    chunks = pop.info["chunks_on_disk"] + 64 * (1 + sum(map(w.requests, w.levels)))
    return max(MOONCAKE_MIN_SEGMENT, int(2 * chunks * (pop.chunk_bytes + 8192)))


@dataclass
class _ModeNodes:
    """A mode's engine on each node and what they own for the run."""

    mode: str
    engines: list[EngineProcess] = field(default_factory=list)
    pools: list[str] = field(default_factory=list)  # each node's DRAM pool
    disks: list[Path] = field(default_factory=list)


@dataclass
class FaultEvent:
    kind: str
    down_s: float  # seconds since the fault run started
    up_s: float | None = None


MOONCAKE_PROBE = """
import json, sys, time
from kvprefetch.config import RemoteConfig
from kvprefetch.tiers.disk import aligned_buffer
from kvprefetch.tiers.remote import open_backend
b = open_backend(RemoteConfig(**json.loads({section!r})))
n, mib = {n}, 1 << 20
region = aligned_buffer(8 * mib)
b.register_memory(region)
views = [region[i * mib : (i + 1) * mib] for i in range(8)]
names = [f"probe{{i}}" for i in range(n)]
for i in range(0, n, 8):
    b.write_from(names[i : i + 8], views)
t, c = time.perf_counter(), time.process_time()
for i in range(0, n, 8):
    assert min(b.read_into(names[i : i + 8], views)) == mib
print(n * mib / (time.perf_counter() - t), (time.process_time() - c) / n)
b.delete(names)
b.close()
"""
"""node-a's probe of a Mooncake pool (`TwoNodeRun._probe_link`): 1 MiB values put from registered memory, then
read back into it eight per call, timed; its last line is bytes/s and CPU seconds per MiB."""


class TwoNode(Scenario):
    kind = "two-node"

    def plan(self, plan: BenchPlan) -> Stage | None:
        """Every running mode, on two engines each, every round."""
        if plan.opts.scenario.kind != self.kind:
            return None
        modes = tuple(plan.running)  # (a two-node run calibrates no engine: `plan_bench`)
        return Stage(self.kind, modes, plan.stage_seconds(modes, 2, plan.opts.repeats))

    def run(self, lab: Lab, population: Populated, stage: Stage) -> Sections:
        opts = lab.plan.opts.scenario
        assert isinstance(opts, TwoNodeOptions)
        return {"two_node": TwoNodeRun(lab, population, opts).run(stage.modes)}

    def report(self, results: dict) -> list[str]:
        from kvprefetch.bench.two_node_report import markdown_lines

        return markdown_lines(results)


class TwoNodeRun:
    """The scenario's phases on a lab whose phase 1 ran; `run()` returns results.json's `two_node`."""

    def __init__(self, lab: Lab, pop: Populated, opts: TwoNodeOptions):
        self.lab, self.pop, self.opts = lab, pop, opts
        self.plan = lab.plan
        self.rate = link_rate(pop.tps, self.plan.model.bytes_per_token)
        self.reference: dict[tuple[int, int], dict[tuple[str, int], list[int]]] = {}  # recompute's tokens
        self.wrong: dict[str, int] = {}  # per mode: requests whose tokens differ from recompute's
        self.faults: dict[str, Any] = {}
        self.backend = self.plan.opts.store.remote_backend
        self.cluster: TwoNodeCluster | None = None
        self.seeds: list[dict] = []  # each reseed of a pool mode's database, and how long it took

    # -- main -----------------------------------------------------------------------------------------------------
    def run(self, running: tuple[str, ...]) -> dict:
        plan, files = self.plan, self.lab.files
        self.lab.notes.append("two-node: " + self.rate.sentence())
        section: dict[str, Any] = {
            "link": asdict(self.rate) | {"sentence": self.rate.sentence()}, "backend": self.backend,
            "node_disk": self.opts.node_disk, "faults_asked": list(self.opts.faults),
            "pool_retry_after_s": POOL_RETRY_S, "pool_timeout_s": POOL_TIMEOUT_S,
            "nodes": {NODES[e]: node_placement(e, 2).model_dump() for e in range(2)}}  # fmt: skip
        opened: dict[str, _ModeNodes] = {}
        segment = mooncake_segment_bytes(self.pop, plan) if self.backend == "mooncake" else 0
        with TwoNodeCluster(files.work / "pool", self.rate.bits_per_s, self.backend, segment_bytes=segment) as cluster:
            self.cluster = cluster
            if cluster.swept:
                self.lab.notes.append(f"two-node: removed what a run killed outright left: {', '.join(cluster.swept)}")
            section["link"] |= self._probe_link()
            try:
                for first in range(0, len(running), LAUNCH_MODES):
                    batch = running[first : first + LAUNCH_MODES]
                    for m in batch:
                        self._launch(m, opened)
                    for m in batch:
                        if m in opened:
                            self._ready(opened[m], opened)
                for k in range(plan.opts.repeats):
                    self._round(opened, k)
                if self.opts.faults and "pool-prefetch" in opened:
                    self.faults = self._fault_run(opened["pool-prefetch"])
            finally:
                for nodes in opened.values():
                    self._close(nodes)
        section["leftovers"] = cluster.leftovers()
        return section | {"wrong_tokens": self.wrong, "faults": self.faults, "seeds": self.seeds}

    # -- the link -------------------------------------------------------------------------------------------------
    def _probe_link(self, mib: int = 64) -> dict:
        """How node-a reads the pool: `mib` MiB of 1 MiB values written, then read back eight per call from inside
        its namespace on its core, then deleted (Redis: redis-py pipelines; Mooncake: kvprefetch's backend, batches
        into registered memory): the rate (bytes/s) and the CPU the reader spent per MiB (on a one-core node that CPU
        is the model's: what prefetching cannot overlap)."""
        c = self.cluster
        assert c is not None and c.server is not None
        if self.backend == "redis":
            url = c.server.url_at(c.reach[0].pool_ip)
            code = (
                "import redis,time\n"
                f"r=redis.Redis.from_url('{url}', db=15); v=b'x'*(1<<20); n={mib}\n"
                "for i in range(n): r.set(f'probe{i}', v)\n"
                "t=time.perf_counter(); c=time.process_time()\n"
                "for i in range(0,n,8):\n"
                "    p=r.pipeline(); [p.get(f'probe{j}') for j in range(i,min(n,i+8))]; p.execute()\n"
                "print(n*(1<<20)/(time.perf_counter()-t), (time.process_time()-c)/n); r.flushdb()\n"
            )
            reader = "redis-py, pipelines of 8"
        else:
            code = MOONCAKE_PROBE.format(section=json.dumps(c.remote_section(0, "probe:", 1.0, 30.0)), n=mib)
            reader = "kvprefetch's Mooncake backend, 8 per call"
        cpus = ",".join(map(str, node_placement(0, 2).host_cpus))
        argv = c.fabric.exec_argv(c.node_ns(0), ["taskset", "-c", cpus, sys.executable, "-c", code])
        out = subprocess.run(argv, capture_output=True, text=True, timeout=180)
        if out.returncode:
            self.lab.notes.append(f"two-node: the link probe failed: {out.stderr.strip()[-500:]}")
            return {}
        bps, cpu_per_mib = (float(x) for x in out.stdout.split()[-2:])
        link_per_mib = (1 << 20) / self.rate.bytes_per_s
        self.lab.notes.append(
            f"two-node: node-a read the pool ({self.backend}) at {bps / 1e6:,.0f} MB/s over its link (shaped to "
            f"{self.rate.bytes_per_s / 1e6:,.0f} MB/s), spending {cpu_per_mib * 1e3:.2f} ms of its core per MiB "
            f"received ({100 * cpu_per_mib / link_per_mib:.0f}% of the link's {link_per_mib * 1e3:.2f} ms per MiB)")
        return {"measured_read_bps": bps, "reader_cpu_s_per_mib": cpu_per_mib, "reader": reader}

    # -- the nodes ------------------------------------------------------------------------------------------------
    def _sizing(self, mode: str, node: int) -> StoreSizing:
        """Each node's tiers, the connector's threads on the node's cores. Its DRAM tier holds every prompt of the
        largest level whole (`local-only`: with turns alternating, a node computes some turn of every conversation,
        and what its DRAM loses it recomputes), or half of them (the pool modes: a node serves half the turns, and
        what it evicts is in the pool), with a quarter to spare."""
        w, c = self.plan.workload, max(self.plan.opts.concurrency)
        chunks = -(-w.max_prompt_tokens() // self.pop.chunk_tokens) + 1
        share = 1.0 if mode == "local-only" else 0.5
        dram = int(1.25 * share * len(w.levels[c]) * chunks * (self.pop.chunk_bytes + 8192)) + (32 << 20)
        return replace(self.pop.sizing, dram_bytes=dram, io_cpus=node_placement(node, 2).host_cpus)

    def _launch(self, mode: str, opened: dict[str, _ModeNodes]) -> None:
        c = self.cluster
        assert c is not None
        files = self.lab.files
        nodes = opened[mode] = _ModeNodes(mode)
        try:
            for e in range(2):
                pool = files.pool(f"{mode}-{NODES[e]}")
                disk = files.work / f"disk-{mode}-{NODES[e]}" if self.opts.node_disk else None
                pooled = MODE[mode].pool
                remote = c.remote_section(e, "kvprefetch:", POOL_RETRY_S, POOL_TIMEOUT_S, POOL_DB) if pooled else None
                kvt = node_transfer_config(mode, self._sizing(mode, e), pool, remote=remote, disk_dir=disk)
                spec = self.plan.engine_spec(kvt, cgroup=None)
                spec = spec.model_copy(update={"process": P.ProcessSpec(netns=c.node_ns(e),
                                                                         topology=node_placement(e, 2))})
                nodes.pools.append(pool)
                if disk is not None:
                    nodes.disks.append(disk)
                nodes.engines.append(self.lab.launch(f"{mode}@{NODES[e]}", spec))
        except START_FAILURES as err:
            self._failed(opened.pop(mode), err)

    def _ready(self, nodes: _ModeNodes, opened: dict[str, _ModeNodes]) -> None:
        try:
            for e, eng in enumerate(nodes.engines):
                self.lab.warm_up(f"{nodes.mode}@{NODES[e]}", eng)
        except START_FAILURES as err:
            self._failed(opened.pop(nodes.mode), err)

    def _failed(self, nodes: _ModeNodes, err: BaseException) -> None:
        self._close(nodes)
        self.lab.start_failed(nodes.mode, err)

    def _close(self, nodes: _ModeNodes) -> None:
        for eng in nodes.engines:
            eng.close()
        for pool in nodes.pools:
            remove_pool(pool)
        for d in nodes.disks:
            shutil.rmtree(d, ignore_errors=True)

    # -- the pool's databases ---------------------------------------------------------------------------------------
    def _reseed(self, nodes: _ModeNodes) -> None:
        """A pool mode's database emptied, then the prelude's chunks written into it from node-a (over its link)."""
        assert self.cluster is not None
        self.cluster.empty_pool(POOL_DB)
        nodes.engines[0].call(P.CoolDram())  # a chunk still in its DRAM would not be written
        t = time.perf_counter()
        seed_remote(self.plan, self.lab.files, nodes.mode, nodes.engines[0], self.lab.progress.update)
        self.seeds.append({"mode": nodes.mode, "seconds": time.perf_counter() - t})

    # -- rounds ---------------------------------------------------------------------------------------------------
    def _round(self, opened: dict[str, _ModeNodes], k: int) -> None:
        o = self.plan.opts
        for m, nodes in opened.items():
            if MODE[m].pool:
                self._reseed(nodes)
            where = f" on 2 nodes (round {k + 1} of {o.repeats})" if o.repeats > 1 else " on 2 nodes"
            self.lab.run_cells(m, where, lambda c, nodes=nodes, k=k: self._cell(nodes, c, k), k)

    def _cold(self, nodes: _ModeNodes, c: int) -> None:
        """Both nodes' engine prefix caches emptied and their DRAM tiers too (the pool keeps what they wrote)."""
        for eng in nodes.engines:
            self.lab.reset(eng, nodes.mode, c)
            if MODE[nodes.mode].connector:
                eng.call(P.CoolDram())

    def _cell(self, nodes: _ModeNodes, c: int, k: int) -> tuple[dict, dict]:
        mode = nodes.mode
        self._cold(nodes, c)
        if mode == "local-only":
            self._local_prelude(nodes, c, k)
        self.lab.settle(mode)
        assert self.cluster is not None
        cpu = self.cluster.pool_cpu_s()
        try:
            res = self._drive(nodes, c, f"{mode}-c{c}-r{k}")
        finally:
            self.lab.ran(mode)
        after = self.cluster.pool_cpu_s()
        pool_cpu = {"pool_cpu_s": after - cpu} if cpu is not None and after is not None else {}
        return res, self._figures(mode, res["records"], c, k) | pool_cpu

    def _drive(self, nodes: _ModeNodes, c: int, tag: str) -> dict:
        o = self.plan.opts
        sessions = session_plan(self.plan.workload.levels[c])
        return drive_alternating(nodes.engines, sessions, c, o.cell_timeout_s, tag, file=str(self.lab.files.workload),
                                 level=c, route=lambda i, t: route(nodes.mode, i, t))  # fmt: skip

    def _local_prelude(self, nodes: _ModeNodes, c: int, k: int) -> None:
        """Each conversation's prelude computed on the node that served it (turn -1's, `modes.route`), then that
        node's engine prefix cache emptied: its DRAM tier holds it, as after serving other work since."""
        by_node: dict[int, list[str]] = {}
        for i, s in enumerate(self.plan.workload.levels[c]):
            by_node.setdefault(route(nodes.mode, i, -1), []).append("p" + s.sid.rsplit("-s", 1)[1])
        for e, sids in by_node.items():
            nodes.engines[e].call(P.Run(file=str(self.lab.files.workload), level="prelude", concurrency=c, only=sids,
                                        tag=f"prelude-c{c}-r{k}", timeout_s=self.plan.opts.cell_timeout_s,
                                        flush=True))  # fmt: skip
            self.lab.reset(nodes.engines[e], nodes.mode, c)

    def _figures(self, mode: str, recs: list[dict], c: int, k: int) -> dict:
        """The row's two-node figures: requests per node, the turns served on another node than the conversation's
        last and how much of their prompts they found, and the requests whose tokens differ from recompute's."""
        by_turn = {(r["sid"], r["turn"]): r for r in recs}
        per_engine = [sum(1 for r in recs if r.get("engine") == e) for e in range(2)]
        cross = [r for r in recs if MODE[mode].pinned is False and r.get("error") is None]
        prompt = sum(int(r.get("prompt_tokens") or 0) for r in cross)
        found = sum(int(r.get("cached_tokens") or 0) for r in cross)
        tokens = {key: r.get("output_ids") for key, r in by_turn.items() if r.get("error") is None}
        if mode == "recompute":
            self.reference[(c, k)] = tokens
        ref = self.reference.get((c, k))
        wrong = None
        if ref is not None:
            wrong = sum(1 for key, ids in tokens.items() if key in ref and ref[key] != ids)
            self.wrong[mode] = self.wrong.get(mode, 0) + wrong
        return {"engines": 2, "requests_per_engine": per_engine, "cross_node_turns": len(cross),
                "cross_node_found_ratio": found / prompt if prompt else None, "wrong_tokens": wrong}  # fmt: skip

    # -- faults ---------------------------------------------------------------------------------------------------
    def _fault_run(self, nodes: _ModeNodes) -> dict:
        """`pool-prefetch` at the highest level, in passes (each from cold nodes, the pool as the last pass left
        it), while the faults asked happen one after another; every request with its pass and time."""
        c = max(self.plan.opts.concurrency)
        self._reseed(nodes)
        self.lab.progress.update(f"two-node faults: {', '.join(self.opts.faults)} during pool-prefetch @ {c}")
        start = time.monotonic()
        events: list[FaultEvent] = []
        injector = threading.Thread(target=self._inject, args=(start, events), name="two-node-faults", daemon=True)
        recs: list[dict] = []
        passes = 0
        injector.start()
        try:
            while injector.is_alive() or passes == 0:
                self._cold(nodes, c)
                res = self._drive(nodes, c, f"faults-p{passes}")
                shift = res["t0"] - start
                recs += [r | {"pass": passes} | {k: r[k] + shift for k in ("arrival", "first_token", "finish")
                                                  if r.get(k) is not None} for r in res["records"]]  # fmt: skip
                passes += 1
        finally:
            injector.join()
            assert self.cluster is not None
            self.cluster.set_links(True)
            if self.cluster.pool_down():
                self.cluster.restart_pool()
        ref = self.reference.get((c, 0), {})
        out = [{k: r.get(k) for k in FAULT_RECORD_KEYS} | {
            "wrong": None if (r["sid"], r["turn"]) not in ref or r.get("error") else
            ref[(r["sid"], r["turn"])] != r.get("output_ids")} for r in recs]  # fmt: skip
        return {"mode": nodes.mode, "concurrency": c, "passes": passes, "wall_s": time.monotonic() - start,
                "pool_retry_after_s": POOL_RETRY_S,
                "events": [asdict(e) for e in events], "records": out}  # fmt: skip

    def _inject(self, start: float, events: list[FaultEvent]) -> None:
        """The faults, one after another from 3 s into the run, each followed by `settle_s` of calm."""
        c = self.cluster
        assert c is not None
        o = self.opts

        def at(t: float) -> None:
            time.sleep(max(0.0, start + t - time.monotonic()))

        t = 3.0
        verbs: dict[str, tuple[Callable[[], None], Callable[[], None], float]] = {
            "link": (lambda: c.set_links(False), lambda: c.set_links(True), o.link_down_s),
            "pool": (c.kill_pool, c.restart_pool, o.pool_down_s),
        }
        for kind in o.faults:
            down, up, seconds = verbs[kind]
            at(t)
            ev = FaultEvent(kind, time.monotonic() - start)
            events.append(ev)
            down()
            at(t + seconds)
            up()
            ev.up_s = time.monotonic() - start
            t = ev.up_s + o.settle_s
        at(t)
