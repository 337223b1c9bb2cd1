"""`kvprefetch loadbench`: weight loaders side by side on one checkpoint, page cache dropped before every pass.

Each pass is one fresh process (`kvprefetch.loader.harness`) that builds the vLLM model and times the loader's
`load_weights` alone. Passes run in rounds, every mode once per round in turn (interleaved: the disk of a
shared VM drifts, and interleaving spreads the drift over all modes), and each mode's median is reported:

    default          vLLM's safetensors loader (mmap + page cache)
    runai_streamer   vLLM's runai-model-streamer loader
    fastsafetensors  vLLM's fastsafetensors loader (needs a CUDA device: unavailable on CPU hosts, with its reason)
    kvprefetch       ours, cold from the local disk (no cache)
    * network        default and ours reading a source throttled to `--network-gbps` by the cgroup read throttle
                     the KV bench uses (`bench.regime`), ours with the weight cache on: the cold load fills it
    kvprefetch warm-dram   ours again, from the node's DRAM pool the network pass filled (a pool sized to the
                     checkpoint, kept between processes: `dram.keep_idle_s`), as the next engine on the node finds it
    kvprefetch warm-cache  ours again, from the weight cache on the local disk (the DRAM pool removed first), as
                     a restart finds it once the pool is gone
    fio              fio's sequential O_DIRECT read of the same files (best queue depth and buffer memory, huge
                     pages included when reserved): the device's ceiling

Beside each row's seconds, where they went (medians over the passes): the process's CPU seconds per GB loaded
(every thread, kernel included; fio's own for fio), and for ours the loading thread's waits for bytes and vLLM's
time with the tensors handed to it (its copies into the parameters): a load is read-bound when it waits, and
copy- or CPU-bound when vLLM's copies fill its seconds.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from kvprefetch.bench.micro.pagecache import drop_page_cache
from kvprefetch.bench.regime import make_throttle
from kvprefetch.loader.cache import full_identity, header_identity
from kvprefetch.loader.harness import MARK
from kvprefetch.loader.shards import open_checkpoint
from kvprefetch.tiers.disk import chunk_files


@dataclass(frozen=True)
class Mode:
    loader: str  # the row's loader name
    regime: str  # local | network | warm-dram | warm-cache | device
    load_format: str | None  # None: fio
    cache: bool = False

    @property
    def keeps_pool(self) -> bool:
        """Whether the pass reads the DRAM pool the pass before it filled (every other pass starts without one)."""
        return self.regime == "warm-dram"


MODES = [
    Mode("fio", "device", None),
    Mode("default", "local", "safetensors"),
    Mode("runai_streamer", "local", "runai_streamer"),
    Mode("fastsafetensors", "local", "fastsafetensors"),
    Mode("kvprefetch", "local", "kvprefetch"),
    Mode("default", "network", "safetensors"),
    Mode("kvprefetch", "network", "kvprefetch", cache=True),
    Mode("kvprefetch", "warm-dram", "kvprefetch", cache=True),  # right after the network pass: its pool
    Mode("kvprefetch", "warm-cache", "kvprefetch", cache=True),
]


@dataclass
class Row:
    loader: str
    regime: str
    seconds: float | None = None
    gbps: float | None = None
    ratio_to_default: float | None = None
    samples: list[float] = field(default_factory=list)
    unavailable: str | None = None
    cpu_s_per_gb: float | None = None  # the process's CPU seconds (all threads, kernel included) per GB loaded
    wait_s: float | None = None  # ours: the loading thread waiting for blocks to land
    handout_s: float | None = None  # ours: vLLM's time with the tensors handed out (its copies into the parameters)

    def as_json(self) -> dict:
        """{loader, regime, seconds, gbps, ratio_to_default} always (null where unavailable), then the details."""
        keys = ("loader", "regime", "seconds", "gbps", "ratio_to_default", "samples", "cpu_s_per_gb", "wait_s",
                "handout_s")  # fmt: skip
        out = {k: getattr(self, k) for k in keys}
        return out | ({"unavailable": self.unavailable} if self.unavailable else {})


def make_checkpoint(path: Path, layers: int, hidden: int, shard_size: str) -> None:
    """A random Llama in bf16 written by transformers, in several safetensors shards (kept for later runs)."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(
        vocab_size=32000,
        hidden_size=hidden,
        intermediate_size=int(hidden * 2.75) // 256 * 256,
        num_hidden_layers=layers,
        num_attention_heads=hidden // 128,
        num_key_value_heads=max(1, hidden // 512),
        head_dim=128,
        max_position_embeddings=4096,
        initializer_range=0.02,
        torch_dtype="bfloat16",
    )
    with torch.device("cpu"):
        model = LlamaForCausalLM(cfg).to(torch.bfloat16)
    tmp = path.with_name(path.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    model.save_pretrained(tmp, safe_serialization=True, max_shard_size=shard_size)
    tmp.rename(path)


def fio_read(files: list[Path], block: int, iodepth: int, iomem: str = "malloc") -> dict:
    """fio's sequential O_DIRECT read of exactly these files, one after the other (libaio, iodepth and buffer
    memory given: malloc, or mmaphuge for buffers on huge pages): {gbps, seconds, cpu_s} (fio's CPU, user and
    kernel, over its run)."""
    total = sum(f.stat().st_size for f in files) // block * block
    cmd = [
        "fio",
        "--name=loadbench",
        "--filename=" + ":".join(str(f).replace(":", "\\:") for f in files),
        "--rw=read",
        "--direct=1",
        f"--bs={block}",
        f"--iodepth={iodepth}",
        "--ioengine=libaio",
        f"--iomem={iomem}",
        "--file_service_type=sequential",
        f"--io_size={total}",
        "--readonly",
        "--output-format=json",
    ]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    if out.returncode != 0:
        raise RuntimeError(f"fio failed: {out.stderr.strip()[-300:]}")
    job = json.loads(out.stdout[out.stdout.index("{") :])["jobs"][0]
    seconds = job["read"]["runtime"] / 1e3
    return {"gbps": job["read"]["bw_bytes"] / 1e9, "seconds": seconds,
            "cpu_s": (job["usr_cpu"] + job["sys_cpu"]) / 100 * seconds}  # fmt: skip


def run_pass(model: Path, load_format: str, extra: dict, cgroup: str | None, log: Path) -> dict:
    spec = {"model": str(model), "load_format": load_format, "extra": extra, "cgroup": cgroup}
    env = dict(os.environ, VLLM_LOGGING_LEVEL="WARNING", PYTHONUNBUFFERED="1")
    with open(log, "a") as err:
        out = subprocess.run(
            [sys.executable, "-m", "kvprefetch.loader.harness", json.dumps(spec)],
            stdout=subprocess.PIPE,
            stderr=err,
            text=True,
            env=env,
            timeout=1800,
        )
    lines = [ln for ln in out.stdout.splitlines() if ln.startswith(MARK)]
    if not lines:
        return {"error": f"harness exited {out.returncode} without a result (log: {log})"}
    return json.loads(lines[-1][len(MARK) :])


@dataclass
class LoadBench:
    model: Path
    work: Path
    repeats: int
    network_bps: int
    extra: dict
    block_bytes: int
    progress: Callable[[str], None] = print
    huge_pages: bool = False  # huge pages are reserved: fio's sweep tries buffers on them too
    notes: list[str] = field(default_factory=list)
    identity_seconds: dict[str, float] = field(default_factory=dict)
    timelines: dict[str, dict] = field(default_factory=dict)  # ours, per "loader regime": the last pass's timeline

    def run(self) -> list[Row]:
        ckpt = open_checkpoint(self.model)
        files = [s.path for s in ckpt.shards]
        total = ckpt.total_bytes
        cache_dir = self.work / "weight-cache"
        pool = f"kvp-loadbench-{os.getpid()}"
        # the pool holds the whole checkpoint (blocks plus their headers and some slack) and outlives each pass
        dram = {"pool_name": pool, "capacity_bytes": int(total * 1.05) + (64 << 20), "keep_idle_s": 600}
        cached = self.extra | {"cache": {"disk": {"path": str(cache_dir), "capacity_bytes": 4 * total}, "dram": dram}}
        throttle, why = make_throttle(self.model, f"kvp-loadbench-{os.getpid()}")
        if throttle is None:
            self.notes.append(f"network regime unavailable: {why}")
        else:
            throttle.set(self.network_bps)
            self.notes.append(
                f"network regime: {throttle.kind} on {throttle.device} at {self.network_bps / 1e9:.3f} GB/s"
            )
        if not drop_page_cache():
            self.notes.append("page cache NOT dropped between passes (needs root): cold rows may be warm")
        self._measure_identity(ckpt)
        samples: dict[Mode, list[float]] = {m: [] for m in MODES}
        details: dict[Mode, list[dict]] = {m: [] for m in MODES}  # per pass: cpu_s and ours' time split
        unavailable: dict[Mode, str] = {}
        fio_best = self._fio_sweep(files, self.block_bytes, unavailable)
        log = self.work / "loadbench-passes.log"
        try:
            for r in range(self.repeats):
                for m in MODES:
                    if m in unavailable:
                        continue
                    self.progress(f"round {r + 1}/{self.repeats}: {m.loader} {m.regime}")
                    if m.regime == "network" and m.cache:
                        shutil.rmtree(cache_dir, ignore_errors=True)  # the network pass is cold: it fills the cache
                    if not m.keeps_pool:
                        _remove_pool(pool)  # warm-cache reads the local disk cache, not a DRAM pool left over
                    drop_page_cache()
                    if m.load_format is None:
                        fio = fio_read(files, self.block_bytes, *fio_best)
                        samples[m].append(total / 1e9 / fio["gbps"])
                        details[m].append({"cpu_s": fio["cpu_s"]})
                        continue
                    if m.regime == "network" and throttle is None:
                        unavailable[m] = why
                        continue
                    cgroup = str(throttle.path) if m.regime == "network" and throttle is not None else None
                    extra = (cached if m.cache else self.extra) if m.load_format == "kvprefetch" else {}
                    if m.regime.startswith("warm") and not _filled(m, cache_dir, pool):
                        if m.keeps_pool:  # a fill that found the disk cache would put nothing into the pool
                            shutil.rmtree(cache_dir, ignore_errors=True)
                        run_pass(self.model, m.load_format, extra, None, log)  # no network pass filled it: fill now
                        if not m.keeps_pool:
                            _remove_pool(pool)
                        drop_page_cache()
                    res = run_pass(self.model, m.load_format, extra, cgroup, log)
                    if "error" in res:
                        unavailable[m] = res["error"]
                    else:
                        samples[m].append(res["seconds"])
                        details[m].append(_pass_details(res))
                        if res.get("timeline"):
                            self.timelines[f"{m.loader} {m.regime}"] = res["timeline"] | {"seconds": res["seconds"]}
        finally:
            _remove_pool(pool)
            if throttle is not None:
                throttle.remove()
        return self._rows(samples, unavailable, total, details)

    def _measure_identity(self, ckpt) -> None:
        """What keying the cache by a full hash would cost: the whole source read and hashed, on every load."""
        drop_page_cache()
        t0 = time.perf_counter()
        for shard in ckpt.shards:
            header_identity(shard)
        t1 = time.perf_counter()
        for shard in ckpt.shards:
            full_identity(shard)
        t2 = time.perf_counter()
        gb = ckpt.total_bytes / 1e9
        self.identity_seconds = {
            "header": t1 - t0,
            "full_local": t2 - t1,
            "full_network": gb / (self.network_bps / 1e9),
        }
        self.notes.append(
            f"cache identity: header hash {1e3 * (t1 - t0):.2f} ms for all shards; full hash {t2 - t1:.2f} s from the "
            f"local disk ({gb / (t2 - t1):.2f} GB/s), i.e. at least {gb / (self.network_bps / 1e9):.1f} s over the "
            "throttled network (a whole read of the source per load): the default identity is the header's"
        )

    def _fio_sweep(self, files: list[Path], block: int, unavailable: dict) -> tuple[int, str]:
        """fio's best (iodepth, buffer memory) on these files: the ceiling is the device's best, so fio gets
        huge-page buffers too when they are reserved (reads land faster there, and ours use them)."""
        if shutil.which("fio") is None:
            unavailable[MODES[0]] = "fio not installed"
            return 1, "malloc"
        best = (0.0, 1, "malloc")
        for iomem in ("malloc", "mmaphuge") if self.huge_pages else ("malloc",):
            for depth in (1, 4, 16):
                drop_page_cache()
                best = max(best, (fio_read(files, block, depth, iomem)["gbps"], depth, iomem))
        self.notes.append(
            f"fio: best queue depth {best[1]}, buffers {best[2]}, block {block >> 20} MiB "
            f"({best[0]:.2f} GB/s in the sweep)"
        )
        return best[1], best[2]

    def _rows(self, samples: dict[Mode, list[float]], unavailable: dict[Mode, str], total: int,
              details: dict[Mode, list[dict]] | None = None) -> list[Row]:  # fmt: skip
        rows = []
        for m in MODES:
            row = Row(m.loader, m.regime, samples=[round(s, 3) for s in samples[m]])
            if samples[m]:
                row.seconds = statistics.median(samples[m])
                row.gbps = total / 1e9 / row.seconds
                split = _median_split((details or {}).get(m, []))
                row.cpu_s_per_gb = None if split.get("cpu_s") is None else split["cpu_s"] / (total / 1e9)
                row.wait_s, row.handout_s = split.get("wait_s"), split.get("handout_s")
            else:
                row.unavailable = unavailable.get(m, "no sample")
            rows.append(row)
        ref = {r.regime: r.seconds for r in rows if r.loader == "default" and r.seconds}
        for r in rows:
            base = ref.get(r.regime, ref.get("local"))
            if r.seconds and base:
                r.ratio_to_default = base / r.seconds
        return rows


def _pass_details(res: dict) -> dict:
    """What a harness pass said about where its seconds went: its CPU, and ours' waits and vLLM's copies."""
    counters = res.get("counters") or {}
    return {"cpu_s": res.get("cpu_s"), "wait_s": counters.get("wait_s"), "handout_s": counters.get("handout_s")}


def _median_split(passes: list[dict]) -> dict:
    """The median of each figure the passes have (None where none has it)."""
    keys = {k for p in passes for k, v in p.items() if v is not None}
    return {k: statistics.median(p[k] for p in passes if p.get(k) is not None) for k in keys}


def _pool_files(name: str) -> list[Path]:
    return list(Path("/dev/shm").glob(f"*{name}*"))


def _filled(m: Mode, cache_dir: Path, pool: str) -> bool:
    """Whether what a warm pass reads is there: the DRAM pool (warm-dram) or the disk cache (warm-cache)."""
    return bool(_pool_files(pool)) if m.keeps_pool else bool(chunk_files(cache_dir))


def _remove_pool(name: str) -> None:
    for f in _pool_files(name):
        with contextlib.suppress(OSError):
            f.unlink()


def goals(rows: list[Row]) -> list[tuple[str, float | None, float, bool | None]]:
    """(goal, measured ratio, target, met) for the issue's goals."""
    s = {(r.loader, r.regime): r.seconds for r in rows}

    def ratio(a, b):
        return s[b] / s[a] if s.get(a) and s.get(b) else None

    checks = [
        ("kvprefetch cold local vs fio (speed ratio)", ratio(("kvprefetch", "local"), ("fio", "device")), 0.85),
        ("kvprefetch cold local vs vLLM default", ratio(("kvprefetch", "local"), ("default", "local")), 1.5),
        ("kvprefetch cold local vs runai_streamer", ratio(("kvprefetch", "local"), ("runai_streamer", "local")), 1.0),
        ("warm DRAM pool vs cold local", ratio(("kvprefetch", "warm-dram"), ("kvprefetch", "local")), 1.0),
        ("warm DRAM pool vs cold network", ratio(("kvprefetch", "warm-dram"), ("kvprefetch", "network")), 5.0),
        ("warm cache vs cold network", ratio(("kvprefetch", "warm-cache"), ("kvprefetch", "network")), 5.0),
    ]
    return [(name, v, target, None if v is None else v >= target) for name, v, target in checks]


WHITEPAPER_R9 = (6.2, 9.3)
"""The whitepaper's model loading: 6.2-9.3x faster service start from the node than from NFS (R9)."""


def whitepaper_comparison(rows: list[Row]) -> list[tuple[str, float | None]]:
    """Each warm tier's speed against ours cold from the network, the ratio R9 reports against NFS."""
    s = {(r.loader, r.regime): r.seconds for r in rows}
    cold = s.get(("kvprefetch", "network"))
    return [(f"warm {name} vs cold network", cold / s[key] if cold and s.get(key) else None)
            for name, key in (("DRAM pool", ("kvprefetch", "warm-dram")),
                              ("disk cache", ("kvprefetch", "warm-cache")))]  # fmt: skip


def plot(rows: list[Row], path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    shown = [r for r in rows if r.gbps]
    fig, ax = plt.subplots(figsize=(9, 4))
    labels = [f"{r.loader}\n{r.regime}" for r in shown]
    colors = ["#888" if r.loader == "fio" else "#2a7" if r.loader == "kvprefetch" else "#47c" for r in shown]
    ax.bar(labels, [r.gbps for r in shown], color=colors)
    for i, r in enumerate(shown):
        ax.text(i, r.gbps, f"{r.gbps:.2f}", ha="center", va="bottom", fontsize=8)
    ax.set_ylabel("GB/s (checkpoint bytes / load seconds, median)")
    ax.set_title(title, fontsize=9)
    ax.tick_params(axis="x", labelsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


SOURCE_COLORS = {"source": "#47c", "cache-disk": "#2a7", "cache-dram-map": "#d62", "cache-dram-copy": "#a5a"}


def plot_timelines(timelines: dict[str, dict], path: Path) -> bool:
    """One panel per pass of ours: every block as a bar from its read's start to its end (one row per block, in
    file order; colour: where it came from), the loading thread's waits for bytes in grey under them, and the
    load's end. False (nothing written) when there is no timeline."""
    if not timelines:
        return False
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(len(timelines), 1, figsize=(9, 2.2 * len(timelines)), squeeze=False)
    for ax, (name, tl) in zip(axes[:, 0], timelines.items(), strict=True):
        blocks = tl.get("blocks") or []
        for row, (start, end, source) in enumerate(blocks):
            ax.plot([start, end], [row, row], color=SOURCE_COLORS.get(source, "#888"), linewidth=1.2)
        for start, end in tl.get("waits") or []:
            ax.axvspan(start, end, ymax=0.04, color="#444", alpha=0.8)
        if tl.get("seconds"):
            ax.axvline(tl["seconds"], color="k", linestyle="--", linewidth=0.8)
        ax.set_title(f"{name}: {len(blocks)} blocks, {tl.get('seconds', 0):.2f} s (grey: waits for bytes)", fontsize=8)
        ax.set_ylabel("block", fontsize=7)
        ax.tick_params(labelsize=7)
    axes[-1, 0].set_xlabel("seconds from the reader's start")
    handles = [matplotlib.lines.Line2D([], [], color=c, label=s) for s, c in SOURCE_COLORS.items()]
    fig.legend(handles=handles, loc="upper right", fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def timestamp() -> str:
    return time.strftime("%Y%m%d-%H%M%S")
