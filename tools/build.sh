#!/usr/bin/env bash
# Set up (tools/setup.sh) and build into build/: the CUDA code too whenever nvcc is present.
# usage: tools/build.sh [ninja targets...]   (default: everything)
set -euo pipefail
cd "$(dirname "$0")/.."
tools/setup.sh
cuda=ON
command -v nvcc >/dev/null 2>&1 || [ -x /usr/local/cuda/bin/nvcc ] || cuda=OFF
export PATH="$PATH:/usr/local/cuda/bin"
cmake -S . -B build -G Ninja -DMARROW_CUDA=$cuda -DMARROW_PYTHON="$PWD/.venv/bin/python" >/dev/null
if [ $# -gt 0 ]; then cmake --build build --target "$@"; else cmake --build build; fi
