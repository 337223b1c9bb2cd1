"""`soak-serve`'s plan and judgement, without a server: the fault schedule, the load's prompts, and the checks and
tables the report draws from a run's records (built here by hand)."""

from __future__ import annotations

from collections import Counter

from kvprefetch.bench.soak_faults import FAULT_KINDS, LIGHT_KINDS, fault_schedule, soak_metrics
from kvprefetch.bench.soak_load import Conversation
from kvprefetch.bench.soak_report import (
    Answer,
    FaultRecord,
    MetricSample,
    Sample,
    SoakResult,
    by_condition,
    count_log_lines,
    stall_table,
    windows,
)


def test_every_fault_kind_comes_twice_or_more_inside_the_run_and_the_schedule_is_the_seeds():
    for seconds, kinds in ((90, LIGHT_KINDS), (900, FAULT_KINDS), (1800, FAULT_KINDS)):
        faults = fault_schedule(seconds, seed=3, kinds=kinds)
        n = Counter(f.kind for f in faults)
        assert set(n) == set(kinds) and min(n.values()) >= max(2, int(seconds // 450))
        assert all(0.1 * seconds <= f.at_s <= 0.85 * seconds for f in faults)
        early = [f for f in faults if f.kind in ("server_term", "server_kill", "disk_full")]
        assert all(f.at_s <= 0.45 * seconds for f in early), "restarts early (the second half is one life), and the "
        "full disk (while the disk tier still fills)"
        assert [f.at_s for f in faults] == sorted(f.at_s for f in faults)
        assert faults == fault_schedule(seconds, 3, kinds) != fault_schedule(seconds, 4, kinds)


def test_a_conversation_grows_by_turns_and_starts_over_before_the_context_is_full():
    c = Conversation(seed=1, head=100, turn=10, max_words=300)
    first = c.next_prompt()
    c.answered("w7 w8")
    second = c.next_prompt()
    assert second.startswith(first + " w7 w8 ") and len(second.split()) == len(first.split()) + 2 + 10
    lengths = []
    for _ in range(60):
        lengths.append(len(c.next_prompt().split()))
        c.answered("w9")
    assert max(lengths) <= 300 and min(lengths[5:]) < lengths[4]  # it started over at least once


def test_ttft_windows_leave_out_failed_requests():
    answers = [Answer(1.0, 1.1, 0.1, True, True), Answer(2.0, 2.3, 0.3, True, True),
               Answer(3.0, 3.0, None, False, None), Answer(12.0, 12.2, 0.2, True, False)]  # fmt: skip
    w = windows(answers)
    assert [t for t, _, _ in w] == [0.0, 10.0] and w[0][1] == 0.2 and w[1][1] == 0.2


def test_requests_in_the_servers_own_restart_are_apart_and_others_failing_fail_the_check():
    r = SoakResult(600, ("server_kill", "redis_kill"))
    r.faults = [FaultRecord("server_kill", 100, 150, "x"), FaultRecord("server_kill", 200, 240, "x"),
                FaultRecord("redis_kill", 300, 310, "x"), FaultRecord("redis_kill", 400, 410, "x")]  # fmt: skip
    r.answers = [Answer(99.0, 101.0, None, False, None),  # in flight when it was killed: apart
                 Answer(120.0, 120.0, None, False, None),  # while it was down: apart
                 Answer(305.0, 306.0, None, False, None)]  # during a redis outage: a failure  # fmt: skip
    assert [r.apart(a) for a in r.answers] == [True, True, False]
    assert r.failed() == 1 and len(r.counted()) == 1
    checks = {name: ok for name, ok, _ in r.checks()}
    assert not checks["no failed request outside restarts"]
    assert checks["server_kill injected >= 2x"] and checks["redis_kill injected >= 2x"]
    assert not checks["redis_kill in /metrics"], "no tier error moved: the fault did not show"


def test_counters_are_read_per_server_life_and_a_fault_shows_by_its_tier_error():
    r = SoakResult(600, ("redis_kill",))
    r.faults = [FaultRecord("redis_kill", 100, 110, "x")]
    r.metrics = [MetricSample(90, 0, {"prompt": 1000, "hit/disk": 500}),
                 MetricSample(115, 0, {"prompt": 1400, "hit/disk": 600, "err/remote/unavailable": 2}),
                 MetricSample(300, 1, {"prompt": 100, "hit/disk": 80})]  # fmt: skip  (restarted: counters from 0)
    assert r.fault_moved(r.faults[0]) == {"prompt": 400, "hit/disk": 100, "err/remote/unavailable": 2}
    assert r.moved(0, 600) == {"prompt": 1500, "hit/disk": 680, "err/remote/unavailable": 2}
    assert {name: ok for name, ok, _ in r.checks()}["redis_kill in /metrics"]
    rows = {row["condition"]: row for row in by_condition(r)}
    assert rows["redis_kill"]["hit_ratio"] == 0.25 and rows["redis_kill"]["tier_errors"] == {"remote/unavailable": 2}


def test_growth_is_judged_over_the_last_long_server_life():
    r = SoakResult(900)
    r.samples = [Sample(t, 0, 5000.0, 100, 50, 3, 10.0) for t in range(0, 300, 5)]  # before a restart
    r.samples += [Sample(t, 1, 1000.0 + (t >= 700) * 100, 100, 50, 3, 10.0) for t in range(300, 900, 5)]
    assert round(r.growth("rss_mb"), 1) == 10.0  # 1000 -> 1100 over the last life's second half
    assert r.growth("fds") == 0.0


def test_log_lines_and_metrics_are_read_as_the_soak_reads_them():
    logs = ["WARNING kvprefetch: remote tier redis unavailable (refused)\nINFO other\n",
            "WARNING kvprefetch: disk chunk load failed (CorruptChunk: bad)\nWARNING disk tier: removing /x: bad\n"]
    assert count_log_lines(logs) == {"redis_kill": 1, "disk_full": 0, "damage": 2}
    parsed = {("vllm:prompt_tokens_by_source_total", (("source", "local_compute"),)): 70.0,
              ("vllm:prompt_tokens_by_source_total", (("source", "local_cache_hit"),)): 30.0,
              ("vllm:kvprefetch_hit_tokens_total", (("tier", "disk"),)): 20.0,
              ("vllm:kvprefetch_tier_errors_total", (("kind", "corrupt"), ("tier", "disk"))): 1.0}  # fmt: skip
    parsed[("vllm:kvprefetch_worker_saved_chunks_total", ())] = 6.0  # saved: not all of it written to disk
    parsed[("vllm:kvprefetch_io_ops_total", (("cls", "writeback"), ("tier", "disk")))] = 4.0
    parsed[("vllm:kvprefetch_io_ops_total", (("cls", "prefetch"), ("tier", "disk")))] = 9.0
    parsed[("vllm:kvprefetch_io_ops_total", (("cls", "writeback"), ("tier", "remote")))] = 5.0
    assert soak_metrics(parsed) == {"prompt": 100.0, "hit/engine": 30.0, "hit/disk": 20.0, "err/disk/corrupt": 1.0,
                                    "written": 4.0}  # fmt: skip


def test_a_full_disk_must_show_unless_the_disk_tier_was_at_its_capacity_or_nothing_was_written():
    r = SoakResult(600, ("disk_full",), disk_capacity_mb=256)
    r.faults = [FaultRecord("disk_full", 100, 130, "x"), FaultRecord("disk_full", 300, 330, "x")]
    r.samples = [Sample(95, 0, 1000, 10, 10, 1, 120.0), Sample(295, 0, 1000, 10, 10, 1, 255.0)]
    # the injector's readings once the disk is full (101) and just before it is freed (129), between the sampler's
    r.metrics = [MetricSample(99, 0, {"err/disk/no_space": 0, "written": 10}),
                 MetricSample(101, 0, {"err/disk/no_space": 0, "written": 10}),
                 MetricSample(129, 0, {"err/disk/no_space": 7, "written": 14}),
                 MetricSample(135, 0, {"err/disk/no_space": 7, "written": 14})]  # fmt: skip
    assert [r.bites(f) for f in r.faults] == [True, False]
    checks = {name: (ok, detail) for name, ok, detail in r.checks()}
    assert checks["disk_full in /metrics"] == (True, "tier errors disk/no_space per fault: 7, 0 (tier at capacity)")
    r.metrics[2:] = [MetricSample(129, 0, {"err/disk/no_space": 0, "written": 14}),
                     MetricSample(135, 0, {"err/disk/no_space": 0, "written": 14})]  # written to a full disk: hidden
    assert not {name: ok for name, ok, _ in r.checks()}["disk_full in /metrics"]
    r.metrics[2:] = [MetricSample(129, 0, {"err/disk/no_space": 0, "written": 10}),
                     MetricSample(135, 0, {"err/disk/no_space": 0, "written": 14})]  # written only once it was freed
    assert not r.bites(r.faults[0])
    checks = {name: (ok, detail) for name, ok, detail in r.checks()}
    assert checks["disk_full in /metrics"] == (False, "tier errors disk/no_space per fault: 0 (nothing written), "
                                               "0 (tier at capacity)")  # fmt: skip


def test_a_damaged_file_shows_when_it_is_first_read_even_during_a_later_fault():
    # the CI cut's schedule: a damage fault, a full disk 1 s later; the damaged chunks are read during the full disk
    r = SoakResult(90, ("damage", "disk_full"))
    r.faults = [FaultRecord("damage", 10, 10, "x"), FaultRecord("disk_full", 11, 19, "x"),
                FaultRecord("damage", 22, 22, "x"), FaultRecord("disk_full", 28, 37, "x")]  # fmt: skip
    r.metrics = [MetricSample(9, 0, {"prompt": 100}),
                 MetricSample(15, 0, {"prompt": 200, "err/disk/corrupt": 4, "err/disk/no_space": 20}),
                 MetricSample(80, 0, {"prompt": 900, "err/disk/corrupt": 4, "err/disk/missing": 3,
                                      "err/disk/no_space": 63})]  # fmt: skip
    assert r.shown(r.faults[0]) == 4  # its window runs to the next damage fault, through the full disk's
    assert r.shown(r.faults[2]) == 3
    assert r.fault_moved(r.faults[1]).get("err/disk/no_space") == 20  # other kinds keep their own windows
    assert {name: ok for name, ok, _ in r.checks()}["damage in /metrics"]


def test_a_hang_is_a_stall_with_the_faults_around_it_not_two_failed_requests():
    """Issue 59's run, by hand: four sessions answered every few seconds until 185.7 s, then four requests with no
    first token: two gave up at the client's 120 s, two were answered as the run stopped. Its line read like two
    unlucky requests; it is a 120 s stall, the faults before it listed beside it, and the run fails on it."""
    r = SoakResult(300, ("damage", "disk_full", "server_kill"))
    r.faults = [FaultRecord("server_kill", 40.0, 70.0, "x"), FaultRecord("damage", 178.0, 178.5, "x"),
                FaultRecord("disk_full", 178.5, 208.8, "x"), FaultRecord("gc", 250.0, 251.0, "x")]  # fmt: skip
    for k in range(4):  # calm: each session answered in 0.5 s, a request every 2 s
        r.answers += [Answer(t + k * 0.3, t + k * 0.3 + 0.5, 0.2, True, True) for t in range(0, 184, 2)]
    r.answers += [Answer(45.0, 46.0, None, False, None)]  # in the restart: apart, and no stall either
    r.answers += [Answer(185.7, 305.7, None, False, None), Answer(185.9, 305.9, None, False, None),
                  Answer(186.0, 305.4, 119.4, True, True), Answer(186.1, 305.8, 119.7, True, True)]  # fmt: skip
    assert [(round(a), round(b)) for a, b in r.stalls()] == [(186, 305)]
    assert round(r.stalled_s()) == 120 and r.max_ttft_s() == 119.7 and len(r.slow()) == 4
    line = r.summary()
    assert "failed=2 " in line and "stalled_s=120 " in line and "max_ttft_s=119.7 " in line
    failed = {name for name, ok, _ in r.checks() if not ok}
    assert {"no stall (15 s with requests outstanding and none answered)",
            "every request outside restarts answered within 30 s"} <= failed  # fmt: skip
    table = stall_table(r)
    assert "| 185.7 | 305.4 |" in table and "damage 178.0-178.5 s; disk_full 178.5-208.8 s" in table
    assert "gc 250.0-251.0 s" in table and "server_kill" not in table


def test_a_server_restart_or_a_short_wait_is_no_stall():
    r = SoakResult(200, ("server_kill",))
    r.faults = [FaultRecord("server_kill", 100.0, 150.0, "x")]
    r.answers = [Answer(t, t + 0.5, 0.2, True, True) for t in range(0, 100, 2)]
    r.answers += [Answer(99.0, 157.0, None, False, None)]  # held by the restart: apart
    r.answers += [Answer(160.0, 172.0, 11.0, True, True)]  # 12 s with nothing else answered: no stall, not slow
    r.answers += [Answer(t, t + 0.5, 0.2, True, True) for t in range(174, 200, 2)]
    assert r.stalls() == [] and r.slow() == [] and r.max_ttft_s() == 11.0
    assert all(ok for name, ok, _ in r.checks() if "stall" in name or "within" in name)
    assert stall_table(r) == ""


def test_a_stream_the_server_aborts_is_a_failed_request_not_an_answer():
    """vLLM aborts the requests it holds when it shuts down and ends their streams with finish_reason "abort" (200,
    a part of the text): the soak's client raises, so such a request counts as failed (apart, in a restart window),
    never as a wrong answer. A real HTTP server on loopback streams both endings."""
    import asyncio
    import json
    import threading
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    import httpx
    import pytest

    from kvprefetch.bench.soak_load import Unfinished, complete

    class Streams(BaseHTTPRequestHandler):
        def do_POST(self) -> None:
            self.rfile.read(int(self.headers["Content-Length"]))
            self.send_response(200)
            self.send_header("Content-Type", "text/event-stream")
            self.end_headers()
            ending = "abort" if self.path.startswith("/aborted") else "length"
            for text, finish in (("w5", None), (" w6", ending)):
                event = {"choices": [{"text": text, "finish_reason": finish}]}
                self.wfile.write(f"data: {json.dumps(event)}\n\n".encode())
            self.wfile.write(b"data: [DONE]\n\n")

        def log_message(self, *args) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Streams)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    base = f"http://127.0.0.1:{server.server_address[1]}"

    async def ask(prefix: str) -> tuple[str, float]:
        async with httpx.AsyncClient(timeout=10) as client:
            return await complete(client, base + prefix, "w1 w2")

    try:
        assert asyncio.run(ask(""))[0] == "w5 w6"
        with pytest.raises(Unfinished, match="finish_reason='abort'"):
            asyncio.run(ask("/aborted"))
    finally:
        server.shutdown()
