#!/usr/bin/env bash
# The test command: set up, build (CUDA code included when nvcc is present), run every CPU test.
set -euo pipefail
cd "$(dirname "$0")/.."
tools/build.sh
ctest --test-dir build --output-on-failure -j "$(nproc)"
