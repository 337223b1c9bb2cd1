"""The suite's engine processes are forked from one zygote (`kvprefetch.testbed.zygote`) that imported torch and
vLLM once, instead of each importing them again (~7 s of every ~8 s start, ~35 starts). Everything else about an
engine is as in a deployment; `KVPREFETCH_TEST_ZYGOTE=0` starts each one as a new process instead.

vLLM names its processes' ZeroMQ sockets in VLLM_RPC_BASE_PATH (/tmp by default) and leaves those of every engine
killed, as the suite's faults kill many (some 300 sockets an hour of tests were left in /tmp): the run gives them a
folder of its own, removed at its end."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from kvprefetch.testbed.client import RPC_ENV, ZYGOTE_ENV, own_socket_folder

_rpc_key = pytest.StashKey[str]()


def pytest_configure(config: pytest.Config) -> None:
    """Before any test module imports vLLM (which may cache its environment): the run's own socket folder."""
    folder = own_socket_folder()
    if folder is not None:
        config.stash[_rpc_key] = folder


def pytest_unconfigure(config: pytest.Config) -> None:
    folder = config.stash.get(_rpc_key, None)
    if folder is not None:
        os.environ.pop(RPC_ENV, None)
        shutil.rmtree(folder, ignore_errors=True)


@pytest.fixture(scope="session", autouse=True)
def engine_zygote(request: pytest.FixtureRequest):
    """The zygote's socket (also in the environment, so engines started by a bench the tests run use it), or
    None: asked not to, or no test of this run starts an engine (those are marked slow)."""
    engines = any(item.get_closest_marker("slow") for item in request.session.items)
    if not engines or os.environ.get("KVPREFETCH_TEST_ZYGOTE") == "0" or os.environ.get(ZYGOTE_ENV):
        yield None
        return
    folder = Path(tempfile.mkdtemp(prefix="kvp-zygote-"))
    sock = folder / "zygote.sock"
    log = open(folder / "zygote.log", "w")  # noqa: SIM115
    env = dict(os.environ, VLLM_LOGGING_LEVEL="INFO", PYTHONUNBUFFERED="1")
    proc = subprocess.Popen([sys.executable, "-m", "kvprefetch.testbed.zygote", str(sock)], stdout=subprocess.PIPE,
                            stderr=log, text=True, env=env, start_new_session=True)  # fmt: skip
    assert proc.stdout is not None and proc.stdout.readline().strip() == "ready", (folder / "zygote.log").read_text()
    os.environ[ZYGOTE_ENV] = str(sock)
    try:
        yield sock
    finally:
        os.environ.pop(ZYGOTE_ENV, None)
        proc.kill()
        proc.wait()
        log.close()
        shutil.rmtree(folder, ignore_errors=True)
