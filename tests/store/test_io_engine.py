"""The I/O engine: priority classes, read deduplication, cancellation, deadlines, throttling, accounting."""

import threading
import time

import pytest

from kvprefetch.io import IOClass, IOEngine


def _blocked_engine():
    """An engine whose single thread is held busy until the returned event is set."""
    engine = IOEngine(threads=1)
    gate = threading.Event()
    engine.submit("disk", IOClass.WRITEBACK, gate.wait)
    time.sleep(0.05)
    return engine, gate


def test_demand_runs_before_prefetch_before_writeback():
    engine, gate = _blocked_engine()
    order: list[str] = []
    for cls in (IOClass.WRITEBACK, IOClass.PREFETCH, IOClass.DEMAND, IOClass.PREFETCH, IOClass.WRITEBACK):
        engine.submit("disk", cls, lambda c=cls: order.append(c.label))
    gate.set()
    engine.close()
    assert order == ["demand", "prefetch", "prefetch", "writeback", "writeback"]


def test_demand_joins_an_inflight_prefetch_and_lifts_its_priority():
    engine, gate = _blocked_engine()
    calls: list[str] = []
    engine.submit("disk", IOClass.PREFETCH, lambda: calls.append("other-prefetch"))
    pre = engine.submit("disk", IOClass.PREFETCH, lambda: calls.append("read k") or "data", dedup=("r", "k"))
    demand = engine.submit("disk", IOClass.DEMAND, lambda: calls.append("read k again"), dedup=("r", "k"))
    gate.set()
    assert demand.result(5) == "data" and pre.result(5) == "data"
    engine.close()
    assert calls == ["read k", "other-prefetch"], "read once, and ahead of the other prefetch"


def test_cancelled_prefetch_never_runs_but_a_joined_demand_keeps_it():
    engine, gate = _blocked_engine()
    ran: list[str] = []
    a = engine.submit("disk", IOClass.PREFETCH, lambda: ran.append("a"), dedup="a")
    b = engine.submit("disk", IOClass.PREFETCH, lambda: ran.append("b"), dedup="b")
    engine.submit("disk", IOClass.DEMAND, lambda: ran.append("b-demand"), dedup="b")
    assert a.cancel() is True
    assert b.cancel() is False  # the demand still waits on it
    gate.set()
    engine.close()
    assert ran == ["b"]
    assert engine.stats.snapshot()["disk/prefetch"]["cancelled"] == 1


def test_prefetch_past_its_deadline_is_dropped():
    engine, gate = _blocked_engine()
    ran: list[str] = []
    late = engine.submit("disk", IOClass.PREFETCH, lambda: ran.append("late"), deadline=time.monotonic() + 0.01)
    time.sleep(0.05)
    gate.set()
    engine.close()
    assert ran == [] and late.future.cancelled()
    assert engine.stats.snapshot()["disk/prefetch"]["expired"] == 1


def test_errors_reach_every_waiter_and_are_counted():
    engine = IOEngine(threads=2)

    def boom():
        raise OSError("device gone")

    t = engine.submit("disk", IOClass.DEMAND, boom, nbytes=10)
    with pytest.raises(OSError, match="device gone"):
        t.result(5)
    engine.close()
    assert engine.stats.snapshot()["disk/demand"]["errors"] == 1


def _timed_reads(engine: IOEngine, n: int, cls: IOClass = IOClass.DEMAND) -> tuple[float, list[float]]:
    """Seconds n 1 MB ops take, and when each op's function ran (seconds after the start)."""
    t0 = time.monotonic()
    ran: list[float] = []
    tickets = [engine.submit("disk", cls, lambda: ran.append(time.monotonic() - t0), nbytes=1_000_000)
               for _ in range(n)]  # fmt: skip
    for t in tickets:
        t.result(10)
    return time.monotonic() - t0, ran


def test_a_stream_cap_paces_each_read_so_only_parallel_reads_reach_the_tiers_bandwidth():
    """5 MB/s a stream, 1 MB reads: one thread moves 5 in >= 1 s, five threads in about 0.2 s; each chunk
    appears only when its emulated transfer ends; write-back is not capped."""
    serial, parallel = IOEngine(threads=1), IOEngine(threads=5)
    for e in (serial, parallel):
        e.set_stream_limit("disk", 5e6)
    one, ran = _timed_reads(serial, 5)
    par, _ = _timed_reads(parallel, 5)
    back, _ = _timed_reads(serial, 5, IOClass.WRITEBACK)
    serial.set_stream_limit("disk", None)
    uncapped, _ = _timed_reads(serial, 5)
    for e in (serial, parallel):
        e.close()
    assert one >= 1.0 and min(ran) >= 0.2
    assert par < 0.6 * one
    assert back < 0.2 and uncapped < 0.2
    with pytest.raises(ValueError):
        serial.set_stream_limit("disk", 0)


def test_rate_limit_paces_reads_but_not_writebacks():
    engine = IOEngine(threads=4)
    engine.set_rate_limit("disk", 10e6)  # 10 MB/s
    t0 = time.monotonic()
    tickets = [engine.submit("disk", IOClass.DEMAND, lambda: None, nbytes=1_000_000) for _ in range(5)]
    for t in tickets:
        t.result(10)
    paced = time.monotonic() - t0
    t0 = time.monotonic()
    for t in [engine.submit("disk", IOClass.WRITEBACK, lambda: None, nbytes=1_000_000) for _ in range(5)]:
        t.result(10)
    unpaced = time.monotonic() - t0
    engine.close()
    assert 0.45 < paced < 2.0
    assert unpaced < 0.2
    snap = engine.stats.snapshot()["disk/demand"]
    assert snap["ops"] == 5 and snap["bytes"] == 5_000_000 and snap["max_queued"] >= 1


def test_a_read_as_slow_as_its_stream_is_not_slowed_twice():
    """Reads that themselves take a stream's time (a device or kernel throttle holding them back) are not slowed
    again by the stream cap: 6 such reads of 0.2 s at a 0.2 s stream time take ~1.4 s (the first pays both
    before the engine has seen one), not the 2.4 s of adding the two."""
    engine = IOEngine(threads=1)
    engine.set_stream_limit("disk", 5e6)
    t0 = time.monotonic()
    for t in [engine.submit("disk", IOClass.DEMAND, lambda: time.sleep(0.2), nbytes=1_000_000) for _ in range(6)]:
        t.result(10)
    took = time.monotonic() - t0
    engine.close()
    assert 1.2 <= took < 2.0
