"""A damaged or foreign checkpoint fails the load before any tensor is handed out, naming the file and the fault."""

from __future__ import annotations

import json
import os

import pytest

from kvprefetch.loader import CheckpointError, LoaderSettings, open_checkpoint
from kvprefetch.loader.vllm_loader import iterate_weights


def shards(path):
    return sorted(path.glob("*.safetensors"))


def first_tensor(path, settings=None):
    """Start a load: the first (name, tensor), or the error the load fails with."""
    return next(iterate_weights(path, settings or LoaderSettings()))


def fails(path, *words) -> CheckpointError:
    with pytest.raises(CheckpointError) as info:
        first_tensor(path)
    for w in words:
        assert w in str(info.value), str(info.value)
    return info.value


def test_pristine_checkpoint_has_several_shards_and_an_index(pristine):
    ckpt = open_checkpoint(pristine)
    assert len(ckpt.shards) >= 3
    assert (pristine / "model.safetensors.index.json").exists()
    assert first_tensor(pristine)[0]


def test_truncated_shard(ckpt):
    victim = shards(ckpt)[1]
    os.truncate(victim, victim.stat().st_size - 1000)
    err = fails(ckpt, victim.name, "truncated")
    assert err.path == str(victim)


def test_corrupted_header(ckpt):
    victim = shards(ckpt)[0]
    with open(victim, "r+b") as f:
        f.seek(12)
        f.write(b"\xff\xfe{{")
    fails(ckpt, victim.name, "corrupted header")


def test_header_length_beyond_the_file(ckpt):
    victim = shards(ckpt)[2]
    with open(victim, "r+b") as f:
        f.write((10**9).to_bytes(8, "little"))
    fails(ckpt, victim.name, "corrupted header")


def test_header_offsets_that_do_not_fit_the_shape(ckpt):
    victim = shards(ckpt)[0]
    raw = victim.read_bytes()
    n = int.from_bytes(raw[:8], "little")
    header = json.loads(raw[8 : 8 + n])
    name = next(k for k in header if k != "__metadata__")
    header[name]["shape"] = [*header[name]["shape"][:-1], header[name]["shape"][-1] - 1]
    text = json.dumps(header, separators=(",", ":")).encode().ljust(n)
    if len(text) != n:
        pytest.skip("edited header does not fit the original length")
    victim.write_bytes(raw[:8] + text + raw[8 + n :])
    fails(ckpt, victim.name, "corrupted header", name)


def test_missing_shard(ckpt):
    victim = shards(ckpt)[-1]
    victim.unlink()
    fails(ckpt, victim.name, "missing")


def test_shard_of_another_model(ckpt, other_model):
    victim = shards(ckpt)[0]
    victim.write_bytes(shards(other_model)[0].read_bytes())
    err = fails(ckpt, "another model")
    assert err.path == str(victim)


def test_shard_of_another_model_without_a_config_is_blamed_on_the_index(ckpt, other_model):
    (ckpt / "config.json").unlink()
    shards(ckpt)[0].write_bytes(shards(other_model)[0].read_bytes())
    err = fails(ckpt, "another model")
    assert err.path.endswith("model.safetensors.index.json")


def test_shard_shrinking_after_verification_fails_the_load(ckpt):
    """Truncated between the check and the read: the read path notices, the load fails, naming the file."""
    victim = shards(ckpt)[-1]
    gen = iterate_weights(ckpt, LoaderSettings(block_bytes="64KiB", lookahead_shards=0))
    next(gen)  # verified, first shard under way
    os.truncate(victim, victim.stat().st_size // 2)
    with pytest.raises(CheckpointError) as info:
        for _ in gen:
            pass
    assert victim.name in str(info.value)
    assert "truncated" in str(info.value) or "changed" in str(info.value)


def test_bad_loader_config_is_a_clear_error():
    from kvprefetch.config import ConfigError

    with pytest.raises(ConfigError, match="threads"):
        LoaderSettings.from_extra_config({"threads": 0})
    with pytest.raises(ConfigError, match="no_such_option"):
        LoaderSettings.from_extra_config({"no_such_option": 1})
    with pytest.raises(ConfigError, match="multiple of 4096"):
        LoaderSettings.from_extra_config({"block_bytes": 5000})
