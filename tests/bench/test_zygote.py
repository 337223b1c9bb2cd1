"""Engines forked by the test suite's zygote (`kvprefetch.testbed.zygote`) start, fail and end as started ones do."""

from __future__ import annotations

import os
import signal

import pytest

from kvprefetch.testbed import protocol as P
from kvprefetch.testbed.client import ZYGOTE_ENV, EngineError, EngineProcess, ForkedProcess

pytest.importorskip("vllm")

pytestmark = pytest.mark.slow


def test_a_forked_engine_that_cannot_start_says_why_and_is_gone(tmp_path, engine_zygote):
    if engine_zygote is None:
        pytest.skip("engines start as new processes in this run (KVPREFETCH_TEST_ZYGOTE=0)")
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text('{"architectures": ["NoSuchModel"]}')
    with pytest.raises(EngineError, match="engine start failed"):
        EngineProcess(P.EngineSpec(model=str(model)), tmp_path / "engine.log")
    assert os.environ[ZYGOTE_ENV] == str(engine_zygote)


def test_a_forked_process_leads_its_own_group_and_dies_with_it(tmp_path, engine_zygote):
    """What `EngineProcess.kill` and `_end_group` rely on: the child is a session leader (its group is its pid)
    and its end is seen although it is not this process's child."""
    if engine_zygote is None:
        pytest.skip("engines start as new processes in this run (KVPREFETCH_TEST_ZYGOTE=0)")
    with open(tmp_path / "log", "w") as log:
        proc = ForkedProcess(str(engine_zygote), "not json", dict(os.environ), log)  # the child fails to parse it
    assert proc.wait(timeout=60) == 0 and proc.poll() == 0
    with open(tmp_path / "log", "w") as log:
        proc = ForkedProcess(str(engine_zygote), P.EngineSpec(model=str(tmp_path)).model_dump_json(),
                             dict(os.environ), log)  # fmt: skip
    assert os.getpgid(proc.pid) == proc.pid
    os.killpg(proc.pid, signal.SIGKILL)
    assert proc.wait(timeout=60) == 0
