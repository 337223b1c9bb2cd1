"""The backend against SGLang's own reference backend (`HiCacheFile`): the same operations, the same answers.

Both run under SGLang's own host pool (`MHATokenToKVPoolHost`, every layout it offers) and storage config. SGLang's
cache controller moves pages to a backend through one of two paths, and both are driven here: the generic one
(flat pages: `batch_set` of `get_data_page(i)`, `batch_get` into `get_dummy_flat_data_page()` then
`set_from_flat_data_page`) and, for a backend configured with `interface_v1`, the zero-copy one (`batch_set_v1` /
`batch_get_v1` with host indices). HiCacheFile speaks only the first; ours must give the same bytes through both.
"""

from __future__ import annotations

import hashlib

import pytest
import torch
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule, run_state_machine_as_test
from sglang.srt.mem_cache.hicache_storage import HiCacheFile
from sglang.srt.mem_cache.storage.backend_factory import StorageBackendFactory

from kvprefetch.sglang import KVPrefetchStorage
from kvprefetch.sglang.host_pages import PageGeometry
from kvprefetch.sglang.hostpool import host_pool, storage_config
from tests.sglang.conftest import open_backend, page_bytes, page_content, tiers_extra

LAYOUTS = ["layer_first", "page_first", "page_first_direct", "page_head"]
KEYS = [hashlib.sha256(str(i).encode()).hexdigest() for i in range(10)]  # SGLang's page keys are hex hashes
key_lists = st.lists(st.sampled_from(KEYS), min_size=1, max_size=6)


def test_the_backend_loads_through_sglangs_dynamic_factory(backends):
    backend = backends()
    assert type(backend) is KVPrefetchStorage
    assert backend.pages is not None and backend.pages.zero_copy


def test_the_factory_names_a_bad_store_key(tmp_path, pool_name):
    extra = tiers_extra(tmp_path, pool_name) | {"dram": {"capacity_byte": "1GiB"}}
    with pytest.raises(ValueError, match="capacity_byte"):
        StorageBackendFactory.create_backend("dynamic", storage_config(extra=extra), host_pool())


class SameAnswers(RuleBasedStateMachine):
    """Every operation on both backends; every answer compared."""

    layout = "page_first"
    root = None

    @initialize()
    def open(self):
        type(self).runs += 1
        here = self.root / f"run{self.runs}"
        self.pool = host_pool(self.layout)
        self.page_tokens = self.pool.page_size
        self.nbytes = PageGeometry.of(self.pool).page_bytes
        self.file = HiCacheFile(storage_config(layout=self.layout), file_path=str(here / "hicache"))
        self.file.register_mem_pool_host(self.pool)
        self.ours = open_backend(tiers_extra(here, f"sgl-contract-{id(self)}-{self.runs}"), self.pool,
                                 layout=self.layout)  # fmt: skip

    def teardown(self):
        if hasattr(self, "ours"):
            self.ours.close()

    def _pages(self, keys):
        """Host pool pages holding each key's content, as SGLang's backup thread finds them."""
        idx = self.pool.alloc(len(keys) * self.page_tokens)
        for i, key in enumerate(keys):
            self.pool.set_from_flat_data_page(int(idx[i * self.page_tokens]), page_content(key, self.nbytes))
        return idx

    @rule(keys=key_lists, zero_copy=st.booleans())
    def write(self, keys, zero_copy):
        idx = self._pages(keys)
        starts = idx[:: self.page_tokens].tolist()
        assert self.file.batch_set(keys, [self.pool.get_data_page(s) for s in starts])
        if zero_copy:
            assert self.ours.batch_set_v1(keys, idx) == [True] * len(keys)
        else:
            assert self.ours.batch_set(keys, [self.pool.get_data_page(s) for s in starts])
        self.pool.free(idx)

    @rule(keys=key_lists)
    def read(self, keys):
        theirs = self.file.batch_get(keys, [self.pool.get_dummy_flat_data_page() for _ in keys])
        generic = self.ours.batch_get(keys, [self.pool.get_dummy_flat_data_page() for _ in keys])
        idx = self.pool.alloc(len(keys) * self.page_tokens)
        zero_copy = self.ours.batch_get_v1(keys, idx)
        for i, key in enumerate(keys):
            want = None if theirs[i] is None else page_bytes(theirs[i])
            assert want is None or want == page_bytes(page_content(key, self.nbytes))
            assert (None if generic[i] is None else page_bytes(generic[i])) == want
            got = page_bytes(self.pool.get_data_page(int(idx[i * self.page_tokens]))) if zero_copy[i] else None
            assert got == want
        self.pool.free(idx)

    @rule(key=st.sampled_from(KEYS))
    def exists(self, key):
        assert self.ours.exists(key) == self.file.exists(key)

    @rule(keys=key_lists)
    def batch_exists(self, keys):
        assert self.ours.batch_exists(keys) == self.file.batch_exists(keys)

    @rule()
    def missing_page(self):
        assert self.ours.get("not-a-page", self.pool.get_dummy_flat_data_page()) is None
        assert self.file.get("not-a-page", self.pool.get_dummy_flat_data_page()) is None

    @rule()
    def clear(self):
        self.file.clear()
        assert self.ours.clear()

    @invariant()
    def same_keys_exist(self):
        if hasattr(self, "ours"):
            assert [self.ours.exists(k) for k in KEYS] == [self.file.exists(k) for k in KEYS]


