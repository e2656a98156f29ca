#!/usr/bin/env bash
# The test command: set up, build (CUDA code included when nvcc is present), run every CPU test.
set -euo pipefail
cd "$(dirname "$0")/.."
tools/setup.sh
cuda=ON
command -v nvcc >/dev/null 2>&1 || [ -x /usr/local/cuda/bin/nvcc ] || cuda=OFF
export PATH="$PATH:/usr/local/cuda/bin"
cmake -S . -B build -G Ninja -DMARROW_CUDA=$cuda -DMARROW_PYTHON="$PWD/.venv/bin/python"
cmake --build build
ctest --test-dir build --output-on-failure -j "$(nproc)"
