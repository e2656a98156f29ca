#!/usr/bin/env bash
# tools/nvcc_guard.sh (the CUDA compiler launcher) passes a kernel whose wgmmas ptxas can pipeline
# and fails the build of one it must serialise. Ends with PASS or FAIL.
# usage: tests/nvcc_guard/run.sh <nvcc>
set -uo pipefail
here=$(cd "$(dirname "$0")" && pwd)
nvcc=$1
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
compile() { "$here/../../tools/nvcc_guard.sh" "$nvcc" -O3 --generate-code=arch=compute_90a,code=[sm_90a] "$@" \
  -c "$here/serialized_wgmma.cu" -o "$work/out.o" > "$work/log" 2>&1; }
if ! compile; then cat "$work/log"; echo "FAIL: the guard refused a kernel without a hazard"; exit 1; fi
if compile -DHAZARD; then cat "$work/log"; echo "FAIL: the guard let ptxas serialise wgmmas"; exit 1; fi
grep -q "serialised wgmma" "$work/log" || { cat "$work/log"; echo "FAIL: no guard message"; exit 1; }
echo PASS
