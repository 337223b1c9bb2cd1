"""`kvprefetch serve` as a user runs it: its warm-up API on vLLM's port (behind vLLM's `--api-key`, under each
request's identity: a LoRA adapter, a cache salt, images on a vision-language model's server), and however it is
stopped, it leaves no DRAM pool (keep_idle_s 0), no process, and every chunk it saved on disk.

Three servers (each in its own session, as a service or a terminal runs it; the second serves a tiny
vision-language model) serve one completion each and are
stopped three ways: SIGINT to the process group (Ctrl-C), SIGTERM to the process group (`systemctl stop`'s
default, `kill -TERM -PGID`) and SIGTERM to the engine-core process alone. (SIGTERM to the main process, as
`kill PID` and Kubernetes stop a server, is `tests/serve/test_openai_server.py`'s stop: every process detached
itself, the write-back drained.) The group signals used to leave the pool in /dev/shm, depending on timing:
vLLM's engine core resets its signal handlers before its own shutdown, so the second signal of such a stop (its
API server's SIGTERM) could kill it before the connector detached; the pool's watcher
(`kvprefetch.tiers.pool_watch`) is the last one out now.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
import uuid
from dataclasses import dataclass
from pathlib import Path

import pytest

pytest.importorskip("vllm")

from tests.adapters import make_adapter
from tests.tiny_vlm import make_vlm

from kvprefetch.config import default_cache_dir
from kvprefetch.testbed.server import TINY_MODEL, free_port, metric_sum, parse_metrics, tiny_model_dir
from kvprefetch.tiers.dram import SHM_DIR

pytestmark = pytest.mark.slow

WAYS = ("sigint-group", "sigterm-group", "sigterm-engine-core")
TINY_CONFIG = json.loads((TINY_MODEL / "config.json").read_text())
LEFT_GRACE_S = 60  # how long the processes a stopped main process leaves behind may take to finish (a loaded CI)
PROMPT = " ".join(f"w{5 + i % 4000}" for i in range(700))
CHAT_TEMPLATE = "{% for m in messages %}{{ m['content'] }} {% endfor %}"  # (the tiny model has none of its own)
MESSAGES = [{"role": "user", "content": PROMPT}, {"role": "assistant", "content": "w7 w8 w9"}]
KEY = "sk-kvprefetch-test"  # the warm-up API's server runs with --api-key (its other servers without)
SALTED = " ".join(f"w{900 + i % 3000}" for i in range(600))  # computed under cache_salt alice, then warmed
ADAPTED = " ".join(f"w{1700 + i % 2000}" for i in range(600))  # computed with the adapter "ad", then warmed


@dataclass
class Stopped:
    way: str
    pool: Path
    disk: Path
    saved_chunks: float
    exit_code: int
    seconds: float  # from the stop signals (sent to every server at once) until its main process exited
    left: list[str]  # processes of its group still alive after the main one exited (and a grace)
    log: Path
    api: dict[str, tuple[int, dict]]  # the warm-up API's answers, by call (one server's)


def _get(url: str, timeout: float = 5) -> bytes:
    with urllib.request.urlopen(url, timeout=timeout) as r:
        return r.read()


def _call(port: int, method: str, path: str, body: object = None, key: str | None = KEY) -> tuple[int, dict]:
    data = body if isinstance(body, bytes) or body is None else json.dumps(body).encode()
    headers = {"Content-Type": "application/json"} | ({"Authorization": f"Bearer {key}"} if key else {})
    req = urllib.request.Request(f"http://127.0.0.1:{port}{path}", data, headers, method=method)
    try:
        with urllib.request.urlopen(req, timeout=60) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as err:
        return err.code, json.loads(err.read())


def _use_warm_api(port: int) -> dict[str, tuple[int, dict]]:
    """What a client of the warm-up API sees, right after the server computed PROMPT (its chunks in DRAM)."""
    api = {"prompt": _call(port, "POST", "/v1/kvprefetch/warm", {"model": "tiny", "prompt": PROMPT, "ttl_s": 20})}
    lease = api["prompt"][1]["id"]
    api["status"] = _call(port, "GET", f"/v1/kvprefetch/warm/{lease}")
    node = subprocess.run([sys.executable, "-m", "kvprefetch.cli", "status", "--json"], capture_output=True,
                          text=True, timeout=120)  # fmt: skip
    api["node_status"] = (node.returncode, json.loads(node.stdout) if node.returncode == 0 else {"err": node.stderr})
    api["delete"] = _call(port, "DELETE", f"/v1/kvprefetch/warm/{lease}")
    api["status_after_delete"] = _call(port, "GET", f"/v1/kvprefetch/warm/{lease}")
    api["messages"] = _call(port, "POST", "/v1/kvprefetch/warm", {"model": "tiny", "messages": MESSAGES})
    api["tokenize"] = _call(port, "POST", "/tokenize", {"model": "tiny", "messages": MESSAGES,
                                                         "add_generation_prompt": False})  # fmt: skip
    api["token_ids"] = _call(port, "POST", "/v1/kvprefetch/warm", {"model": "tiny", "prompt_token_ids": [5] * 300})
    api["bad_model"] = _call(port, "POST", "/v1/kvprefetch/warm", {"model": "other", "prompt": PROMPT})
    api["malformed"] = _call(port, "POST", "/v1/kvprefetch/warm", b'{"model": "tiny", ')
    api["no_input"] = _call(port, "POST", "/v1/kvprefetch/warm", {"model": "tiny"})
    api["bad_ttl"] = _call(port, "POST", "/v1/kvprefetch/warm", {"model": "tiny", "prompt": "w5", "ttl_s": -1})
    api["unknown_id"] = _call(port, "GET", "/v1/kvprefetch/warm/warm-0000")
    api["wrong_method"] = _call(port, "GET", "/v1/kvprefetch/warm")
    # vLLM's --api-key: every route of the warm-up API refuses what /v1/completions refuses
    warm = {"model": "tiny", "prompt": PROMPT}
    api["no_key"] = _call(port, "POST", "/v1/kvprefetch/warm", warm, key=None)
    api["wrong_key"] = _call(port, "POST", "/v1/kvprefetch/warm", warm, key="sk-wrong")
    api["status_no_key"] = _call(port, "GET", "/v1/kvprefetch/warm/warm-0000", key=None)
    api["delete_wrong_key"] = _call(port, "DELETE", "/v1/kvprefetch/warm/warm-0000", key="sk-wrong")
    api["completion_no_key"] = _call(port, "POST", "/v1/completions", warm | {"max_tokens": 1}, key=None)
    # identities: alice's prompt warmed under bob's salt, no salt and alice's; the adapter's under the base model
    _complete(port, SALTED, KEY, cache_salt="alice")
    _complete(port, ADAPTED, KEY, model="ad")
    time.sleep(0.5)
    for who, extra in (("bob", {"cache_salt": "bob"}), ("no_salt", {}), ("alice", {"cache_salt": "alice"})):
        api[f"salted_{who}"] = _call(port, "POST", "/v1/kvprefetch/warm", {"model": "tiny", "prompt": SALTED} | extra)
    for who, model in (("base", "tiny"), ("adapter", "ad")):
        api[f"adapted_{who}"] = _call(port, "POST", "/v1/kvprefetch/warm", {"model": model, "prompt": ADAPTED})
    api["unknown_adapter"] = _call(port, "POST", "/v1/kvprefetch/warm", {"model": "nope", "prompt": ADAPTED})
    api["bad_salt"] = _call(port, "POST", "/v1/kvprefetch/warm", {"model": "tiny", "prompt": "w5", "cache_salt": ""})
    return api


def _image_message(seed: int) -> list[dict]:
    """A user message of 300 words, an image (a data URL), 700 words."""
    import base64
    import io

    from tests.tiny_vlm import FIRST_WORD_ID, make_image

    png = io.BytesIO()
    make_image(seed).save(png, format="PNG")
    url = "data:image/png;base64," + base64.b64encode(png.getvalue()).decode()
    words = [f"w{FIRST_WORD_ID + i % 1500}" for i in range(1000)]
    content = [{"type": "text", "text": " ".join(words[:300])}, {"type": "image_url", "image_url": {"url": url}},
               {"type": "text", "text": " ".join(words[300:])}]  # fmt: skip
    return [{"role": "user", "content": content}]


def _use_warm_api_with_images(port: int) -> dict[str, tuple[int, dict]]:
    """A vision-language model's server: a chat with one image computed, then warmed with that image and with
    another behind the same words."""
    api = {"chat": _call(port, "POST", "/v1/chat/completions", {"model": "tiny", "messages": _image_message(1),
                                                                "max_tokens": 4}, key=None)}  # fmt: skip
    time.sleep(0.5)  # the worker reports its saves with the step after
    for who, seed in (("same_image", 1), ("other_image", 2)):
        api[who] = _call(port, "POST", "/v1/kvprefetch/warm", {"model": "tiny", "messages": _image_message(seed)},
                         key=None)  # fmt: skip
    return api


def _complete(port: int, prompt: str = PROMPT, key: str | None = None, **extra: str) -> None:
    body = json.dumps({"model": "tiny", "prompt": prompt, "max_tokens": 4} | extra).encode()
    headers = {"Content-Type": "application/json"} | ({"Authorization": f"Bearer {key}"} if key else {})
    req = urllib.request.Request(f"http://127.0.0.1:{port}/v1/completions", body, headers)
    with urllib.request.urlopen(req, timeout=300) as r:
        assert json.loads(r.read())["choices"][0]["text"]


def _group(pgid: int) -> list[str]:
    out = subprocess.run(["pgrep", "-a", "-g", str(pgid)], capture_output=True, text=True).stdout
    return out.splitlines()


def _engine_core(pid: int) -> int:
    out = subprocess.run(["pgrep", "-P", str(pid)], capture_output=True, text=True).stdout.split()
    for child in out:
        comm = Path(f"/proc/{child}/comm").read_text().strip()
        if comm.startswith("VLLM::EngineCor"):
            return int(child)
    raise AssertionError(f"no engine-core process under {pid}: {out}")


def _stop(way: str, proc: subprocess.Popen) -> None:
    if way == "sigint-group":
        os.killpg(proc.pid, signal.SIGINT)
    elif way == "sigterm-group":
        os.killpg(proc.pid, signal.SIGTERM)
    else:
        os.kill(_engine_core(proc.pid), signal.SIGTERM)


@pytest.fixture(scope="module")
def stopped(tmp_path_factory) -> dict[str, Stopped]:
    work = tmp_path_factory.mktemp("stops")
    tiny_model_dir(default_cache_dir() / "tiny-llama")  # made once here, not by four servers at once
    servers = {}
    try:
        for way in WAYS:
            pool, port = f"kvpt-stop-{uuid.uuid4().hex[:8]}", free_port()
            disk, log = work / way / "disk", work / f"{way}.log"
            model = "kvprefetch-tiny" if way != WAYS[1] else make_vlm(str(work / "vlm"))["model"]
            argv = [sys.executable, "-m", "kvprefetch.cli", "serve", model,
                    "--set", f"dram.pool_name={pool}", "--set", "dram.capacity_bytes=64MiB",
                    "--set", f"disk.path={disk}", "--set", "log_interval_s=0",
                    "--set", "save_policy=all",  # (every chunk it computes is saved: what shutdown must keep)
                    "--port", str(port), "--host", "127.0.0.1", "--served-model-name", "tiny",
                    "--kv-cache-memory-bytes", str(48 << 20), "--max-model-len", "4096",
                    "--chat-template", CHAT_TEMPLATE]  # fmt: skip
            if way == WAYS[0]:  # the warm-up API's server: behind an API key, with an adapter
                argv += ["--api-key", KEY, "--enable-lora", "--max-lora-rank", "8",
                         "--lora-modules", f"ad={make_adapter(work / 'ad', TINY_CONFIG, seed=1)}"]  # fmt: skip
            if way == WAYS[1]:  # a vision-language model (random weights): the warm-up API with images
                argv += ["--limit-mm-per-prompt", '{"image": 1}', "--enforce-eager", "--dtype", "float32"]
            with open(log, "w") as out:
                proc = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, start_new_session=True,
                                        env=dict(os.environ, PYTHONUNBUFFERED="1"))  # fmt: skip
            servers[way] = (proc, port, SHM_DIR / f"kvprefetch-{pool}.pool", disk, log)
        deadline = time.monotonic() + 900
        for way, (proc, port, *_rest) in servers.items():
            while True:
                assert proc.poll() is None, f"{way}: server exited; see {servers[way][-1]}"
                assert time.monotonic() < deadline, f"{way}: not ready"
                try:
                    _get(f"http://127.0.0.1:{port}/health")
                    break
                except OSError:
                    time.sleep(0.5)
        asked = {}
        for way, (_proc, port, pool, _disk, _log) in servers.items():
            _complete(port, key=KEY if way == WAYS[0] else None)
            time.sleep(0.5)  # the worker reports its saves with the step after
            api = {WAYS[0]: _use_warm_api, WAYS[1]: _use_warm_api_with_images}.get(way, lambda _port: {})(port)
            saved = metric_sum(parse_metrics(_get(f"http://127.0.0.1:{port}/metrics").decode()),
                               "vllm:kvprefetch_saved_chunks_total")  # fmt: skip
            assert pool.exists(), f"{way}: the server's DRAM pool"
            asked[way] = (saved, api)
        t0 = time.monotonic()
        for way, (proc, *_rest) in servers.items():  # stopped at once: each takes vLLM's shutdown grace periods
            _stop(way, proc)
        results = {}
        for way, (proc, _port, pool, disk, log) in servers.items():
            rc = proc.wait(timeout=120)
            seconds = time.monotonic() - t0
            end = time.monotonic() + LEFT_GRACE_S  # what the main process left behind has this long to go
            while _group(proc.pid) and time.monotonic() < end:
                time.sleep(0.2)
            saved, api = asked[way]
            results[way] = Stopped(way, pool, disk, saved, rc, seconds, _group(proc.pid), log, api)
        yield results
    finally:
        for proc, _port, pool, _disk, _log in servers.values():
            if proc.poll() is None or _group(proc.pid):
                subprocess.run(["kill", "-9", f"-{proc.pid}"], capture_output=True, check=False)
            pool.unlink(missing_ok=True)


def _gone_within(path: Path, seconds: float) -> bool:
    deadline = time.monotonic() + seconds
    while path.exists() and time.monotonic() < deadline:
        time.sleep(0.1)
    return not path.exists()


@pytest.mark.parametrize("way", WAYS)
def test_a_stopped_server_leaves_no_pool_no_process_and_every_saved_chunk_on_disk(stopped, way):
    s = stopped[way]
    assert s.exit_code in (0, -signal.SIGTERM, -signal.SIGINT, 1), (way, s.exit_code)
    assert s.left == [], f"{way}: processes left in the server's group: {s.left}"
    assert _gone_within(s.pool, 5), f"{way}: {s.pool} still held after the stop"
    watchers = subprocess.run(["pgrep", "-af", "pool_watch"], capture_output=True, text=True).stdout
    assert str(s.pool) not in watchers, "the pool's watcher exits with its pool"
    on_disk = len(list(s.disk.rglob("*.kv")))
    assert s.saved_chunks > 0 and on_disk == s.saved_chunks, (way, on_disk, s.saved_chunks, s.log)


def test_the_warm_up_api_on_vllms_port(stopped):
    api = stopped[WAYS[0]].api
    status, warm = api["prompt"]
    assert status == 200 and set(warm) == {"id", "chunks", "in_dram", "on_disk", "remote", "missing", "ttl_s"}
    assert warm["chunks"] >= 2 and warm["missing"] == 0 and warm["in_dram"] + warm["on_disk"] == warm["chunks"]
    assert api["status"][0] == 200 and api["status"][1]["id"] == warm["id"] and api["status"][1]["ttl_s"] <= 20
    # `kvprefetch status` lists the lease, asked of the engine over its warm-up socket
    code, node = api["node_status"]
    leases = [x | {"budget": e["lease_budget_chunks"]} for e in node["leases"].values() for x in e.get("list", [])
              if x["id"] == warm["id"]]  # fmt: skip
    assert code == 0 and len(leases) == 1, node.get("leases")
    assert leases[0]["origin"] == "warm" and leases[0]["keys"] == warm["chunks"] <= leases[0]["budget"]
    assert 0 < leases[0]["remaining_s"] <= 20
    assert api["delete"] == (200, {"id": warm["id"], "ended": True})
    assert api["status_after_delete"][0] == 404
    # Messages are tokenized as vLLM's /tokenize does (the server's chat template, no generation prompt), so the
    # chunks named are those the next request's head will look up.
    status, chat = api["messages"]
    assert status == 200 and chat["chunks"] == len(api["tokenize"][1]["tokens"]) // 256 >= 2
    assert chat["in_dram"] + chat["on_disk"] + chat["missing"] == chat["chunks"]
    assert api["token_ids"][0] == 200 and api["token_ids"][1]["chunks"] == 1 and api["token_ids"][1]["missing"] == 1
    for call, code, said in [("bad_model", 404, "`other` does not exist"), ("malformed", 400, "malformed warm-up"),
                             ("no_input", 400, "exactly one of"), ("bad_ttl", 400, "ttl_s"),
                             ("unknown_id", 404, "no warm-up"), ("wrong_method", 405, "use POST")]:  # fmt: skip
        status, body = api[call]
        assert status == code and said in body["error"]["message"], (call, status, body)


def test_the_warm_up_api_refuses_what_vllm_refuses_without_the_api_key(stopped):
    api = stopped[WAYS[0]].api
    assert api["completion_no_key"][0] == 401  # vLLM's own route
    for call in ("no_key", "wrong_key", "status_no_key", "delete_wrong_key"):
        assert api[call] == api["completion_no_key"], (call, api[call])  # the same status and answer as vLLM's


def test_a_warm_up_counts_and_holds_only_its_own_identitys_chunks(stopped):
    """A prompt computed under cache_salt alice: a warm-up under bob's salt or none finds none of its chunks (it
    learns nothing of alice's prompts), alice's finds them all in DRAM. The same for an adapter's prompt warmed under
    the base model and under the adapter."""
    api = stopped[WAYS[0]].api
    for call in ("salted_alice", "salted_bob", "salted_no_salt", "adapted_base", "adapted_adapter"):
        assert api[call][0] == 200, (call, api[call])
    alice, bob, plain = (api[f"salted_{w}"][1] for w in ("alice", "bob", "no_salt"))
    assert alice["chunks"] >= 2 and alice["in_dram"] == alice["chunks"] and alice["missing"] == 0, alice
    for other in (bob, plain):
        assert other["chunks"] == alice["chunks"] and other["missing"] == other["chunks"], other
        assert other["in_dram"] == other["on_disk"] == 0, other
    adapter, base = api["adapted_adapter"][1], api["adapted_base"][1]
    assert adapter["chunks"] >= 2 and adapter["in_dram"] == adapter["chunks"], adapter
    assert base["missing"] == base["chunks"] == adapter["chunks"] and base["in_dram"] == 0, base
    status, body = api["unknown_adapter"]
    assert status == 404 and "`nope` does not exist" in body["error"]["message"] and "ad" in body["error"]["message"]
    status, body = api["bad_salt"]
    assert status == 400 and "cache_salt" in body["error"]["message"], body


def test_a_warm_up_with_images_finds_only_chunks_computed_with_those_images(stopped):
    """The warm-up renders messages with images as the chat completion does (placeholder tokens, content hashes):
    the image the chat computed is found whole in DRAM; another image behind the same words is not."""
    api = stopped[WAYS[1]].api
    assert api["chat"][0] == 200 and api["chat"][1]["choices"][0]["message"]["content"], api["chat"]
    (code, same), (code2, other) = api["same_image"], api["other_image"]
    assert code == code2 == 200, (same, other)
    assert same["chunks"] >= 3 and same["in_dram"] == same["chunks"] and same["missing"] == 0, same
    assert other["chunks"] == same["chunks"] and other["in_dram"] < same["chunks"] and other["on_disk"] == 0, other
