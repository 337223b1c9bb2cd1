"""The bench client's side of warming the next turn, run inside the engine process (`engine_proc`'s `run` op):
warm-up calls when tool calls start, and what the leases hold while a cell runs."""

from __future__ import annotations

from typing import Any


class AgentClient:
    """What the agent workload's client does beside sending its turns, and what the bench reads of the leases.

    * With `warm_ttl_s`, a warm-up call when each tool call starts (a session's start, and each turn's finish),
      naming the next turn's known head (`known_tokens`) as ``POST /v1/kvprefetch/warm`` would: this process is
      the engine's scheduler process, so the call is the connector's own (`KVPrefetchConnector.warm`), the one
      the API's handler makes.
    * When the turn arrives, where its warm-up's chunks are (`hints`): in DRAM in time, late (still being read),
      or wasted (the lease was gone: evicted for budget or expired, its reads for nothing).
    * Every `SAMPLE_S`, the keys leases hold and reserve against their budget (`lease_samples`).
    """

    SAMPLE_S = 0.1

    def __init__(self, sessions: list[dict], connector: Any, warm_ttl_s: float | None, tag: str):
        self.sessions, self.conn, self.warm_ttl_s, self.tag = sessions, connector, warm_ttl_s, tag
        self.calls: dict[tuple[int, int], dict] = {}  # (session, turn) -> its warm-up's answer
        self.hints: list[dict] = []
        self.lease_samples: list[tuple[float, int, int]] = []  # (t, keys pinned, keys reserved)
        self.budget = int(connector.lease_stats().get("lease_budget_chunks", 0)) if connector else 0
        self._next_sample = 0.0

    def session_started(self, i: int, now: float) -> None:
        self._warm(i, 0)

    def turn_finished(self, i: int, k: int, now: float) -> None:
        if k + 1 < len(self.sessions[i]["turns"]):
            self._warm(i, k + 1)

    def _warm(self, i: int, k: int) -> None:
        turn = self.sessions[i]["turns"][k]
        known = int(turn.get("known_tokens") or 0)
        if self.warm_ttl_s is None or self.conn is None or known <= 0:
            return
        lease_id = f"{self.tag}-{self.sessions[i]['sid']}-t{k}"
        self.calls[(i, k)] = self.conn.warm(turn["tokens"][:known], self.warm_ttl_s, lease_id).as_json()

    def turn_arriving(self, i: int, k: int, now: float) -> None:
        call = self.calls.pop((i, k), None)
        if call is None:
            return
        status = self.conn.warm_status(call["id"])
        reads = call["on_disk"] + call["remote"]
        if status is None:  # the lease ended before its turn came: its reads were for nothing
            self.hints.append({"chunks": call["chunks"], "reads": reads, "in_time": 0, "late": 0, "wasted": reads})
            return
        late = status.chunks - status.in_dram
        self.hints.append({"chunks": call["chunks"], "reads": reads, "in_time": max(0, reads - late),
                           "late": min(late, reads), "wasted": 0})  # fmt: skip

    def sample(self, now: float) -> None:
        if self.conn is None or now < self._next_sample:
            return
        self._next_sample = now + self.SAMPLE_S
        st = self.conn.lease_stats()
        self.lease_samples.append((round(now, 3), int(st.get("lease_chunks_pinned", 0)),
                                   int(st.get("lease_chunks_reserved", 0))))  # fmt: skip

    def summary(self) -> dict:
        held = [p for _, p, _ in self.lease_samples]
        reserved = [r for _, _, r in self.lease_samples]
        step = max(1, len(self.lease_samples) // 300)  # a plot's worth
        return {
            "lease_budget_keys": self.budget,
            "lease_peak_pinned_keys": max(held, default=0),
            "lease_peak_reserved_keys": max(reserved, default=0),
            "lease_mean_pinned_keys": sum(held) / len(held) if held else 0.0,
            "lease_samples": self.lease_samples[::step],
            "hints": len(self.hints),
            **{f"hint_{k}": sum(h[k] for h in self.hints) for k in ("chunks", "reads", "in_time", "late", "wasted")},
        }
