"""Cold chunk reads from local disk: kvprefetch's TieredStore against LMCache's LMCacheEngine (CPU + local_disk).

One run, one directory, one machine, the same chunks (same token count, KV shape, dtype and bytes) and the same
number of I/O threads for both systems:

1. write N chunks through each system (LMCache: `LMCacheEngine.store` with a small CPU buffer and the
   `local_disk` backend; kvprefetch: `TieredStore.put`), and wait until every chunk is on disk;
2. for `--repeats` rounds, interleaved (the order flips every round):
   - LMCache: drop its CPU copies (`clear(locations=["LocalCPUBackend"])`), drop the page cache, then
     `retrieve` every chunk, `--window` chunks per request, into caller buffers;
   - kvprefetch demand path: `dram.discard` every key, drop the page cache, then `get_into` every chunk,
     `--window` chunks per call, into caller buffers (disk -> DRAM slot -> caller buffer);
   - kvprefetch prefetch path: the same, then `prefetch` all keys at once (disk -> DRAM pool) and wait.

The page cache is dropped (`sync; echo 1 > /proc/sys/vm/drop_caches`, needs root) before every timed pass,
so LMCache's buffered reads (its default) are not served from memory; kvprefetch reads with O_DIRECT anyway.
Each pass records the bytes the process fetched from storage (`read_bytes` in /proc/self/io) as evidence that
the data came from disk, and every chunk returned to a caller buffer is compared with what was stored.

LMCache is not a dependency of kvprefetch: run this script from an environment that has both, e.g.

    PYTHONPATH=src /path/to/venv-with-lmcache/bin/python benchmarks/compare_lmcache.py --json out.json
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from dataclasses import asdict, dataclass, field
from importlib.metadata import version
from pathlib import Path

# Quiet, offline LMCache: set before it is imported.
os.environ.setdefault("LMCACHE_TRACK_USAGE", "false")
os.environ.setdefault("DO_NOT_TRACK", "1")
os.environ.setdefault("LMCACHE_LOG_LEVEL", "WARNING")

import numpy as np

GIB = 1 << 30
MIB = 1 << 20


# ---- helpers shared by both systems --------------------------------------------------------------------------
def storage_read_bytes() -> int:
    """Bytes this process has caused to be fetched from storage (all threads), from /proc/self/io."""
    try:
        for line in Path("/proc/self/io").read_text().splitlines():
            if line.startswith("read_bytes:"):
                return int(line.split()[1])
    except OSError:
        pass
    return -1


def drop_page_cache(enabled: bool) -> bool:
    """Write back dirty pages and drop the clean page cache; False when not allowed (not root)."""
    if not enabled:
        return False
    os.sync()
    try:
        Path("/proc/sys/vm/drop_caches").write_text("1\n")
    except OSError:
        return False
    return True


@dataclass
class Pass:
    """One timed pass of one system over all chunks."""

    system: str
    gbps: float
    seconds: float
    chunks_loaded: int
    storage_read_bytes: int
    verified_chunks: int
    page_cache_dropped: bool


@dataclass
class Report:
    lmcache_version: str
    lmcache_config: dict
    kvprefetch_config: dict
    machine: dict
    chunk_tokens: int
    kv_shape: list[int]
    dtype: str
    chunk_bytes: int
    n_chunks: int
    total_bytes: int
    window: int
    threads: int
    repeats: int
    directory: str
    kvprefetch_pool_slots: int
    write_gbps: dict[str, float] = field(default_factory=dict)
    passes: list[Pass] = field(default_factory=list)

    def medians(self) -> dict[str, float]:
        out: dict[str, float] = {}
        for name in dict.fromkeys(p.system for p in self.passes):
            out[name] = statistics.median(p.gbps for p in self.passes if p.system == name)
        return out


def make_chunks(n: int, chunk_bytes: int, seed: int = 0) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    return [rng.integers(0, 256, chunk_bytes, dtype=np.uint8) for _ in range(n)]


# ---- LMCache side ---------------------------------------------------------------------------------------------
class LMCacheSide:
    """An in-process LMCacheEngine with the CPU (L1) and local_disk backends, fed and drained from CPU tensors.

    The engine moves KV between its memory objects and the serving engine through a connector; here the
    connector copies between the memory objects and plain CPU byte tensors passed per call (`src=` on
    store, `dst=` on retrieve), so a retrieve ends in caller memory just as kvprefetch's `get_into` does.
    """

    name = "lmcache.retrieve"

    def __init__(self, root: Path, args, chunks: list[np.ndarray]):
        import torch
        from lmcache.v1.cache_engine import LMCacheEngineBuilder
        from lmcache.v1.config import LMCacheEngineConfig
        from lmcache.v1.gpu_connector.gpu_connectors import GPUConnectorInterface
        from lmcache.v1.metadata import LMCacheMetadata

        self.torch = torch
        self.builder = LMCacheEngineBuilder
        self.args = args
        self.chunk_tokens = args.chunk_tokens
        self.dir = root / "lmcache"
        self.dir.mkdir(parents=True, exist_ok=True)
        kv_shape = (args.layers, 2, args.chunk_tokens, args.kv_heads, args.head_size)
        chunk_tokens = args.chunk_tokens

        class HostBufferConnector(GPUConnectorInterface):
            """Copies whole chunks between LMCache memory objects and per-request lists of CPU byte tensors."""

            def to_gpu(self, memory_obj, start, end, **kwargs):
                kwargs["dst"][start // chunk_tokens].copy_(memory_obj.tensor.view(torch.uint8).view(-1))

            def from_gpu(self, memory_obj, start, end, **kwargs):
                memory_obj.tensor.view(torch.uint8).view(-1).copy_(kwargs["src"][start // chunk_tokens])

            def batched_to_gpu(self, memory_objs=None, starts=None, ends=None, **kwargs):
                for obj, start, end in zip(memory_objs, starts, ends, strict=True):
                    self.to_gpu(obj, start, end, **kwargs)

            def batched_from_gpu(self, memory_objs, starts, ends, **kwargs):
                for obj, start, end in zip(memory_objs, starts, ends, strict=True):
                    self.from_gpu(obj, start, end, **kwargs)

            def get_shape(self, num_tokens):
                return torch.Size([kv_shape[0], 2, num_tokens, kv_shape[3], kv_shape[4]])

        chunk_bytes = len(chunks[0])
        extra = {"disk_io_threads": args.threads}
        if args.lmcache_odirect:
            extra["use_odirect"] = True
        self.config_dict = {
            "chunk_size": args.chunk_tokens,
            "local_cpu": True,
            "max_local_cpu_size": args.cpu_chunks * chunk_bytes / GIB,  # GB as LMCache counts them (2**30 B)
            "local_disk": str(self.dir),
            "max_local_disk_size": 2 * len(chunks) * chunk_bytes / GIB + 1,
            "extra_config": extra,
        }
        config = LMCacheEngineConfig.from_dict(self.config_dict)
        metadata = LMCacheMetadata(
            model_name="compare-lmcache",
            world_size=1,
            local_world_size=1,
            worker_id=0,
            local_worker_id=0,
            kv_dtype=getattr(torch, args.dtype),
            kv_shape=kv_shape,
            chunk_size=args.chunk_tokens,
        )
        self.instance_id = f"compare-lmcache-{uuid.uuid4().hex[:8]}"
        self.engine = LMCacheEngineBuilder.get_or_create(
            self.instance_id, config, metadata, HostBufferConnector(), lambda t, r: None, lambda o, r: o
        )
        self.engine.post_init()
        backends = self.engine.storage_manager.storage_backends
        self.cpu = backends["LocalCPUBackend"]
        self.disk = backends["LocalDiskBackend"]
        self.chunks = [torch.from_numpy(c) for c in chunks]
        # One request per window of chunks, each with its own tokens, so every request hashes to its own keys.
        w = args.window
        self.requests: list[tuple[object, list[int]]] = []  # (tokens, chunk indices)
        for first in range(0, len(chunks), w):
            idx = list(range(first, min(first + w, len(chunks))))
            tokens = (
                torch.arange(first * self.chunk_tokens, (idx[-1] + 1) * self.chunk_tokens, dtype=torch.long)
                + 7 * len(chunks) * self.chunk_tokens
            )
            self.requests.append((tokens, idx))
        self.keys = [
            [key for _, _, key in self.engine.token_database.process_tokens(tokens=tokens)]
            for tokens, _ in self.requests
        ]
        self.buffers = [torch.empty(chunk_bytes, dtype=torch.uint8) for _ in range(w)]

    def write(self) -> float:
        """Store every request; wait until the disk backend holds every chunk. Returns GB/s end to end."""
        t0 = time.perf_counter()
        for (tokens, idx), keys in zip(self.requests, self.keys, strict=True):
            self.engine.store(tokens, src=[self.chunks[i] for i in idx])
            self._wait_on_disk(keys)
        elapsed = time.perf_counter() - t0
        n = sum(len(k) for k in self.keys)
        if n != len(self.chunks):
            raise RuntimeError(f"LMCache made {n} keys for {len(self.chunks)} chunks")
        files = list(self.dir.rglob("*.pt"))
        if len(files) != n:
            raise RuntimeError(f"LMCache wrote {len(files)} files for {n} chunks")
        return n * len(self.chunks[0]) / elapsed / 1e9

    def _wait_on_disk(self, keys, timeout: float = 120.0) -> None:
        deadline = time.monotonic() + timeout
        while not all(self.disk.contains(k) for k in keys):
            if time.monotonic() > deadline:
                raise RuntimeError("LMCache did not write the chunks to its local disk backend in time")
            time.sleep(0.001)

    def warm_up(self) -> None:
        """One untimed request, so lazily loaded code is not charged to the first timed pass."""
        tokens = self.requests[0][0]
        self.engine.clear(locations=["LocalCPUBackend"])
        self.engine.retrieve(tokens, dst=self.buffers)

    def read_pass(self, drop: bool) -> Pass:
        self.engine.clear(locations=["LocalCPUBackend"])
        in_cpu = sum(self.cpu.contains(k) for keys in self.keys for k in keys)
        on_disk = sum(self.disk.contains(k) for keys in self.keys for k in keys)
        if in_cpu or on_disk != len(self.chunks):
            raise RuntimeError(f"before the pass: {in_cpu} chunks in LMCache's CPU tier, {on_disk} on its disk")
        dropped = drop_page_cache(drop)
        io0 = storage_read_bytes()
        elapsed = 0.0
        loaded = verified = 0
        for tokens, idx in self.requests:
            t0 = time.perf_counter()
            mask = self.engine.retrieve(tokens, dst=self.buffers)
            elapsed += time.perf_counter() - t0
            hit = int(mask.sum()) // self.chunk_tokens
            loaded += hit
            if hit != len(idx):
                raise RuntimeError(f"LMCache retrieved {hit} of {len(idx)} chunks")
            verified += sum(bool(self.torch.equal(self.buffers[j], self.chunks[i])) for j, i in enumerate(idx))
        io = storage_read_bytes() - io0
        total = loaded * len(self.chunks[0])
        return Pass(self.name, total / elapsed / 1e9, elapsed, loaded, io, verified, dropped)

    def close(self) -> None:
        self.builder.destroy(self.instance_id)


# ---- kvprefetch side ------------------------------------------------------------------------------------------
class KvprefetchSide:
    def __init__(self, root: Path, args, chunks: list[np.ndarray]):
        from kvprefetch.config import StoreConfig
        from kvprefetch.store import Tier, TieredStore
        from kvprefetch.tiers.chunk_format import image_bytes

        self.Tier = Tier
        self.dir = root / "kvprefetch"
        chunk_bytes = len(chunks[0])
        self.config_dict = {
            "dram": {
                "capacity_bytes": args.cpu_chunks * image_bytes(chunk_bytes) + 8 * MIB,
                "pool_name": f"cmp-lmcache-{uuid.uuid4().hex[:8]}",
                "backing": "shm",
            },
            "disk": {"path": str(self.dir), "capacity_bytes": 1 << 50},
            "io": {"threads": args.threads},
        }
        self.store = TieredStore(StoreConfig.load(**self.config_dict), chunk_bytes=chunk_bytes)
        self.chunks = chunks
        self.window = args.window
        self.keys = [uuid.uuid4().bytes * 2 for _ in chunks]
        self.buffers = [np.empty(chunk_bytes, np.uint8) for _ in range(args.window)]

    def write(self) -> float:
        t0 = time.perf_counter()
        for first in range(0, len(self.keys), self.window):
            batch = slice(first, first + self.window)
            self.store.put(self.keys[batch], self.chunks[batch]).result()
        elapsed = time.perf_counter() - t0
        if not self.store.flush(60):
            raise RuntimeError("kvprefetch write-back did not finish")
        return len(self.keys) * len(self.chunks[0]) / elapsed / 1e9

    def _evict(self) -> None:
        for key in self.keys:
            self.store.dram.discard(key)
        tiers = self.store.lookup(self.keys)
        if tiers.num_hit_chunks != len(self.keys) or tiers.count(self.Tier.DISK) != len(self.keys):
            on_disk = tiers.count(self.Tier.DISK)
            raise RuntimeError(f"before the pass: {on_disk} of {len(self.keys)} chunks on disk only")

    def warm_up(self) -> None:
        self._evict()
        self.store.get_into(self.keys[: self.window], self.buffers)

    def get_into_pass(self, drop: bool) -> Pass:
        self._evict()
        dropped = drop_page_cache(drop)
        hits0 = self.store.counters["disk_hits"]
        io0 = storage_read_bytes()
        elapsed = 0.0
        loaded = verified = 0
        for first in range(0, len(self.keys), self.window):
            keys = self.keys[first : first + self.window]
            t0 = time.perf_counter()
            n = self.store.get_into(keys, self.buffers[: len(keys)])
            elapsed += time.perf_counter() - t0
            loaded += n
            if n != len(keys):
                raise RuntimeError(f"kvprefetch loaded {n} of {len(keys)} chunks")
            verified += sum(bool(np.array_equal(self.buffers[j], self.chunks[first + j])) for j in range(len(keys)))
        io = storage_read_bytes() - io0
        if self.store.counters["disk_hits"] - hits0 != loaded:
            raise RuntimeError("kvprefetch served some chunks from somewhere other than disk")
        return Pass(
            "kvprefetch.get_into", loaded * len(self.chunks[0]) / elapsed / 1e9, elapsed, loaded, io, verified, dropped
        )

    def prefetch_pass(self, drop: bool) -> Pass:
        """Disk -> DRAM pool for all keys at once. The pool holds only --cpu-chunks chunks, so the earlier ones
        are evicted again by the later ones; the chunks still in DRAM afterwards are checked against the data."""
        self._evict()
        dropped = drop_page_cache(drop)
        promoted0 = self.store.counters["promoted"]
        io0 = storage_read_bytes()
        t0 = time.perf_counter()
        handle = self.store.prefetch(self.keys)
        handle.wait()
        elapsed = time.perf_counter() - t0
        io = storage_read_bytes() - io0
        ok = sum(1 for t in handle.tickets.values() if t.result())
        promoted = self.store.counters["promoted"] - promoted0
        if ok != len(self.keys) or promoted != len(self.keys):
            raise RuntimeError(f"kvprefetch prefetch: {ok} tickets ok, {promoted} promoted of {len(self.keys)}")
        verified = 0
        in_dram = [i for i, hot in enumerate(self.store.dram.contains_many(self.keys)) if hot]
        for first in range(0, len(in_dram), self.window):
            idx = in_dram[first : first + self.window]
            hits0 = self.store.counters["dram_hits"]
            n = self.store.get_into([self.keys[i] for i in idx], self.buffers[: len(idx)])
            if self.store.counters["dram_hits"] - hits0 != n:
                break  # a chunk was evicted meanwhile; stop checking rather than read disk again
            verified += sum(bool(np.array_equal(self.buffers[j], self.chunks[i])) for j, i in enumerate(idx[:n]))
        return Pass("kvprefetch.prefetch", ok * len(self.chunks[0]) / elapsed / 1e9, elapsed, ok, io, verified, dropped)

    def close(self) -> None:
        self.store.close()
        self.store.dram.destroy()


# ---- driver ---------------------------------------------------------------------------------------------------
def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument(
        "--dir",
        type=Path,
        default=None,
        help="where both stores put their files (default: a new temporary folder under /var/tmp, removed afterwards)",
    )
    p.add_argument("--total-mib", type=int, default=1024, help="bytes of KV to write and read (default 1024)")
    p.add_argument("--chunk-tokens", type=int, default=256, help="tokens per chunk (default 256)")
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--kv-heads", type=int, default=4)
    p.add_argument("--head-size", type=int, default=128)
    p.add_argument("--dtype", default="float16", choices=["float16", "bfloat16", "float32"])
    p.add_argument("--window", type=int, default=16, help="chunks per retrieve / get_into call (default 16)")
    p.add_argument(
        "--cpu-chunks",
        type=int,
        default=64,
        help="CPU memory of each system, in chunks: LMCache's max_local_cpu_size, kvprefetch's DRAM "
        "pool (default 64; 0.25 GiB at the default chunk)",
    )
    p.add_argument("--threads", type=int, default=4, help="disk I/O threads of each system (default 4)")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--lmcache-odirect", action="store_true", help="turn on LMCache's extra_config use_odirect")
    p.add_argument("--no-drop-caches", action="store_true", help="do not drop the page cache before each pass")
    p.add_argument("--json", type=Path, default=None, help="write the numbers here")
    p.add_argument("--keep", action="store_true", help="keep the files")
    return p.parse_args(argv)


def itemsize(dtype: str) -> int:
    return {"float16": 2, "bfloat16": 2, "float32": 4}[dtype]


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        import lmcache  # noqa: F401

        lmcache_version = version("lmcache")
    except ImportError as err:
        print(
            f"LMCache is not importable here ({err}); run this from an environment that has lmcache installed",
            file=sys.stderr,
        )
        return 2
    chunk_bytes = args.layers * 2 * args.chunk_tokens * args.kv_heads * args.head_size * itemsize(args.dtype)
    n_chunks = max(1, args.total_mib * MIB // chunk_bytes)
    drop = not args.no_drop_caches
    if drop and not drop_page_cache(True):
        print("cannot drop the page cache (not root?); rerun as root or pass --no-drop-caches", file=sys.stderr)
        return 2
    owned = args.dir is None
    root = Path(tempfile.mkdtemp(prefix="compare-lmcache-", dir="/var/tmp")) if owned else args.dir
    root.mkdir(parents=True, exist_ok=True)
    print(
        f"{n_chunks} chunks of {chunk_bytes / MIB:.2f} MiB ({args.chunk_tokens} tokens, KV "
        f"[{args.layers}, 2, {args.chunk_tokens}, {args.kv_heads}, {args.head_size}] {args.dtype}) in {root}",
        flush=True,
    )
    chunks = make_chunks(n_chunks, chunk_bytes)
    lmc = kvp = None
    try:
        lmc = LMCacheSide(root, args, chunks)
        kvp = KvprefetchSide(root, args, chunks)
        report = Report(
            lmcache_version=lmcache_version,
            lmcache_config=lmc.config_dict,
            kvprefetch_config=kvp.config_dict,
            machine={"cpus": os.cpu_count(), "platform": platform.platform(), "fs": fs_of(root)},
            chunk_tokens=args.chunk_tokens,
            kv_shape=[args.layers, 2, args.chunk_tokens, args.kv_heads, args.head_size],
            dtype=args.dtype,
            chunk_bytes=chunk_bytes,
            n_chunks=n_chunks,
            total_bytes=n_chunks * chunk_bytes,
            window=args.window,
            threads=args.threads,
            repeats=args.repeats,
            directory=str(root),
            kvprefetch_pool_slots=kvp.store.dram.geometry.n_slots,
        )
        print("writing ...", flush=True)
        report.write_gbps["lmcache.store"] = lmc.write()
        report.write_gbps["kvprefetch.put"] = kvp.write()
        lmc.warm_up()
        kvp.warm_up()
        steps = [lmc.read_pass, kvp.get_into_pass, kvp.prefetch_pass]
        for r in range(args.repeats):
            for step in steps if r % 2 == 0 else steps[::-1]:
                p = step(drop)
                report.passes.append(p)
                print(
                    f"  round {r + 1}: {p.system:<20} {p.gbps:6.3f} GB/s  read from storage "
                    f"{p.storage_read_bytes / MIB:7.1f} MiB  verified {p.verified_chunks}/{p.chunks_loaded}",
                    flush=True,
                )
    finally:
        if kvp is not None:
            kvp.close()
        if lmc is not None:
            lmc.close()
        if owned and not args.keep:
            shutil.rmtree(root, ignore_errors=True)
    print_table(report, drop)
    if args.json:
        out = asdict(report)
        out["medians_gbps"] = report.medians()
        out["ratios_vs_lmcache"] = ratios(report)
        args.json.write_text(json.dumps(out, indent=2) + "\n")
    return 0


def ratios(report: Report) -> dict[str, float]:
    med = report.medians()
    base = med["lmcache.retrieve"]
    return {k: v / base for k, v in med.items()}


def fs_of(path: Path) -> str:
    try:
        out = subprocess.run(["df", "--output=source,fstype", str(path)], capture_output=True, text=True, check=True)
        return " ".join(out.stdout.split()[2:])
    except (OSError, subprocess.CalledProcessError):
        return "?"


def print_table(report: Report, dropped: bool) -> None:
    med = report.medians()
    rat = ratios(report)
    total = report.total_bytes
    print()
    print(
        f"cold reads of {report.n_chunks} x {report.chunk_bytes / MIB:.2f} MiB chunks "
        f"({total / GIB:.2f} GiB), {report.window} chunks per call, {report.threads} I/O threads each, "
        f"median of {report.repeats}; page cache {'dropped before each pass' if dropped else 'NOT dropped'}"
    )
    print(f"{'path':<22}{'GB/s (median)':>14}{'x LMCache':>11}{'read from disk':>16}{'verified':>10}")
    for name, gbps in med.items():
        mine = [p for p in report.passes if p.system == name]
        io = statistics.median(p.storage_read_bytes for p in mine) / total
        ver = f"{min(p.verified_chunks for p in mine)}/{report.n_chunks}"
        print(f"{name:<22}{gbps:>14.3f}{rat[name]:>11.2f}{io:>15.0%}{ver:>10}")
    if "kvprefetch.prefetch" in med:
        print(
            f"(prefetch: the DRAM pool holds {report.kvprefetch_pool_slots} chunks, so only those left in DRAM at "
            "the end are compared with the data)"
        )
    w = report.write_gbps
    lmc_write = "O_DIRECT" if report.lmcache_config["extra_config"].get("use_odirect") else "buffered"
    print(
        f"writes (end to end, informational): LMCache store {w['lmcache.store']:.3f} GB/s ({lmc_write}, no fsync), "
        f"kvprefetch put {w['kvprefetch.put']:.3f} GB/s (O_DIRECT + fsync)"
    )
    print(f"LMCache {report.lmcache_version}: {json.dumps(report.lmcache_config)}")


if __name__ == "__main__":
    sys.exit(main())
