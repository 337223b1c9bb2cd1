"""Who can read the cache: chunk files, directories and the DRAM pool are private (or shared with one named
group) whatever the umask, and a file the cache did not write is never trusted."""

import grp
import logging
import os
import stat
from pathlib import Path

import numpy as np
import pytest

from kvprefetch.config import ConfigError, StoreConfig
from kvprefetch.tiers.access import PRIVATE, FileAccess, PoolAccessError
from kvprefetch.tiers.disk import DiskTier
from kvprefetch.tiers.dram import SharedChunkPool

from .conftest import CHUNK_BYTES, chunk_payload

STRANGER = 4242  # a uid and gid no account on the test machine has
needs_root = pytest.mark.skipif(os.geteuid() != 0, reason="needs root to chown files to another user")


def mode(path: Path) -> int:
    return stat.S_IMODE(os.stat(path).st_mode)


@pytest.fixture(params=[0o022, 0o000], ids=["umask022", "umask000"])
def umask(request):
    old = os.umask(request.param)
    yield request.param
    os.umask(old)


def _store_with_chunks(open_store, keyer, n: int = 4, **overrides):
    store = open_store(**overrides)
    keys = keyer.keys(range(16 * n))
    store.put(keys, [chunk_payload(k) for k in keys]).result(30)
    return store, keys


def _tier_paths(root: Path) -> tuple[list[Path], list[Path]]:
    dirs = [root, *(p for p in root.iterdir() if p.is_dir())]
    return dirs, list(root.glob("*/*.kv"))


def test_cache_files_are_private_whatever_the_umask(umask, open_store, keyer):
    store, keys = _store_with_chunks(open_store, keyer)
    dirs, files = _tier_paths(store.disk.root)
    assert len(files) == len(keys) and len(dirs) > 1
    assert {oct(mode(d)) for d in dirs} == {oct(0o700)}
    assert {oct(mode(f)) for f in files} == {oct(0o600)}
    assert oct(mode(store.dram.path)) == oct(0o600)


def _other_group() -> int:
    if os.geteuid() == 0:
        return next(g.gr_gid for g in grp.getgrall() if g.gr_gid != os.getegid())
    others = [g for g in os.getgroups() if g != os.getegid()]
    if not others:
        pytest.skip("this user is in no second group to share with")
    return others[0]


def test_share_group_gives_that_group_the_cache_and_nobody_else(umask, open_store, keyer):
    gid = _other_group()
    store, keys = _store_with_chunks(open_store, keyer, share_group=gid)
    dirs, files = _tier_paths(store.disk.root)
    assert {(oct(mode(d)), d.stat().st_gid) for d in dirs} == {(oct(0o2770), gid)}
    assert {(oct(mode(f)), f.stat().st_gid) for f in files} == {(oct(0o640), gid)}
    assert (oct(mode(store.dram.path)), store.dram.path.stat().st_gid) == (oct(0o660), gid)
    out = [np.zeros(CHUNK_BYTES, np.uint8) for _ in keys]
    for k in keys:
        store.dram.discard(k)
    assert store.get_into(keys, out) == len(keys), "the group's own files are trusted"


def test_share_group_must_be_a_group_of_this_node():
    with pytest.raises(ConfigError, match=r"share_group.*no group named 'no-such-group-kvp'"):
        StoreConfig.load(share_group="no-such-group-kvp")


def test_looser_existing_directories_and_files_are_tightened_at_start(open_store, keyer, caplog):
    store, keys = _store_with_chunks(open_store, keyer)
    root = store.disk.root
    sub = store.disk.path_of(keys[0]).parent
    os.chmod(root, 0o755)
    os.chmod(sub, 0o777)
    os.chmod(store.disk.path_of(keys[0]), 0o755)  # as versions before this one wrote them
    with caplog.at_level(logging.WARNING, "kvprefetch.tiers.disk"):
        again = DiskTier(root, capacity_bytes=1 << 30)
    assert len(again) == len(keys), "the tightened files are still the cache's own"
    assert (oct(mode(root)), oct(mode(sub)), oct(mode(store.disk.path_of(keys[0])))) == (
        oct(0o700), oct(0o700), oct(0o600))  # fmt: skip
    assert f"{root} was mode 0755; tightened to 0700" in caplog.text
    assert f"{sub} was mode 0777; tightened to 0700" in caplog.text


