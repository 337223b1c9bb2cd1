"""The device's read ceiling, measured by fio on the same directory: the yardstick for our read path."""

from __future__ import annotations

import json
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class FioRun:
    iodepth: int
    iomem: str
    gbps: float


def fio_available() -> bool:
    return shutil.which("fio") is not None


class FioReference:
    """Sequential O_DIRECT reads of one file laid out in the benchmark directory."""

    def __init__(self, directory: Path, size_bytes: int, block_bytes: int, runtime_s: float = 4.0):
        self.path = directory / "fio-reference.bin"
        self.size, self.block, self.runtime_s = size_bytes, block_bytes, runtime_s
        self._fio("write", iodepth=4, iomem="malloc")  # lay the file out once

    def read(self, iodepth: int, iomem: str) -> FioRun:
        return FioRun(iodepth, iomem, self._fio("read", iodepth, iomem))

    def sweep(self, depths: tuple[int, ...], memories: list[str]) -> list[FioRun]:
        """Every (queue depth, buffer type) pair once: the best one is the device's practical ceiling."""
        return [self.read(d, m) for m in memories for d in depths]

    def close(self) -> None:
        self.path.unlink(missing_ok=True)

    def _fio(self, rw: str, iodepth: int, iomem: str) -> float:
        cmd = [
            "fio", "--name=ref", f"--filename={self.path}", f"--rw={rw}", "--direct=1", f"--bs={self.block}",
            f"--size={self.size}", f"--iodepth={iodepth}", "--ioengine=libaio", f"--iomem={iomem}",
            f"--runtime={self.runtime_s}", "--output-format=json",
        ]  # fmt: skip
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=self.runtime_s + 180)
        if out.returncode != 0:
            raise RuntimeError(f"fio failed ({' '.join(cmd)}): {out.stderr.strip()[-400:]}")
        job = json.loads(out.stdout[out.stdout.index("{") :])["jobs"][0]
        return job["read" if rw == "read" else "write"]["bw_bytes"] / 1e9
