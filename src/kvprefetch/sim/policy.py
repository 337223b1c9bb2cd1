"""The serving policies the real system has, as the simulator distinguishes them."""

from __future__ import annotations

from enum import StrEnum


class Policy(StrEnum):
    """When external KV is fetched, and whether fetching stalls the whole batch.

    recompute: no external cache (the engine's own prefix cache only).
    ondemand-sync: the whitepaper's "no prefetch" baseline. The FCFS scheduler requests the queue head's
        KV when it reaches it and admits nothing behind it until that load has landed in HBM; it reaches
        the next request on its next pass, after the step that prefills this one. Loads are serialised
        in the admission queue and the array idles for one engine step per request; the running batch
        keeps decoding. (A load that also stalled every decode would stretch each answer by the loads of
        all requests admitted meanwhile; the whitepaper's TTFT and throughput together rule that out.)
        Our own connector's sync mode works otherwise, loading inside the step that admits every request
        that fits: `SimConfig.sync_loads_in_step`, which the bench replay uses.
    ondemand: load when admitted; only that request waits.
    prefetch: storage -> DRAM starts on arrival; DRAM -> HBM when admitted.
    session: like prefetch, but a session's next turn is fetched as soon as the previous turn ends. It waits in
        DRAM through the user's think time: kept there under queue-aware eviction; under plain LRU other traffic
        may evict it first, and the turn reads it again when admitted.
    dram: every reusable block already sits in DRAM (the bound perfect prefetch approaches).
    """

    RECOMPUTE = "recompute"
    ONDEMAND_SYNC = "ondemand-sync"
    ONDEMAND = "ondemand"
    PREFETCH = "prefetch"
    SESSION = "session"
    DRAM = "dram"

    @property
    def uses_external(self) -> bool:
        return self is not Policy.RECOMPUTE

    @property
    def fetches_early(self) -> bool:
        return self in (Policy.PREFETCH, Policy.SESSION, Policy.DRAM)
