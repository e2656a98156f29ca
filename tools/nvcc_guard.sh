#!/usr/bin/env bash
# The CUDA compiler launcher (CMakeLists.txt): runs the nvcc command it is given and fails the build
# when ptxas reports a kernel's wgmmas serialised (C7515, C7520: "wgmma.mma_async instructions are
# serialized"). ptxas prints that only as "info" and still
# emits code, which then waits for every wgmma to finish before issuing the next: the own attention
# forward once ran at half speed that way unnoticed (docs/performance.md, "Attention").
set -uo pipefail
log=$(mktemp)
trap 'rm -f "$log"' EXIT
"$@" 2>"$log"
status=$?
cat "$log" >&2
if [ $status -eq 0 ] && grep -q "wgmma.mma_async instructions are serialized" "$log"; then
  echo "error: ptxas serialised wgmma instructions (see above): keep every wgmma's accumulator and A-fragment registers fenced until its wait (ops/wgmma.cuh fence_registers)" >&2
  exit 1
fi
exit $status
