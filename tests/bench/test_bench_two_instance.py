"""The two-instance scenario and the remote mode: cache wiring, turn routing, the coordinator (fake engines)."""

from __future__ import annotations

import itertools
from collections import deque
from pathlib import Path

import pytest

from kvprefetch.bench.modes import (
    MODES,
    TWO_INSTANCE_MODES,
    StoreSizing,
    kv_transfer_config,
    remote_section,
    route_turn,
    two_instance_caches,
)
from kvprefetch.bench.options import DEFAULT_MODES
from kvprefetch.testbed import protocol as P
from kvprefetch.testbed.alternating import drive_alternating
from kvprefetch.testbed.snapshots import merge_snapshots

SIZING = StoreSizing(chunk_tokens=256, dram_bytes=64 << 20, disk_bytes=1 << 30)


def _extra(mode: str, disk: Path, pool: str, **kw) -> dict:
    cfg = kv_transfer_config(mode, SIZING, disk, pool, **kw)
    assert cfg is not None and cfg["kv_connector"] == "KVPrefetchConnector"
    return cfg["kv_connector_extra_config"]


def test_new_modes_are_opt_in():
    for m in (*TWO_INSTANCE_MODES, "prefetch-remote"):
        assert m in MODES and m not in DEFAULT_MODES


def test_shared_caches_one_pool_one_disk(tmp_path):
    caches = two_instance_caches("shared-2x", tmp_path, "kvb-x")
    assert len(caches) == 2 and caches[0] == caches[1]
    extras = [_extra("shared-2x", d, p) for d, p in caches]
    assert extras[0]["dram"]["pool_name"] == extras[1]["dram"]["pool_name"]
    assert extras[0]["disk"]["path"] == extras[1]["disk"]["path"]
    assert all(e["prefetch"] is True and "remote" not in e for e in extras)


def test_private_caches_distinct_pools_and_disks(tmp_path):
    caches = two_instance_caches("private-2x", tmp_path, "kvb-x")
    assert len(caches) == 2
    extras = [_extra("private-2x", d, p) for d, p in caches]
    assert extras[0]["dram"]["pool_name"] != extras[1]["dram"]["pool_name"]
    assert extras[0]["disk"]["path"] != extras[1]["disk"]["path"]
    assert all(Path(e["disk"]["path"]).parent == tmp_path for e in extras)
    # the same store settings otherwise
    strip = [{k: v for k, v in e.items() if k not in ("dram", "disk")} for e in extras]
    assert strip[0] == strip[1]
    with pytest.raises(ValueError):
        two_instance_caches("prefetch", tmp_path, "kvb-x")


class _Redis:
    url = "redis://127.0.0.1:6390/0"


class _Mooncake:
    master = "127.0.0.1:50099"
    metadata_server = "http://127.0.0.1:8099/metadata"


def test_remote_mode_config(tmp_path):
    e = _extra("prefetch-remote", tmp_path / "d", "p", remote=remote_section("redis", _Redis()))
    assert e["tiers"] == ["dram", "disk", "remote"] and e["prefetch"] is True
    assert e["remote"] == {"backend": "redis", "redis": {"url": _Redis.url}}
    m = remote_section("mooncake", _Mooncake(), segment_bytes=1 << 28)
    assert m == {"backend": "mooncake", "mooncake": {"master": _Mooncake.master,
                                                     "metadata_server": _Mooncake.metadata_server,
                                                     "segment_bytes": 1 << 28}}  # fmt: skip
    with pytest.raises(ValueError):
        kv_transfer_config("prefetch-remote", SIZING, tmp_path, "p")
    # the store accepts what the bench generates
    from kvprefetch.config import StoreConfig

    cfg = StoreConfig.load(**{k: v for k, v in e.items() if k not in ("log_interval_s", "prefill_tps_prior",
                                                                       "disk_bps_prior", "load_mode")})  # fmt: skip
    assert cfg.remote_enabled and cfg.remote.redis.url == _Redis.url


def test_route_turn_alternates():
    assert [route_turn(k) for k in range(5)] == [0, 1, 0, 1, 0]
    assert [route_turn(k, 3) for k in range(4)] == [0, 1, 2, 0]