@pytest.mark.parametrize("layout", LAYOUTS)
def test_same_answers_as_sglangs_file_backend(layout, tmp_path, monkeypatch):
    monkeypatch.delenv("SGLANG_HICACHE_FILE_BACKEND_STORAGE_DIR", raising=False)
    machine = type(f"SameAnswers_{layout}", (SameAnswers,), {"layout": layout, "root": tmp_path, "runs": 0})
    run_state_machine_as_test(machine, settings=settings(max_examples=8, stateful_step_count=12, deadline=None,
                                                         suppress_health_check=list(HealthCheck)))  # fmt: skip


@pytest.mark.parametrize("layout", LAYOUTS)
def test_a_page_written_one_way_reads_back_the_other(layout, backends):
    """The zero-copy runs are the flat page's byte order, whatever the layout: a page stored by batch_set_v1 reads
    back through batch_get into a flat page, and the other way round."""
    pool = host_pool(layout)
    ours = backends(pool, layout=layout)
    n = PageGeometry.of(pool).page_bytes
    idx = pool.alloc(2 * pool.page_size)
    pool.set_from_flat_data_page(int(idx[0]), page_content("a", n))
    assert ours.batch_set_v1(["a"], idx[: pool.page_size]) == [True]
    assert ours.batch_set(["b"], [page_content("b", n)])
    out = ours.batch_get(["a"], [pool.get_dummy_flat_data_page()])[0]
    assert page_bytes(out) == page_bytes(page_content("a", n))
    assert ours.batch_get_v1(["b"], idx[pool.page_size :]) == [True]
    assert page_bytes(pool.get_data_page(int(idx[pool.page_size]))) == page_bytes(page_content("b", n))


def test_zero_copy_reads_write_only_their_pages(backends):
    """batch_get_v1 copies into the named pages and nowhere else in the host pool."""
    pool = host_pool("layer_first")
    ours = backends(pool, layout="layer_first")
    n = PageGeometry.of(pool).page_bytes
    assert ours.batch_set(["a", "b"], [page_content("a", n), page_content("b", n)])
    pool.kv_buffer.view(torch.uint8).fill_(7)
    before = pool.kv_buffer.clone()
    idx = torch.cat([torch.arange(32, 48), torch.arange(96, 112)])  # two pages, not adjacent
    assert ours.batch_get_v1(["a", "b"], idx) == [True, True]
    changed = (pool.kv_buffer.view(torch.uint8) != before.view(torch.uint8)).nonzero()
    tokens = set(changed[:, 2 if pool.layout == "layer_first" else 1].tolist())
    assert tokens <= set(idx.tolist()) and tokens
