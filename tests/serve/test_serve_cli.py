"""`kvprefetch serve`: the vLLM command it runs, and the configuration errors it stops on before vLLM starts."""

from __future__ import annotations

import json
import shlex

import pytest
from tests.clitext import flat
from typer.testing import CliRunner

from kvprefetch.cli import app


def _dry_run(*args: str) -> list[str]:
    res = CliRunner().invoke(app, ["serve", *args, "--dry-run"])
    assert res.exit_code == 0, res.output
    return shlex.split(res.stdout.strip().splitlines()[-1])


def _transfer_config(argv: list[str]) -> dict:
    return json.loads(argv[argv.index("--kv-transfer-config") + 1])


def test_serve_runs_vllms_openai_server_with_the_connector_and_a_shutdown_grace(tmp_path):
    cfg = tmp_path / "kvprefetch.yaml"
    cfg.write_text("chunk_tokens: 256\n")
    argv = _dry_run("org/model", "-c", str(cfg), "--set", "prefetch=false", "--set", "dram.capacity_bytes=1GiB",
                    "--port", "8001", "--max-model-len", "4096")  # fmt: skip
    assert argv[1:4] == ["-m", "vllm.entrypoints.openai.api_server", "--model"] and argv[4] == "org/model"
    tc = _transfer_config(argv)
    assert (tc["kv_connector"], tc["kv_connector_module_path"]) == ("KVPrefetchConnector", "kvprefetch.vllm")
    assert tc["kv_connector_extra_config"] == {
        "config_path": str(cfg.resolve()), "prefetch": False, "dram": {"capacity_bytes": "1GiB"},
    }  # fmt: skip
    assert argv[argv.index("--port") + 1] == "8001" and argv[argv.index("--max-model-len") + 1] == "4096"
    assert argv[argv.index("--shutdown-timeout") + 1] == "30"
    assert argv[argv.index("--middleware") + 1] == "kvprefetch.vllm.warm_api.WarmMiddleware"  # the warm-up API


def test_a_users_shutdown_timeout_and_no_connector_are_kept():
    argv = _dry_run("org/model", "--no-connector", "--shutdown-timeout", "5")
    assert "--kv-transfer-config" not in argv and "--middleware" not in argv
    assert argv.count("--shutdown-timeout") == 1 and argv[argv.index("--shutdown-timeout") + 1] == "5"


@pytest.mark.parametrize("name", ["kvprefetch-tiny", "kvprefetch-tiny-hybrid", "kvprefetch-tiny-mla"])
def test_the_tiny_model_gets_a_tokenizer_and_dummy_weights(tmp_path, monkeypatch, name):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    argv = _dry_run(name, "--port", "8002")
    model = argv[argv.index("--model") + 1]
    assert model != "kvprefetch-tiny" and argv[argv.index("--load-format") + 1] == "dummy"
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model)
    ids = [5, 77, 4095, 3]
    assert tok(tok.decode(ids), add_special_tokens=True)["input_ids"] == ids


def test_bad_connector_config_stops_before_vllm_starts(tmp_path):
    for args, said in [
        (["--set", "load_mode=bogus"], "load_mode: Input should be"),
        (["-c", str(tmp_path / "missing.yaml")], "config file not found"),
        (["--extra", "[1]"], "--extra must be a JSON object"),
        (["--set", "novalue"], "--set takes KEY=VALUE"),
    ]:
        res = CliRunner().invoke(app, ["serve", "org/model", *args, "--dry-run"])
        assert res.exit_code == 2, (args, res.output)
        assert said in flat(res.output), res.output
        assert "api_server" not in res.output
