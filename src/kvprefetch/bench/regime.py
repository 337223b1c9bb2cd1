"""The storage regime: R = (time to recompute a chunk) / (time to load it from the slowest tier).

A GPU recomputes roughly a hundred times faster, relative to its storage, than this CPU does; left alone, the
CPU run would put storage in a regime no deployment has. `--regime R` caps the disk tier's read bandwidth at

    bps = R * bytes_per_token * prefill_tokens_per_s

(one chunk then loads R times faster than it recomputes), enforced by the kernel where it can be: a cgroup
(v1 ``blkio.throttle.read_bps_device`` or v2 ``io.max``) on the cache directory's block device, holding the
engine processes (O_DIRECT reads are throttled there). Else the I/O engine's own rate limit
(``io.read_rate_limit_bps``) does it. The regime actually obtained is measured afterwards and reported.
"""

from __future__ import annotations

import contextlib
import os
import time
from dataclasses import dataclass
from pathlib import Path

V1_BLKIO = Path("/sys/fs/cgroup/blkio")
V2_ROOT = Path("/sys/fs/cgroup")



@dataclass(frozen=True)
class WhitepaperRegime:
    """The whitepaper's R2 run in the numbers that decide whether prefetch can matter, from the simulator's
    fit of it (`kvprefetch.sim.scenarios.FIT`: 480B FP8, TP8 on 8 MI308X, NVMe-oF array): how much longer a
    request's context takes to recompute than to load (R), and how much of each prompt is reused."""

    context_tokens: int
    new_tokens: int
    output_tokens: int
    kv_bytes_per_token: float
    prefill_s: float  # recomputing the context on the deployment
    read_bps: float  # the array with parallel reads
    serial_read_bps: float  # one read in flight

    @property
    def load_s(self) -> float:
        return self.context_tokens * self.kv_bytes_per_token / self.read_bps

    @property
    def r(self) -> float:
        return self.prefill_s / self.load_s

    @property
    def r_serial(self) -> float:
        return self.prefill_s * self.serial_read_bps / (self.context_tokens * self.kv_bytes_per_token)

    @property
    def streams(self) -> float:
        """Reads the array needs in flight to reach its bandwidth: one stream alone reads 1/streams of it (the
        whitepaper's R1: the same array at 0.98 GB/s read serially, 5.23 GB/s in parallel)."""
        return self.read_bps / self.serial_read_bps

    @property
    def reused_share(self) -> float:
        return self.context_tokens / (self.context_tokens + self.new_tokens)

    def sentence(self) -> str:
        gb = self.context_tokens * self.kv_bytes_per_token / 1e9
        gbps, serial = self.read_bps / 1e9, self.serial_read_bps / 1e9
        return (f"the whitepaper's R2: recomputing a {self.context_tokens:,}-token context takes "
                f"{self.prefill_s:.1f} s (the simulator's fit: 480B on 8 MI308X), loading its {gb:.1f} GB at "
                f"{gbps:.2f} GB/s {self.load_s:.2f} s, so R = {self.r:.1f} (serial reads at {serial:.2f} GB/s: "
                f"R = {self.r_serial:.1f}); {100 * self.reused_share:.1f}% of each prompt is reused context")


def whitepaper_r2() -> WhitepaperRegime:
    """R2's regime, derived from the simulator's catalog and fit (nothing here is tuned to this machine)."""
    from kvprefetch.sim.catalog import ACCELERATORS, MODELS
    from kvprefetch.sim.costs import Deployment
    from kvprefetch.sim.scenarios import FIT, STORAGE

    model = MODELS["qwen3-coder-480b-fp8"]
    dep = Deployment(model, ACCELERATORS["mi308x"], tp=8, efficiency=FIT.efficiency, token_budget=FIT.token_budget)
    array = STORAGE["nvmeof-100gbe-raid0"]
    return WhitepaperRegime(FIT.context_tokens, FIT.new_tokens, FIT.output_tokens, model.kv_bytes_per_token,
                            dep.prefill_time(FIT.context_tokens), array.read_bw,
                            array.read_bw / array.parallelism)  # fmt: skip


def whitepaper_storage_share(concurrencies: list[int]) -> dict[int, float]:
    """How much of R2's on-demand TTFT p50 is storage, per concurrency, by the simulator's fit of it:
    1 - TTFT(dram) / TTFT(ondemand-sync). It bounds what hiding storage can cut from on-demand TTFT: prefetch
    cannot beat every chunk already being in DRAM. R2's effect (-26..-32%) needs a share at least that large;
    a bench whose share is smaller cannot show it however well prefetch hides its reads."""
    from kvprefetch.sim.policy import Policy
    from kvprefetch.sim.scenarios import run_whitepaper

    out = {}
    for c in concurrencies:
        sync = run_whitepaper(Policy.ONDEMAND_SYNC, c).ttft_p(50)
        out[c] = 1.0 - run_whitepaper(Policy.DRAM, c).ttft_p(50) / sync if sync > 0 else 0.0
    return out