@needs_root
def test_a_looser_directory_another_user_owns_is_reported_and_left(tmp_path, caplog):
    root = tmp_path / "disk"
    (root / "ab").mkdir(parents=True)
    os.chown(root / "ab", STRANGER, STRANGER)
    os.chmod(root / "ab", 0o777)
    with caplog.at_level(logging.WARNING, "kvprefetch.tiers.disk"):
        DiskTier(root, capacity_bytes=1 << 30)
    assert f"{root / 'ab'} is mode 0777, looser than 0700, and owned by uid {STRANGER}: left as is" in caplog.text
    assert oct(mode(root / "ab")) == oct(0o777)


def _on_disk_only(store, keys):
    for k in keys:
        assert store.dram.discard(k)


def _disk_warnings(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == "kvprefetch.tiers.disk"]


@needs_root
def test_a_chunk_file_owned_by_another_user_is_a_miss_left_alone_and_logged_once(open_store, keyer, caplog):
    store, keys = _store_with_chunks(open_store, keyer)
    _on_disk_only(store, keys)
    planted = store.disk.path_of(keys[1])
    os.chown(planted, STRANGER, STRANGER)
    out = [np.zeros(CHUNK_BYTES, np.uint8) for _ in keys]
    with caplog.at_level(logging.WARNING, "kvprefetch.tiers.disk"):
        for _ in range(2):  # the first read finds the file changed hands since it was written
            assert store.get_into(keys, out) == 1
            assert store.lookup(keys).num_hit_chunks == 1
        assert (out[0] == chunk_payload(keys[0])).all()
        again = DiskTier(store.disk.root, capacity_bytes=1 << 30)  # recovery does not adopt it either
    assert len(again) == len(keys) - 1 and again.counters["foreign"] == 1
    assert planted.exists() and planted.stat().st_uid == STRANGER, "a foreign file is left alone"
    assert store.disk.counters["foreign"] == 1
    owned = [m for m in _disk_warnings(caplog) if f"owned by uid {STRANGER}" in m]
    assert len(owned) == 2, "logged once by each tier that found it"  # the store's and the recovered one


@pytest.mark.parametrize("loose", [0o666, 0o620], ids=["world-writable", "group-writable"])
def test_a_chunk_file_others_may_write_is_a_miss(loose, open_store, keyer):
    store, keys = _store_with_chunks(open_store, keyer)
    _on_disk_only(store, keys)
    os.chmod(store.disk.path_of(keys[2]), loose)
    out = [np.zeros(CHUNK_BYTES, np.uint8) for _ in keys]
    assert store.get_into(keys, out) == 2
    assert store.disk.path_of(keys[2]).exists()
    assert store.disk.stats()["foreign"] == 1


def test_a_symlink_under_a_chunk_name_is_a_miss(open_store, keyer, tmp_path):
    store, keys = _store_with_chunks(open_store, keyer)
    _on_disk_only(store, keys)
    path = store.disk.path_of(keys[0])
    target = tmp_path / "elsewhere.kv"
    path.rename(target)
    path.symlink_to(target)
    out = [np.zeros(CHUNK_BYTES, np.uint8) for _ in keys]
    assert store.get_into(keys, out) == 0
    assert path.is_symlink() and target.exists()


def _pool(directory: Path, access: FileAccess = PRIVATE) -> SharedChunkPool:
    return SharedChunkPool("access-test", slot_bytes=8192, capacity_bytes=4 * 8192, directory=directory, access=access,
                           keep_idle_s=None)  # fmt: skip


@needs_root
def test_a_pool_file_another_user_owns_is_refused(tmp_path):
    planted = tmp_path / "kvprefetch-access-test.pool"
    planted.touch(mode=0o666)
    os.chown(planted, STRANGER, STRANGER)
    with pytest.raises(PoolAccessError, match=f"owned by uid {STRANGER}.*another dram.pool_name"):
        _pool(tmp_path)
    assert planted.stat().st_size == 0, "nothing was written into it"


def test_a_pool_file_of_ours_open_to_others_is_tightened_and_a_link_refused(tmp_path, umask):
    pool = _pool(tmp_path)
    assert oct(mode(pool.path)) == oct(0o600)
    pool.close()
    os.chmod(pool.path, 0o644)
    with _pool(tmp_path) as again:
        assert oct(mode(again.path)) == oct(0o600)
    link = tmp_path / "link"
    link.mkdir()
    (link / pool.path.name).symlink_to(pool.path)
    with pytest.raises(PoolAccessError, match="symbolic link"):
        _pool(link)
