#!/usr/bin/env bash
# Standalone GPU probes on one GPU (device tool, carry [".gpu-carry"], after tools/gpu_prepare.sh):
#   tools/gpu_probe.sh <log-dir> launch
# launch: tools/launch_probe (what programmatic dependent launch and CUDA graphs save between
#         dependent kernels, each way's result checked bit for bit against plain launches)
# Ends with PASS or FAIL; logs in <log-dir>.
set -uo pipefail
out=${1:-$OUT}
what=${2:-launch}
source "$(dirname "$0")/gpu_common.sh"

if [ "$what" = launch ]; then
  step "launch probe: dependent kernels plain, with PDL, as graphs"
  if ninja -C build-gpu launch_probe > "$out/probe-build.log" 2>&1 && build-gpu/launch_probe > "$out/launch.log" 2>&1; then
    cat "$out/launch.log" | tee -a "$out/summary.log"
  else
    tail -20 "$out/probe-build.log" "$out/launch.log" 2>/dev/null
    fail "launch probe"
  fi
fi

if [ $status -eq 0 ]; then echo PASS | tee -a "$out/summary.log"; else echo FAIL | tee -a "$out/summary.log"; fi
exit $status
