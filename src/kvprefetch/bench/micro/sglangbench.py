"""`kvprefetch iobench --sglang`: SGLang's storage reads through our backend against SGLang's own file backend.

One run, one directory, the same pages (one SGLang page of a Llama-3-8B-shaped KV cache per key by default) stored
by both backends. Every round reads all of them back cold, once per path, in a rotated order:

- `hicache-file`: SGLang's reference backend `HiCacheFile`, through the path SGLang's controller uses for it
  (`batch_get` of 128 keys into flat pages, then each page copied into the host pool), the page cache dropped
  first;
- `ours-v1`: our backend through the zero-copy path SGLang uses with `interface_v1` (`batch_get_v1` of 128 keys
  straight into SGLang's host pool), the node's DRAM pool emptied first, so every page comes from the disk tier;
- `ours-flat`: our backend through the same path as HiCacheFile (`batch_get` into flat pages, then the copies);
- `store-get-into`: our store's own `get_into` on the same chunks into caller buffers (the ceiling our backend's
  overhead is judged against);
- `fio`: fio reading HiCacheFile's own files, O_DIRECT, a whole page per read, as many in flight as our store
  runs, into huge-page buffers where the node can reserve them: what the device gives.

Paired per round: ours-v1 / hicache-file and ours-v1 / store-get-into, medians and ranges over the rounds.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import tempfile
import time
import uuid
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import torch

from kvprefetch.bench.micro.fio_reference import fio_available
from kvprefetch.bench.micro.iobench import evict_all, huge_page_pool
from kvprefetch.bench.micro.pagecache import drop_page_cache
from kvprefetch.tiers.chunk_format import image_bytes

BATCH = 128  # SGLang's STORAGE_BATCH_SIZE: pages per storage call
PATHS = ("hicache-file", "ours-v1", "ours-flat", "store-get-into")
FIO = "fio"  # the device's ceiling on HiCacheFile's own files: O_DIRECT, `threads` reads in flight
Progress = Callable[[str, float], None]


@dataclass(frozen=True)
class PageShape:
    """The KV of one SGLang page on one rank (default: Llama-3-8B, TP1, pages of 64 tokens, bf16: 8 MiB)."""

    page_tokens: int = 64
    layers: int = 32
    heads: int = 8
    head_dim: int = 128
    layout: str = "page_first"

    @property
    def page_bytes(self) -> int:
        return 2 * self.layers * self.page_tokens * self.heads * self.head_dim * 2


@dataclass
class SGLangBenchResult:
    shape: PageShape
    pages: int
    threads: int
    page_cache_dropped: bool
    gbps: dict[str, list[float]]  # path (and "fio" where fio ran) -> GB/s per round
    dram_backing: str = "shm"  # our DRAM pool's memory: hugetlbfs where huge pages could be reserved

    def median(self, path: str) -> float:
        return statistics.median(self.gbps[path])

    def paired(self, num: str, den: str) -> tuple[float, float, float]:
        """Median, min and max over the rounds of num's rate over den's in the same round."""
        ratios = [a / b for a, b in zip(self.gbps[num], self.gbps[den], strict=True)]
        return statistics.median(ratios), min(ratios), max(ratios)

    def to_json(self) -> dict:
        out = asdict(self) | {"page_bytes": self.shape.page_bytes}
        out["medians_gbps"] = {p: self.median(p) for p in self.gbps}
        out["ours_v1_over_hicache_file"] = self.paired("ours-v1", "hicache-file")
        out["ours_v1_over_store_get_into"] = self.paired("ours-v1", "store-get-into")
        return out


class _Bench:
    """Both backends over one directory, SGLang's host pool, and the pages stored in both."""

    def __init__(self, root: Path, shape: PageShape, pages: int, threads: int, huge: Path | None):
        from sglang.srt.mem_cache.hicache_storage import HiCacheFile

        from kvprefetch.sglang import KVPrefetchStorage
        from kvprefetch.sglang.hostpool import host_pool, storage_config

        self.shape, self.pages = shape, pages
        batch = min(BATCH, pages)
        self.pool = host_pool(shape.layout, shape.page_tokens, shape.layers, shape.heads, shape.head_dim,
                              tokens=batch * shape.page_tokens, ratio=1.0)  # fmt: skip
        self.huge = huge
        self.backing = backing = "hugetlbfs" if huge is not None else "shm"
        extra = {
            "dram": {
                "capacity_bytes": (pages + 8) * image_bytes(shape.page_bytes),
                "backing": backing,
                "pool_name": f"sglbench-{uuid.uuid4().hex[:8]}",
            },
            "disk": {"path": str(root / "ours"), "capacity_bytes": 1 << 50},
            "io": {"threads": threads},
        }
        self.ours = KVPrefetchStorage(storage_config(extra=extra, layout=shape.layout))
        self.ours.register_mem_pool_host(self.pool)
        self.file = HiCacheFile(storage_config(layout=shape.layout), file_path=str(root / "hicache"))
        self.keys = [f"{i:064x}" for i in range(pages)]
        self.indices = self.pool.alloc(batch * shape.page_tokens)
        self.flat = [self.pool.get_dummy_flat_data_page() for _ in range(batch)]
        self.buffers = [np.empty(shape.page_bytes, np.uint8) for _ in range(batch)]

    def fill(self) -> None:
        """Store every page in both backends (one random page's bytes under every key), durable on disk."""
        seeded = torch.Generator().manual_seed(0)
        raw = torch.randint(0, 256, (self.shape.page_bytes,), dtype=torch.uint8, generator=seeded)
        page = raw.view(self.pool.dtype)
        for batch in self._batches():
            assert self.file.batch_set(batch, [page] * len(batch))
            assert self.ours.batch_set(batch, [page] * len(batch))
        assert self.ours.store is not None and self.ours.store.flush(timeout=600)

    def _batches(self) -> list[list[str]]:
        return [self.keys[i : i + BATCH] for i in range(0, len(self.keys), BATCH)]

    def cold(self) -> None:
        """Nothing of the pages left in RAM: the node's DRAM pool emptied, the page cache dropped."""
        assert self.ours.store is not None
        evict_all(self.ours.store, self.ours.chunk_keys(self.keys))
        drop_page_cache()

    def read(self, path: str) -> float:
        """One cold pass over every page through `path`; GB/s."""
        self.cold()
        read_batch = getattr(self, "_" + path.replace("-", "_"))
        t0 = time.perf_counter()
        for batch in self._batches():
            if read_batch(batch) != len(batch):
                raise RuntimeError(f"{path}: a benchmark read failed")
        return self.pages * self.shape.page_bytes / (time.perf_counter() - t0) / 1e9

    def _hicache_file(self, batch: list[str]) -> int:
        return self._into_host_pool(self.file.batch_get(batch, self.flat[: len(batch)]))

    def _into_host_pool(self, pages: list) -> int:
        """What SGLang's controller does with flat pages (`_generic_page_get`): each one copied into the host pool
        (`set_from_flat_data_page`) up to the first miss; how many."""
        for i, page in enumerate(pages):
            if page is None:
                return i
            self.pool.set_from_flat_data_page(int(self.indices[i * self.shape.page_tokens]), page)
        return len(pages)

    def _ours_v1(self, batch: list[str]) -> int:
        return sum(self.ours.batch_get_v1(batch, self.indices[: len(batch) * self.shape.page_tokens]))

    def _ours_flat(self, batch: list[str]) -> int:
        return self._into_host_pool(self.ours.batch_get(batch, self.flat[: len(batch)]))

    def _store_get_into(self, batch: list[str]) -> int:
        assert self.ours.store is not None
        return self.ours.store.get_into(self.ours.chunk_keys(batch), self.buffers[: len(batch)])

    def fio(self, iodepth: int) -> float:
        files = sorted(Path(self.file.file_path).glob("*.bin"))
        drop_page_cache()
        if self.huge is None:
            return fio_pages(files, self.shape.page_bytes, iodepth, "malloc")
        try:
            return fio_pages(files, self.shape.page_bytes, iodepth, f"mmaphuge:{self.huge / 'sglbench-fio'}")
        finally:
            (self.huge / "sglbench-fio").unlink(missing_ok=True)

    def close(self) -> None:
        """Our backend closed and its DRAM pool removed from the node (as iobench's `_close`)."""
        store = self.ours.store
        self.ours.close()
        if store is not None:
            store.dram.destroy()


