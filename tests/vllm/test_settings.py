"""`settings.py`: the connector's extra config, validated."""

from __future__ import annotations

import pytest

from kvprefetch.vllm.settings import parse_extra_config


def test_settings_defaults_and_validation(tmp_path):
    s = parse_extra_config({})
    assert s.prefetch and s.load_policy == "auto" and s.layerwise and s.on_load_failure == "recompute"
    assert s.chunk_tokens == 256 and s.store.chunk_tokens is None  # the connector's, not the store's
    y = tmp_path / "kv.yaml"
    y.write_text(f"chunk_tokens: 512\nprefetch: false\ndisk:\n  path: {tmp_path / 'd'}\n")
    s = parse_extra_config({"config_path": str(y), "load_policy": "always", "io": {"threads": 2}})
    assert s.chunk_tokens == 512 and not s.prefetch and s.store.io.threads == 2  # a config file still sets it
    assert s.store.chunk_tokens is None
    assert s.load_policy == "always"
    assert s.load_mode == "async" and parse_extra_config({"load_mode": "sync"}).load_mode == "sync"
    with pytest.raises(ValueError):
        parse_extra_config({"load_mode": "eventually"})
    with pytest.raises(ValueError):
        parse_extra_config({"load_policy": "sometimes"})
    with pytest.raises(ValueError):
        parse_extra_config({"no_such_key": 1})
    with pytest.raises(ValueError):
        parse_extra_config({"metrics_port": "http"})


def test_load_mode_auto_is_a_valid_setting():
    assert parse_extra_config({"load_mode": "auto"}).load_mode == "auto"
    with pytest.raises(ValueError, match="load_mode"):
        parse_extra_config({"load_mode": "sometimes"})


def test_settings_errors_name_the_key_and_value():
    for bad, words in [
        ({"load_mode": "eventually"}, ["load_mode", "eventually"]),
        ({"load_margin": -1}, ["load_margin", "-1"]),
        ({"metrics_port": "http"}, ["metrics_port", "http"]),
        ({"no_such_key": 1}, ["no_such_key"]),
        ({"dram": {"capacity_bytes": "lots"}}, ["dram.capacity_bytes", "lots"]),
    ]:
        with pytest.raises(ValueError) as err:
            parse_extra_config(bad)
        assert all(w in str(err.value) for w in words), (bad, str(err.value))


def test_chunk_tokens_is_the_connectors_wherever_it_is_written(tmp_path, monkeypatch):
    """The key the user writes is unchanged; the extra config beats a config file, which beats the environment
    (the store config's precedence, kept), and a bad value is refused naming the key."""
    y = tmp_path / "kv.yaml"
    y.write_text("chunk_tokens: 512\n")
    monkeypatch.setenv("KVPREFETCH_CHUNK_TOKENS", "64")
    assert parse_extra_config({}).chunk_tokens == 64
    assert parse_extra_config({"config_path": str(y)}).chunk_tokens == 512
    assert parse_extra_config({"config_path": str(y), "chunk_tokens": 128}).chunk_tokens == 128
    for bad in (0, -16, 1 << 21, "big"):
        with pytest.raises(ValueError, match="chunk_tokens"):
            parse_extra_config({"chunk_tokens": bad})
