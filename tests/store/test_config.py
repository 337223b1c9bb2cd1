"""Configuration: YAML, environment and overrides; every bad value is a clear error naming the field."""

import os

import pytest

from kvprefetch.config import ConfigError, StoreConfig


def test_yaml_env_and_overrides_layer_in_order(tmp_path, monkeypatch):
    path = tmp_path / "kv.yaml"
    path.write_text("chunk_tokens: 128\ndram:\n  capacity_bytes: 1GiB\ndisk:\n  path: %s\n" % (tmp_path / "d"))
    monkeypatch.setenv("KVPREFETCH_IO__THREADS", "7")
    monkeypatch.setenv("KVPREFETCH_CHUNK_TOKENS", "64")
    cfg = StoreConfig.load(path, dram={"pool_name": "x"})
    assert cfg.dram.capacity_bytes == 1 << 30
    assert cfg.io.threads == 7
    assert cfg.chunk_tokens == 128  # the file beats the environment; explicit overrides beat both
    assert StoreConfig.load(path, chunk_tokens=32).chunk_tokens == 32
    assert cfg.dram.pool_name == "x"


def test_defaults_need_nothing(monkeypatch, tmp_path):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    cfg = StoreConfig.load()
    assert cfg.disk.path == tmp_path / "kvprefetch" / "disk"
    assert cfg.tiers == ["dram", "disk"]


@pytest.mark.parametrize(
    ("overrides", "field", "words"),
    [
        ({"dram": {"capacity_bytes": -1}}, "dram.capacity_bytes", "must be a positive size"),
        ({"disk": {"capacity_bytes": "lots"}}, "disk.capacity_bytes", "lots"),
        ({"tiers": ["dram", "tape"]}, "tiers", "tape"),
        ({"tiers": ["disk"]}, "tiers", "must include 'dram'"),
        ({"chunk_tokens": 0}, "chunk_tokens", "greater than or equal to 1"),
        ({"dram": {"pool_name": "a/b"}}, "dram.pool_name", "pattern"),
        ({"io": {"thread": 4}}, "io.thread", "Extra inputs"),
    ],
)
def test_bad_values_name_the_field(overrides, field, words):
    with pytest.raises(ConfigError) as err:
        StoreConfig.load(**overrides)
    assert field in str(err.value)
    assert words in str(err.value)


@pytest.mark.skipif(os.geteuid() == 0, reason="root may write anywhere")
def test_unwritable_disk_directory_is_refused(tmp_path):
    locked = tmp_path / "locked"
    locked.mkdir(mode=0o500)
    with pytest.raises(ConfigError, match="no write permission"):
        StoreConfig.load(disk={"path": str(locked / "cache")})


def test_disk_path_that_is_a_file_is_refused(tmp_path):
    (tmp_path / "file").write_text("x")
    with pytest.raises(ConfigError, match="not a directory"):
        StoreConfig.load(disk={"path": str(tmp_path / "file" / "cache")})


def test_broken_yaml_and_missing_file(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("dram: [unclosed")
    with pytest.raises(ConfigError, match="not valid YAML"):
        StoreConfig.load(bad)
    with pytest.raises(ConfigError, match="cannot read config file"):
        StoreConfig.load(tmp_path / "missing.yaml")
