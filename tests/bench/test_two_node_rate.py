"""The two-node scenario's link rate: derived from the whitepaper's port and array, not fitted to this machine."""

from __future__ import annotations

import pytest

from kvprefetch.bench.regime import DEFAULT_REGIME
from kvprefetch.bench.two_node import link_rate


def test_a_node_reads_the_array_below_its_port_so_the_link_carries_the_default_regime():
    rate = link_rate(prefill_tps=8567, kv_bytes_per_token=4096)
    assert rate.r == pytest.approx(DEFAULT_REGIME, abs=0.05), "the array (5.23 GB/s) is slower than the port"
    assert rate.bytes_per_s == pytest.approx(rate.r * 4096 * 8567)
    assert rate.bits_per_s == int(rate.bytes_per_s * 8)
    assert "100 GbE" in rate.sentence() and f"{rate.bytes_per_s / 1e6:,.1f} MB/s" in rate.sentence()


def test_the_link_scales_with_the_engines_prefill_rate():
    slow, fast = link_rate(1000, 4096), link_rate(2000, 4096)
    assert fast.bytes_per_s == pytest.approx(2 * slow.bytes_per_s) and fast.r == slow.r