def stream_bps(regime_bps: float | None) -> float | None:
    """One read stream's cap in a throttled regime: the emulated storage is the whitepaper's array, whose full
    bandwidth (`regime_bps` here) needs `WhitepaperRegime.streams` reads in flight; None (native) is uncapped."""
    return None if regime_bps is None else regime_bps / whitepaper_r2().streams


DEFAULT_REGIME = 18.2
"""R of the whitepaper's R2 run with parallel reads (`whitepaper_r2().r`, pinned by a test): the bench's default
storage regime, so that storage is as large a part of a request as it was there."""


def parse_regime(text: str) -> float | None:
    """'native' -> None (no throttle); '10' or '10x' -> 10.0."""
    t = text.strip().lower()
    if t == "native":
        return None
    try:
        r = float(t.removesuffix("x"))
    except ValueError:
        raise ValueError(f"regime must be a positive number or 'native', got {text!r}") from None
    if not r > 0:
        raise ValueError(f"regime must be positive, got {text!r}")
    return r


def target_bps(regime: float, bytes_per_token: float, prefill_tokens_per_s: float) -> int:
    return max(1, round(regime * bytes_per_token * prefill_tokens_per_s))


def measured_regime(prefill_tokens_per_s: float, chunk_tokens: int, chunk_bytes: int, read_bps: float) -> float:
    recompute_s = chunk_tokens / prefill_tokens_per_s
    load_s = chunk_bytes / read_bps
    return recompute_s / load_s


def block_device_of(path: str | os.PathLike) -> str | None:
    """'major:minor' of the whole disk holding path (a partition's parent), or None (tmpfs, overlay, ...)."""
    st = os.stat(path)
    major, minor = os.major(st.st_dev), os.minor(st.st_dev)
    if major == 0:
        return None
    sys_dev = Path(f"/sys/dev/block/{major}:{minor}")
    if not sys_dev.exists():
        return None
    if (sys_dev / "partition").exists():
        parent = sys_dev.resolve().parent / "dev"
        with contextlib.suppress(OSError):
            return parent.read_text().strip()
    return f"{major}:{minor}"


@dataclass
class Throttle:
    """A cgroup whose members' reads from one block device are capped; `path` is what members join."""

    kind: str  # "cgroup-v1-blkio" | "cgroup-v2-io"
    path: Path
    device: str

    def set(self, bps: int | None) -> None:
        if self.kind == "cgroup-v1-blkio":
            f = self.path / "blkio.throttle.read_bps_device"
            f.write_text(f"{self.device} {int(bps) if bps else 0}")
        else:
            (self.path / "io.max").write_text(f"{self.device} rbps={int(bps) if bps else 'max'}")

    def remove(self) -> None:
        with contextlib.suppress(OSError):
            self.set(None)
        # Members have exited by now; move any straggler back to the root before removing the group.
        with contextlib.suppress(OSError):
            for pid in (self.path / "cgroup.procs").read_text().split():
                (self.path.parent / "cgroup.procs").write_text(pid)
        # A helper process of the engine may leave the group a moment after the engine itself: retry a while.
        deadline = time.monotonic() + 15
        while True:
            try:
                self.path.rmdir()
                return
            except FileNotFoundError:
                return
            except OSError:
                if time.monotonic() > deadline:
                    return
                time.sleep(0.25)


def make_throttle(cache_dir: str | os.PathLike, name: str) -> tuple[Throttle | None, str]:
    """A kernel read throttle for cache_dir's device, or (None, why not)."""
    device = block_device_of(cache_dir)
    if device is None:
        return None, f"{cache_dir} is not on a block device"
    if V1_BLKIO.is_dir() and (V1_BLKIO / "blkio.throttle.read_bps_device").exists():
        path = V1_BLKIO / name
        try:
            path.mkdir(exist_ok=True)
            t = Throttle("cgroup-v1-blkio", path, device)
            t.set(None)
            return t, ""
        except OSError as err:
            with contextlib.suppress(OSError):
                path.rmdir()
            return None, f"cgroup v1 blkio not writable ({err.strerror})"
    controllers = V2_ROOT / "cgroup.subtree_control"
    if controllers.exists() and "io" in controllers.read_text().split():
        path = V2_ROOT / name
        try:
            path.mkdir(exist_ok=True)
            t = Throttle("cgroup-v2-io", path, device)
            t.set(None)
            return t, ""
        except OSError as err:
            with contextlib.suppress(OSError):
                path.rmdir()
            return None, f"cgroup v2 io.max not writable ({err.strerror})"
    return None, "no cgroup blkio/io controller available"
