"""`kvprefetch bench --scenario cluster-serve` (issue 61): a real KV-aware router in front of two nodes.

What a user who outgrows one node runs, measured as a whole: two `kvprefetch serve` nodes (vLLM's OpenAI server
with the connector: its own DRAM pool and disk tier, the shared pool below over the node's shaped link, KV events
on), vllm-router in front of both, and a client that sends OpenAI requests to the router only (streamed, TTFT from
the first chunk, prompts as token ids: the router routes on KV only for those). After phase 1 (which measured the
prefill speed the links are shaped from):

1. **cluster** (`kvprefetch.testbed.cluster`): the pool's namespace and server, node-a and node-b joined to it by
   shaped links, and each node's front port on the machine (`netns.Fabric.link_host`) where the router and the
   client reach it.
2. **nodes** (`kvprefetch.testbed.serve_nodes`): per kind of node the modes need (`GROUPS`), a server on each node,
   all started at once: `tiers` (kvprefetch, every tier's KV events), `gpu` (kvprefetch, only vLLM's own GPU
   events: ``tier_events`` off), `lease` (tiers, and a lease on finish: ``keep_warm_s``) and `alone` (vLLM
   alone).
3. **rounds**: every mode's levels, modes interleaved within a round. Each cell starts from empty nodes (vLLM's
   reset with the connector's: engine prefix cache, DRAM pool and disk tier) and an empty pool, and a router of
   its own (`ROUTING`: the mode's policy, started before the first request, so a kv-aware one hears every event).
   Every turn of every session runs in the cell, so a session's prefix is what its earlier turns computed on
   whichever node served them, and with more live sessions than a node's engine KV holds it has left the engine
   for the node's tiers by its next turn. Every answer is compared with `recompute`'s of the round (by its text:
   greedy, the same tokens give the same text).
4. **node loss** (`--node-loss`): kv-tiers at the highest level, in passes, while node-b's server is SIGKILLed and
   started again `restart_after_s` later; every request recorded with the events' times.

Its section of results.json is `cluster_serve`; its rows are the lab's, with the cluster's figures
(`kvprefetch.bench.cluster_report`: where each turn went, where its prefix came from, the router's KV metrics).
"""

from __future__ import annotations

import contextlib
import subprocess
import threading
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

from kvprefetch.bench import cluster_report as R
from kvprefetch.bench.lab import START_FAILURES, Lab
from kvprefetch.bench.modes import StoreSizing, kvprefetch_extra
from kvprefetch.bench.options import ClusterServeOptions
from kvprefetch.bench.plan import BenchPlan
from kvprefetch.bench.populate import Populated, remove_pool
from kvprefetch.bench.scenarios.base import Scenario, Sections, Stage
from kvprefetch.bench.two_node import link_rate
from kvprefetch.testbed.client import EngineError
from kvprefetch.testbed.cluster import NODES, TwoNodeCluster, node_placement
from kvprefetch.testbed.http_sessions import HttpSession, Route, Target, drive_http, sessions_of
from kvprefetch.testbed.netns import Link
from kvprefetch.testbed.router import KvEventsPorts, Policy, RouterSpec, RouterWorker, VllmRouter, serve_node_argv
from kvprefetch.testbed.serve_nodes import NODE_MIDDLEWARE, NodeServer, NodeServerSpec
from kvprefetch.testbed.server import free_port, parse_metrics, with_word_tokenizer

SERVED_MODEL = "kvprefetch-bench"  # every node's --served-model-name, the router's --kv-event-model
LEASE_S = 30.0  # kv-tiers-lease: its nodes' keep_warm_s
POOL_RETRY_S = 1.0  # the pool's retry_after_s (as in the two-node scenario)
POOL_TIMEOUT_S = 1.0
KILL_AT_S = 5.0  # node loss: node-b's server SIGKILLed this long into the run
BACK_WINDOW_S = 30.0  # node loss: the run goes on this long after node-b is ready again
EVENTS_JOIN_S = 1.0  # a kv-aware router's subscriptions connect before the first request (ZeroMQ's slow joiner)