def fio_pages(files: list[Path], page_bytes: int, iodepth: int, iomem: str = "malloc") -> float:
    """fio's O_DIRECT read (GB/s) of equal-sized files one after the other, `iodepth` reads in flight. Thousands of
    page files do not fit fio's --filename, so they are named to it as one job's files (`fio.0.<i>` links in a
    temporary directory, `--nrfiles`)."""
    with tempfile.TemporaryDirectory(prefix="kvprefetch-fio-") as tmp:
        for i, f in enumerate(files):
            os.symlink(f, Path(tmp) / f"fio.0.{i}")
        cmd = ["fio", "--name=fio", f"--directory={tmp}", f"--nrfiles={len(files)}", f"--filesize={page_bytes}",
               "--rw=read", "--direct=1", f"--bs={page_bytes}", f"--iodepth={iodepth}", f"--iomem={iomem}",
               "--ioengine=libaio", "--file_service_type=sequential", "--readonly", "--output-format=json"]  # fmt: skip
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    if out.returncode != 0:
        raise RuntimeError(f"fio failed: {out.stderr.strip()[-300:]}")
    return json.loads(out.stdout[out.stdout.index("{") :])["jobs"][0]["read"]["bw_bytes"] / 1e9


def run_sglangbench(root: Path, total_bytes: int, threads: int, repeats: int, shape: PageShape = PageShape(),
                    progress: Progress = lambda label, frac: None) -> SGLangBenchResult:  # fmt: skip
    """Store `total_bytes` of pages in both backends under root, then `repeats` interleaved rounds of cold reads."""
    pages = max(1, total_bytes // shape.page_bytes)
    with huge_page_pool(huge_page_bytes(pages, shape, threads)) as huge:
        return _rounds(_Bench(root, shape, pages, threads, huge), threads, repeats, progress)


def huge_page_bytes(pages: int, shape: PageShape, threads: int) -> int:
    """Huge pages the run reserves where it can (as root; as `kvprefetch iobench` does): our DRAM pool and the
    I/O threads' staging buffers (the store's configuration for speed), and fio's buffers."""
    image = image_bytes(shape.page_bytes)
    return (pages + 8) * image + threads * (image + (2 << 20)) + (threads + 1) * shape.page_bytes


def _rounds(bench: _Bench, threads: int, repeats: int, progress: Progress) -> SGLangBenchResult:
    pages = bench.pages
    try:
        progress("writing the pages to both backends", 0.0)
        bench.fill()
        paths = (*PATHS, FIO) if fio_available() else PATHS
        rates: dict[str, list[float]] = {p: [] for p in paths}
        dropped = drop_page_cache()
        for r in range(repeats):
            order = paths[r % len(paths) :] + paths[: r % len(paths)]
            for i, path in enumerate(order):
                progress(f"round {r + 1}/{repeats}: {path}", (r * len(paths) + i) / (repeats * len(paths)))
                rates[path].append(bench.fio(threads) if path == FIO else bench.read(path))
        progress("done", 1.0)
        return SGLangBenchResult(bench.shape, pages, threads, dropped, rates, bench.backing)
    finally:
        bench.close()
