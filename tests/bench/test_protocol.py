"""The engine process's protocol (`kvprefetch.testbed.protocol`): what a caller sends is what the engine reads, and a
request the engine cannot read is refused by name, not misread."""

from __future__ import annotations

import json

import pytest
from pydantic import ValidationError

from kvprefetch.testbed import protocol as P


@pytest.mark.parametrize("req", [
    P.Run(file="w.json", level="prelude", concurrency=8, tag="prelude", flush=True),
    P.Run(file="w.json", level=2, concurrency=2, tag="prefetch-c2-r1", salt=1, agent=True, pressure_life_s=0.4),
    P.Generate(prompts=[[1, 2, 3], [4]], max_tokens_each=[3, 1], hold_until_prefetched=True),
    P.Calibrate(prompt_tokens=512, repeats=5, decode_tokens=32, vocab=2048),
    P.DiskBandwidth(max_chunks=16, seconds=1.0, threads=4, stream_bps=1e8),
    P.Add(i=3, k=1, arrival=0.25), P.End(), P.Exit(), P.Geometry(), P.StreamLimit(bps=None),
])  # fmt: skip
def test_every_request_reads_back_as_sent(req):
    line = P.encode(req)
    assert json.loads(line)["op"] == req.op
    assert P.decode(line) == req and type(P.decode(line)) is type(req)


def test_every_op_is_known_once():
    assert len(P.REQUESTS) == len({cls.op for cls in P.REQUESTS.values()})
    assert all(P.REQUESTS[op].op == op for op in P.REQUESTS)


def test_a_bad_request_is_refused_by_name():
    with pytest.raises(ValueError, match="unknown op 'explode'"):
        P.decode('{"op": "explode"}')
    with pytest.raises(ValidationError, match="concurency"):  # a misspelt field is not silently dropped
        P.decode('{"op": "run", "file": "w", "level": 1, "concurency": 2, "tag": "t"}')
    with pytest.raises(ValidationError, match="level"):
        P.decode('{"op": "run", "file": "w", "level": "first", "concurrency": 2, "tag": "t"}')


def test_the_engine_spec_travels_whole():
    spec = P.EngineSpec(model="/m", max_model_len=1024, kv_cache_bytes=1 << 24, max_num_seqs=1, dtype="float32",
                        engine_args={"tensor_parallel_size": 2},
                        process=P.ProcessSpec(env={"A": "1"},
                                              topology=P.Placement(model_cpus=[0], host_cpus=[1])))  # fmt: skip
    assert P.EngineSpec.model_validate_json(spec.model_dump_json()) == spec
    assert spec.tensor_parallel_size == 2
    with pytest.raises(ValidationError, match="kv_cache_memory_bytes"):  # vLLM's name, not the spec's
        P.EngineSpec(model="/m", kv_cache_memory_bytes=1)


def test_replies_are_read_into_their_models():
    assert P.Geometry.reply is P.GeometryReply and P.Run.reply is None  # a cell's result is stored as it came
    done = P.serve_message({"event": "done", "rec": {"sid": "s0", "turn": 1}})
    assert isinstance(done, P.Done) and done.rec["turn"] == 1
    served = P.serve_message({"served": True, "foreign_cpu_cores": 0.5, "before": {}, "after": {}})
    assert isinstance(served, P.Served) and served.foreign_cpu_cores == 0.5
    assert P.Calibration.model_validate({"prefill_tokens_per_s": 9e3, "prefill_samples": [1]}).decode_step_s is None