@dataclass(frozen=True)
class NodeKind:
    """What a kind of node runs: the connector or vLLM alone, whether its tiers' events join vLLM's, and its lease
    on finish (``keep_warm_s``: a node setting, not a request's: vllm-router 0.1.17 does not route a request that
    carries ``kv_transfer_params`` on KV)."""

    connector: bool
    tier_events: bool = False
    keep_warm_s: float = 0.0


GROUPS: dict[str, NodeKind] = {
    "tiers": NodeKind(connector=True, tier_events=True),
    "gpu": NodeKind(connector=True, tier_events=False),
    "lease": NodeKind(connector=True, tier_events=True, keep_warm_s=LEASE_S),
    "alone": NodeKind(connector=False),
}
POOL_DB = {"tiers": 1, "gpu": 2, "lease": 3}  # each kvprefetch group's database on the pool's server


@dataclass(frozen=True)
class Routing:
    """How a mode routes: vllm-router's policy (None: the client pins session i to node i mod 2, no router), and
    on which kind of nodes."""

    policy: Policy | None
    group: str


ROUTING: dict[str, Routing] = {
    "recompute": Routing("round_robin", "alone"),
    "round-robin": Routing("round_robin", "tiers"),
    "cache-aware": Routing("cache_aware", "tiers"),
    "kv-gpu": Routing("kv_aware", "gpu"),
    "kv-tiers": Routing("kv_aware", "tiers"),
    "kv-tiers-lease": Routing("kv_aware", "lease"),
    "pinned": Routing(None, "tiers"),
}


class ClusterServe(Scenario):
    kind = "cluster-serve"

    def plan(self, plan: BenchPlan) -> Stage | None:
        """Every running mode, on two nodes each, every round (the node kinds' servers start once)."""
        if plan.opts.scenario.kind != self.kind:
            return None
        modes = tuple(plan.running)
        return Stage(self.kind, modes, plan.stage_seconds(modes, 0, plan.opts.repeats) + 60 * len(GROUPS))

    def run(self, lab: Lab, population: Populated, stage: Stage) -> Sections:
        opts = lab.plan.opts.scenario
        assert isinstance(opts, ClusterServeOptions)
        return {"cluster_serve": ClusterRun(lab, population, opts).run(stage.modes)}

    def report(self, results: dict) -> list[str]:
        return R.markdown_lines(results)


