"""loadbench's arithmetic: medians, GB/s, ratios to the default loader in the same regime, goals, the plot."""

from __future__ import annotations

from kvprefetch.bench.micro.loadbench import MODES, LoadBench, goals, plot


def test_rows_medians_ratios_unavailable_and_goals(tmp_path):
    bench = LoadBench(tmp_path, tmp_path, repeats=3, network_bps=1, extra={}, block_bytes=1 << 20)
    seconds = {("fio", "device"): [1.0, 1.2, 0.9], ("default", "local"): [4.0, 3.0, 5.0],
               ("runai_streamer", "local"): [2.0, 2.0, 2.0], ("kvprefetch", "local"): [1.1, 1.0, 1.3],
               ("default", "network"): [20.0, 20.0, 20.0], ("kvprefetch", "network"): [10.0, 11.0, 10.0],
               ("kvprefetch", "warm-dram"): [4.0, 2.0, 2.5], ("kvprefetch", "warm-cache"): [1.0, 1.0, 2.0]}  # fmt: skip
    samples = {m: seconds.get((m.loader, m.regime), []) for m in MODES}
    unavailable = {m: "needs a CUDA device" for m in MODES if m.loader == "fastsafetensors"}
    rows = {(r.loader, r.regime): r for r in bench._rows(samples, unavailable, total=4_000_000_000)}
    assert rows[("default", "local")].seconds == 4.0 and rows[("default", "local")].gbps == 1.0
    assert rows[("kvprefetch", "local")].ratio_to_default == 4.0 / 1.1
    assert rows[("kvprefetch", "network")].ratio_to_default == 2.0  # against the default loader in its own regime
    assert rows[("fastsafetensors", "local")].unavailable == "needs a CUDA device"
    assert rows[("fastsafetensors", "local")].seconds is None
    met = {name: (value, ok) for name, value, _, ok in goals(list(rows.values()))}
    assert met["kvprefetch cold local vs fio (speed ratio)"] == (1.0 / 1.1, True)
    assert met["kvprefetch cold local vs vLLM default"][1] is True
    assert met["warm DRAM pool vs cold network"] == (4.0, False)  # each warm tier judged on its own
    assert met["warm cache vs cold network"] == (10.0, True)
    plot(list(rows.values()), tmp_path / "p.png", "t")
    assert (tmp_path / "p.png").stat().st_size > 1000
