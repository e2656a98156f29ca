#!/usr/bin/env bash
# The smallest GPU-machine run: build marrow with CUDA there and show that it starts.
# usage (on the GPU machine, repository root, .gpu-carry carried): tools/gpu_smoke.sh
set -uo pipefail
cd "$(dirname "$0")/.."
export PKG_CONFIG_PATH=$PWD/.gpu-carry/libs/lib/pkgconfig
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
if cmake -S . -B build-gpu -G Ninja -DMARROW_CUDA=ON -DMARROW_PYTHON=python3 >/dev/null && ninja -C build-gpu marrow >/dev/null &&
   build-gpu/marrow --help; then
  echo PASS
else
  echo FAIL
  exit 1
fi