class ClusterRun:
    """The scenario's phases on a lab whose phase 1 ran; `run()` returns results.json's `cluster_serve`."""

    def __init__(self, lab: Lab, pop: Populated, opts: ClusterServeOptions):
        self.lab, self.pop, self.opts, self.plan = lab, pop, opts, lab.plan
        self.rate = link_rate(pop.tps, self.plan.model.bytes_per_token)
        self.block_size = int(pop.engine_block_tokens or 128)
        self.dir = lab.files.work / "cluster"
        self.groups: dict[str, list[NodeServer]] = {}
        self.fronts: list[Link] = []
        self.reference: dict[tuple[int, int], dict[tuple[str, int], str]] = {}  # recompute's answers
        self.wrong: dict[str, int] = {}
        self.cluster: TwoNodeCluster | None = None

    # -- main -----------------------------------------------------------------------------------------------------
    def run(self, running: tuple[str, ...]) -> dict:
        o = self.plan.opts
        self.dir.mkdir(parents=True, exist_ok=True)
        self.lab.notes.append("cluster-serve: " + self.rate.sentence())
        section: dict[str, Any] = {
            "link": asdict(self.rate) | {"sentence": self.rate.sentence()}, "router_version": _router_version(),
            "node_kv_bytes": self._node_kv_bytes(), "node_dram_bytes": self._sizing(0).dram_bytes,
            "lease_s": LEASE_S, "pool": self.opts.pool,
            "routing": {m: asdict(ROUTING[m]) for m in running}}  # fmt: skip
        loss: dict[str, Any] = {}
        with TwoNodeCluster(self.dir / "pool", self.rate.bits_per_s) as cluster:
            self.cluster = cluster
            self.fronts = [cluster.fabric.link_host(cluster.node_ns(e)) for e in range(2)]
            try:
                ready = self._start_groups(running)
                for k in range(o.repeats):
                    for m in (m for m in running if ROUTING[m].group in ready):
                        where = f" behind vllm-router (round {k + 1} of {o.repeats})"
                        self.lab.run_cells(m, where, lambda c, m=m, k=k: self._cell(m, c, k), k)
                if self.opts.node_loss and "kv-tiers" in running and "tiers" in ready:
                    loss = self._node_loss()
            finally:
                self._close()
        return section | {"wrong_tokens": self.wrong, "node_loss": loss, "leftovers": cluster.leftovers()}

    # -- the nodes ------------------------------------------------------------------------------------------------
    def _node_kv_bytes(self) -> int:
        """Each node's engine KV: as asked, else room for two of the longest requests (a node's live sessions
        outgrow it: their KV is in the node's tiers when their next turns come)."""
        return self.opts.node_kv_bytes or 2 * self.plan.max_model_len * self.plan.model.bytes_per_token

    def _sizing(self, node: int) -> StoreSizing:
        """A node's DRAM tier: a quarter of what its half of the largest level's sessions grow to (so the DRAM
        tier churns and a lease has something to keep), its connector threads on the node's cores."""
        w, c = self.plan.workload, max(self.plan.opts.concurrency)
        tokens = sum(len(s.turns[-1].tokens) + s.turns[-1].max_tokens for s in w.levels[c])
        dram = max(int(tokens / 2 / 4 * self.plan.model.bytes_per_token), 16 * self.pop.chunk_bytes)
        return replace(self.pop.sizing, dram_bytes=dram, io_cpus=node_placement(node, 2).host_cpus)

    def _model_dir(self) -> str:
        """The model as a server loads it: the plan's, with a word-level tokenizer beside its config where it has
        none (the packaged tiny model: the OpenAI server needs a tokenizer; the client sends token ids)."""
        src = Path(self.plan.model.path)
        if not src.is_dir() or any(src.glob("tokenizer*")):
            return str(src)
        return str(with_word_tokenizer(src, self.dir / "model"))

    def _node_spec(self, group: str, e: int, model: str) -> NodeServerSpec:
        c = self.cluster
        assert c is not None
        kind, reach = GROUPS[group], self.fronts[e].b.ip
        events = replace(KvEventsPorts.free(), host=reach) if kind.connector else None
        place = node_placement(e, 2)
        p = self.plan
        vllm = ["--served-model-name", SERVED_MODEL, "--load-format", p.model.load_format or "auto",
                "--dtype", p.model.dtype, "--max-model-len", str(p.max_model_len),
                "--kv-cache-memory-bytes", str(self._node_kv_bytes()), "--max-num-seqs", str(p.max_num_seqs),
                "--max-num-batched-tokens", str(p.opts.engine.max_num_batched_tokens), "--seed", "0",
                "--enforce-eager", "--enable-prompt-tokens-details", *NODE_MIDDLEWARE]  # fmt: skip
        extra = self._extra(group, e) if kind.connector else None
        argv = serve_node_argv(model, events, {}, vllm, extra=extra, connector=kind.connector)
        cpus = tuple(sorted(set(place.model_cpus) | set(place.host_cpus)))
        return NodeServerSpec(f"{group}-{NODES[e]}", tuple(argv), free_port(), self.dir, netns=c.node_ns(e),
                              reach=reach, events=events, cpus=cpus)  # fmt: skip

    def _extra(self, group: str, e: int) -> dict[str, Any]:
        """The connector's config on node e of a kvprefetch group: DRAM pool, disk tier, the pool below."""
        c = self.cluster
        assert c is not None
        files = self.lab.files
        extra = kvprefetch_extra(self._sizing(e), files.work / f"disk-{group}-{NODES[e]}",
                                 files.pool(f"{group}-{NODES[e]}"), prefetch=True)  # fmt: skip
        kind = GROUPS[group]
        extra |= {"tier_events": kind.tier_events, "keep_warm_s": kind.keep_warm_s}
        if not self.opts.pool:
            return extra | {"tiers": ["dram", "disk"]}
        remote = c.remote_section(e, "kvprefetch:", POOL_RETRY_S, POOL_TIMEOUT_S, POOL_DB[group])
        return extra | {"tiers": ["dram", "disk", "remote"], "remote": remote}

    def _start_groups(self, running: tuple[str, ...]) -> set[str]:
        """Every node kind the modes need, both nodes each, all started at once; the kinds that came up."""
        model = self._model_dir()
        wanted = [g for g in GROUPS if any(ROUTING[m].group == g for m in running)]
        for g in wanted:
            self.lab.progress.update(f"cluster-serve: starting the {g} nodes")
            self.groups[g] = [NodeServer(self._node_spec(g, e, model)).start() for e in range(2)]
        ready = set()
        for g in wanted:
            try:
                for node in self.groups[g]:
                    node.wait_ready(900)
                ready.add(g)
                self.lab.progress.update(f"cluster-serve: the {g} nodes are up", 60)
            except START_FAILURES as err:
                for m in running:
                    if ROUTING[m].group == g:
                        self.lab.start_failed(m, err)
        return ready

    def _close(self) -> None:
        for nodes in self.groups.values():
            for node in nodes:
                node.stop()
        for g in self.groups:
            for e in range(2):
                remove_pool(self.lab.files.pool(f"{g}-{NODES[e]}"))

    # -- a cell ---------------------------------------------------------------------------------------------------
    def _empty(self, group: str) -> None:
        """Both nodes' engine prefix caches, DRAM pools and disk tiers emptied, and the group's pool database."""
        for node in self.groups[group]:
            deadline = time.monotonic() + 30
            while not node.reset():
                if time.monotonic() > deadline:
                    self.lab.notes.append(f"cluster-serve: {node.name} refused to reset; the cell starts warm")
                    break
                time.sleep(0.5)
        if group in POOL_DB and self.opts.pool:
            c = self.cluster
            assert c is not None and c.server is not None
            argv = ["redis-cli", "-p", str(c.server.port), "-n", str(POOL_DB[group]), "FLUSHDB"]
            subprocess.run(c.fabric.exec_argv(c.pool_ns, argv), check=True, capture_output=True, timeout=60)

    @contextlib.contextmanager
    def _router(self, mode: str, tag: str) -> Iterator[VllmRouter | None]:
        """The mode's router, ready (None for a mode the client routes itself); stopped however the block ends."""
        routing, nodes = ROUTING[mode], self.groups[ROUTING[mode].group]
        if routing.policy is None:
            yield None
            return
        events = routing.policy == "kv_aware"
        workers = tuple(RouterWorker(n.url, n.spec.events if events else None) for n in nodes)
        spec = RouterSpec(workers, routing.policy, block_size=self.block_size, model=SERVED_MODEL)
        with VllmRouter(spec, self.dir / f"router-{tag}.log") as router:
            try:
                router.wait_ready()
            except (RuntimeError, TimeoutError) as err:  # the cell fails, not the run
                raise EngineError(f"vllm-router did not start: {err}") from None
            if events:
                time.sleep(EVENTS_JOIN_S)
            yield router

    def _router_metrics(self, router: VllmRouter | None, tag: str) -> dict:
        """The router's metrics now ({} without one), their text kept beside its log."""
        if router is None:
            return {}
        text = router.metrics_text()
        (self.dir / f"router-{tag}.prom").write_text(text)
        return parse_metrics(text)

    def _route(self, mode: str, router: VllmRouter | None) -> Route:
        if router is not None:
            target = Target(router.url, SERVED_MODEL)
            return lambda i, k: target
        pinned = [Target(n.url, SERVED_MODEL) for n in self.groups[ROUTING[mode].group]]
        return lambda i, k: pinned[i % len(pinned)]

    def _sessions(self, c: int) -> list[HttpSession]:
        return sessions_of(self.plan.workload.levels[c])

    def _cell(self, mode: str, c: int, k: int) -> tuple[dict, dict]:
        group = ROUTING[mode].group
        self._empty(group)
        nodes = self.groups[group]
        before = [n.metrics() for n in nodes]
        with self._router(mode, f"{mode}-c{c}-r{k}") as router:
            res = drive_http(self._route(mode, router), self._sessions(c), c, self.plan.opts.cell_timeout_s)
            routed = self._router_metrics(router, f"{mode}-c{c}-r{k}")
        after = [n.metrics() for n in nodes]
        recs = res["records"]
        figures = R.request_figures(recs, [n.name for n in nodes]) | R.source_shares(before, after)
        return res, figures | {"router": R.router_figures(routed), "wrong_tokens": self._check(mode, recs, c, k)}

    def _check(self, mode: str, recs: list[dict], c: int, k: int) -> int | None:
        """Requests whose answer differs from recompute's in the round (None: recompute did not run)."""
        answers = {(r["sid"], r["turn"]): r.get("output_text") for r in recs if r.get("error") is None}
        if mode == "recompute":
            self.reference[(c, k)] = answers
        ref = self.reference.get((c, k))
        if ref is None:
            return None
        wrong = sum(1 for key, ids in answers.items() if key in ref and ref[key] != ids)
        self.wrong[mode] = self.wrong.get(mode, 0) + wrong
        return wrong

    # -- node loss ------------------------------------------------------------------------------------------------
    def _node_loss(self) -> dict:
        """kv-tiers at the highest level, in passes (the nodes and the pool as the last pass left them), while
        node-b's server is SIGKILLed at `KILL_AT_S` and started again `restart_after_s` later; the passes go on
        until `BACK_WINDOW_S` after it is ready. Every request with its pass and time since the start."""
        c, nodes = max(self.plan.opts.concurrency), self.groups["tiers"]
        self._empty("tiers")
        self.lab.progress.update(f"cluster-serve: node loss during kv-tiers @ {c}")
        events: dict[str, float] = {}
        recs: list[dict] = []
        with self._router("kv-tiers", "node-loss") as router:
            start = time.monotonic()
            injector = threading.Thread(target=self._lose, args=(nodes[1], start, events), daemon=True,
                                        name="cluster-node-loss")  # fmt: skip
            injector.start()
            passes = 0
            route, sessions = self._route("kv-tiers", router), self._sessions(c)

            def going() -> bool:  # until the node has been back for BACK_WINDOW_S
                return injector.is_alive() or time.monotonic() - start < events.get("ready", 0.0) + BACK_WINDOW_S

            while passes == 0 or going():
                res = drive_http(route, sessions, c, self.plan.opts.cell_timeout_s)
                shift = res["t0"] - start
                recs += [r | {"pass": passes} | {f: r[f] + shift for f in ("arrival", "first_token", "finish")
                                                  if r.get(f) is not None} for r in res["records"]]  # fmt: skip
                passes += 1
            injector.join()
            routed = self._router_metrics(router, "node-loss")
        ref = self.reference.get((c, 0), {})
        out = [{f: r.get(f) for f in R.LOSS_RECORD_KEYS} | {"wrong": R.wrong_answer(r, ref)} for r in recs]
        return {"mode": "kv-tiers", "concurrency": c, "passes": passes, "killed": nodes[1].name,
                "events": events, "records": out, "router": R.router_figures(routed)}

    def _lose(self, node: NodeServer, start: float, events: dict[str, float]) -> None:
        def at(t: float) -> None:
            time.sleep(max(0.0, start + t - time.monotonic()))

        at(KILL_AT_S)
        events["kill"] = time.monotonic() - start  # as the signal goes: a request that ends after it was in flight
        node.kill()
        at(events["kill"] + self.opts.restart_after_s)
        node.start()
        events["restart"] = time.monotonic() - start
        try:
            node.wait_ready(600)
            events["ready"] = time.monotonic() - start
        except START_FAILURES as err:
            self.lab.notes.append(f"cluster-serve: {node.name} did not come back: {str(err)[:500]}")


def _router_version() -> str | None:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("vllm-router")
    except PackageNotFoundError:
        return None