class FakeEngine:
    """Speaks the serve protocol; answers each request after `latency` fake seconds."""

    def __init__(self, name: int, clock, log: list, latency: float = 0.5):
        self.name, self.clock, self.log, self.latency = name, clock, log, latency
        self.q: deque = deque()
        self.t0 = 0.0
        self.pending: list[tuple[float, dict]] = []

    def call(self, req: P.Request):
        assert isinstance(req, P.Serve)
        self.t0 = req.t0
        return {"serving": True}

    def send(self, req: P.Request):
        now = self.clock() - self.t0
        if isinstance(req, P.End):
            self.q.append({"served": True, "foreign_cpu_cores": 0.5 + self.name,
                           "before": {"counters": {"loaded_chunks": 1}},
                           "after": {"counters": {"loaded_chunks": 3 + self.name}}})  # fmt: skip
            return
        assert isinstance(req, P.Add) and req.arrival <= now + 1e-9
        self.log.append((self.name, req.i, req.k, req.arrival))
        rec = {"sid": f"s{req.i}", "turn": req.k, "session": req.i, "prompt_tokens": 10,
               "arrival": req.arrival, "first_token": now + 0.1, "output_tokens": 2, "itl": [0.01],
               "error": None}  # fmt: skip
        self.pending.append((now + self.latency, rec))

    def poll(self, timeout=0.0):
        now = self.clock() - self.t0
        ready = [p for p in self.pending if p[0] <= now]
        for p in ready:
            self.pending.remove(p)
            self.q.append({"event": "done", "rec": p[1]})
        return self.q.popleft() if self.q else None


def test_drive_alternating_routes_and_orders_turns():
    t = [100.0]

    def clock():
        t[0] += 0.01  # every look at the clock advances fake time
        return t[0]

    log: list = []
    engines = [FakeEngine(0, clock, log), FakeEngine(1, clock, log)]
    sessions = [{"arrival_s": 0.0, "turns": [{"think_s": 0.0}, {"think_s": 0.2}, {"think_s": 0.2}]}
                for _ in range(3)]  # fmt: skip
    res = drive_alternating(engines, sessions, 2, 600, "t", file="w.json", level=2, clock=clock, idle_s=0)
    assert len(res["records"]) == 9 and res["errors"] == []
    for name, _i, k, _a in log:
        assert name == k % 2
    # a session's turns are strictly ordered: turn k+1 is sent after turn k finished plus its think time
    for i in range(3):
        arrivals = [a for _, j, _, a in sorted((x for x in log if x[1] == i), key=lambda x: x[2])]
        assert all(b >= a + 0.5 + 0.2 - 1e-6 for a, b in itertools.pairwise(arrivals))
    # at most 2 sessions at once: the third starts after one of the first two finished all its turns
    firsts = sorted(a for _, _, k, a in log if k == 0)
    assert firsts[2] > firsts[0] + 1.0
    assert {r["engine"] for r in res["records"]} == {0, 1}
    assert all("session" not in r for r in res["records"])
    assert res["after"]["counters"]["loaded_chunks"] == 7 and res["before"]["counters"]["loaded_chunks"] == 2
    assert res["foreign_cpu_cores"] == 0.5


def test_merge_snapshots():
    a = {"counters": {"x": 1}, "io": {"disk/demand": {"bytes": 10, "ops": 1}}, "proc": {"read_bytes": 5}}
    b = {"counters": {"x": 2, "y": 1}, "io": {"disk/demand": {"bytes": 5, "ops": 2}}, "proc": {"read_bytes": 1}}
    m = merge_snapshots([a, b])
    assert m == {"counters": {"x": 3, "y": 1}, "io": {"disk/demand": {"bytes": 15, "ops": 3}},
                 "proc": {"read_bytes": 6}}  # fmt: skip


def test_prelude_turns_keeps_later_turns_out_of_the_prelude():
    from kvprefetch.workload.replay import ChatBench, chat_workload

    spec = ChatBench(system_tokens=64, history_tokens=256, user_tokens=64, output_tokens=4, measured_turns=3,
                     min_sessions=2, sessions_per_concurrency=1.0)  # fmt: skip
    full = chat_workload(spec, [2], 1000)
    first = chat_workload(ChatBench(**{**spec.__dict__, "prelude_turns": 1}), [2], 1000)
    assert [len(s.turns) for s in full.prelude] == [3, 3]
    assert [len(s.turns) for s in first.prelude] == [1, 1]
    assert first.levels[2][0].turns[0].tokens == full.levels[2][0].turns[0].tokens
    # the measured turn 0 extends the one prelude request
    p, t0 = first.prelude[0].turns[0].tokens, first.levels[2][0].turns[0].tokens
    assert t0[: len(p)] == p and len(t0) > len(p)
