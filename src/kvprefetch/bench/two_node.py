"""The two-node scenario's network (issue 41): a pool namespace (the whitepaper's shared array) and two node
namespaces, each joined to the pool by a link shaped to the rate the whitepaper's node could read the array at,
scaled to this engine the way the bench's storage regime is (`kvprefetch.bench.regime`).

The whitepaper's node reads the array through its 100 GbE port (12.5 GB/s) and the array gives 5.23 GB/s with
parallel reads: a node alone reads at min(port, array). Against its model's prefill rate that is R (recompute
time / load time of the same context); this engine's link then carries R x (its KV bytes per token) x (its
prefill tokens/s), so a chunk crosses it R times faster than the engine recomputes it, as there.
"""

from __future__ import annotations

from dataclasses import dataclass

PORT_BPS = 100e9 / 8  # the whitepaper's GPU server's one 100 GbE port, bytes/s


@dataclass(frozen=True)
class LinkRate:
    """A node's link to the pool, bytes/s, with how it was derived."""

    bytes_per_s: float
    r: float  # recompute time / load time over the link, as on the whitepaper's deployment
    port_bps: float
    array_bps: float
    prefill_tps: float  # this engine's
    kv_bytes_per_token: float  # this engine's

    @property
    def bits_per_s(self) -> int:
        return int(self.bytes_per_s * 8)

    def sentence(self) -> str:
        node = min(self.port_bps, self.array_bps) / 1e9
        mb, mbit = self.bytes_per_s / 1e6, self.bits_per_s / 1e6
        return (f"a node reads the pool at min(its 100 GbE port {self.port_bps / 1e9:.1f} GB/s, the array "
                f"{self.array_bps / 1e9:.2f} GB/s) = {node:.2f} GB/s, R = {self.r:.1f} against the whitepaper's "
                f"prefill; this engine prefills {self.prefill_tps:,.0f} tokens/s of {self.kv_bytes_per_token:,.0f} "
                f"KV bytes each, so each node's link is shaped to {self.r:.1f} x {self.kv_bytes_per_token:,.0f} x "
                f"{self.prefill_tps:,.0f} = {mb:,.1f} MB/s ({mbit:,.0f} Mbit/s)")  # fmt: skip


def link_rate(prefill_tps: float, kv_bytes_per_token: float) -> LinkRate:
    """The rate of each node's link to the pool for an engine that prefills `prefill_tps` tokens/s."""
    from kvprefetch.bench.regime import whitepaper_r2

    wp = whitepaper_r2()
    node_bps = min(PORT_BPS, wp.read_bps)
    r = wp.prefill_s / (wp.context_tokens * wp.kv_bytes_per_token / node_bps)
    return LinkRate(r * kv_bytes_per_token * prefill_tps, r, PORT_BPS, wp.read_bps, prefill_tps, kv_bytes_per_token)
