"""The bench's meter of the connector threads' CPU time, on real threads of this process."""

from __future__ import annotations

import threading
import time
from pathlib import Path

from kvprefetch.testbed.probes import HelperCpuMeter


def _burn(cpu_s: float) -> None:
    """Spin until this thread has used `cpu_s` of CPU (not wall) time."""
    end = time.thread_time() + cpu_s
    while time.thread_time() < end:
        pass


def _in_thread(name: str, cpu_s: float) -> None:
    """Burn in a thread that has ended, for the kernel too: `join` returns once Python is done with the thread,
    and the OS thread may still be exiting (listed in /proc/self/task, its Python name gone) for a moment."""
    t = threading.Thread(target=_burn, args=(cpu_s,), name=name)
    t.start()
    t.join()
    task = Path(f"/proc/self/task/{t.native_id}")
    deadline = time.monotonic() + 10
    while task.exists() and time.monotonic() < deadline:
        time.sleep(0.01)


def test_counts_the_connector_threads_even_after_they_ended():
    meter = HelperCpuMeter()
    _in_thread("kvprefetch-load", 0.3)  # ended before the reading, like each step's loader
    assert 0.25 <= meter.seconds() <= 0.6


def test_leaves_out_the_main_thread_and_live_threads_that_are_not_the_connectors():
    meter = HelperCpuMeter()
    burned, release = threading.Event(), threading.Event()

    def other() -> None:
        _burn(0.3)
        burned.set()
        release.wait()

    t = threading.Thread(target=other, name="someone-else")
    t.start()
    try:
        _burn(0.3)  # the main thread: the engine's own work
        assert burned.wait(30)
        assert meter.seconds() <= 0.1
    finally:
        release.set()
        t.join()
