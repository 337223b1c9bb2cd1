"""`kvprefetch.testbed.router` without engines: the command line a `RouterSpec` gives vllm-router, and a router
that cannot start fails `wait_ready` with its log's tail and leaves no process."""

from __future__ import annotations

import pytest

from kvprefetch.testbed.router import (
    KvEventsPorts,
    Penalties,
    RouterSpec,
    RouterWorker,
    VllmRouter,
    router_executable,
)


def _after(argv: list[str], flag: str) -> list[str]:
    return [argv[i + 1] for i, a in enumerate(argv) if a == flag]


def test_a_kv_aware_spec_names_each_workers_event_and_replay_sources():
    ev = [KvEventsPorts(5001, 5002), KvEventsPorts(6001, 6002)]
    spec = RouterSpec((RouterWorker("http://a:1", ev[0]), RouterWorker("http://b:2", ev[1])), "kv_aware",
                      model="tiny", penalties=Penalties(host=0, disk=0.5), port=7, prometheus_port=8)  # fmt: skip
    argv = spec.argv()
    assert argv[argv.index("--worker-urls") + 1 : argv.index("--worker-urls") + 3] == ["http://a:1", "http://b:2"]
    assert _after(argv, "--kv-event-source") == ["http://a:1=tcp://127.0.0.1:5001", "http://b:2=tcp://127.0.0.1:6001"]
    assert _after(argv, "--kv-event-replay-source") == ["http://a:1=tcp://127.0.0.1:5002",
                                                        "http://b:2=tcp://127.0.0.1:6002"]  # fmt: skip
    assert _after(argv, "--kv-event-block-size") == ["128"] and _after(argv, "--kv-event-model") == ["tiny"]
    assert _after(argv, "--kv-penalty-host") == ["0"] and _after(argv, "--kv-penalty-disk") == ["0.5"]
    assert "--kv-penalty-external" not in argv  # the router's default
    assert (_after(argv, "--port"), _after(argv, "--prometheus-port")) == (["7"], ["8"])
    # the node's side: vLLM's KVEventsConfig fields, bound on every interface
    assert ev[0].config() | {"buffer_steps": 0} == {
        "enable_kv_cache_events": True, "publisher": "zmq", "endpoint": "tcp://*:5001",
        "replay_endpoint": "tcp://*:5002", "buffer_steps": 0, "topic": "",
    }  # fmt: skip


def test_a_round_robin_spec_has_no_kv_flags_and_free_ports_are_filled():
    spec = RouterSpec((RouterWorker("http://a:1", KvEventsPorts(1, 2)),), "round_robin").with_free_ports()
    assert spec.port > 0 and spec.prometheus_port > 0 and spec.port != spec.prometheus_port
    assert not [a for a in spec.argv() if a.startswith("--kv-")]


def test_a_router_that_cannot_start_fails_with_its_log_and_leaves_no_process(tmp_path):
    try:
        router_executable()
    except RuntimeError as err:
        pytest.skip(str(err))
    spec = RouterSpec((RouterWorker("http://127.0.0.1:9"),), extra_args=("--no-such-flag",))
    router = VllmRouter(spec, tmp_path / "router.log")
    with router, pytest.raises(RuntimeError, match=r"(?s)vllm-router exited.*no-such-flag"):
        router.wait_ready(60)
    assert router.proc.poll() is not None
