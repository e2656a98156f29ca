#!/usr/bin/env bash
# Nsight Compute on the GPU machine for the kernels of `marrow bench --kernels` whose names match a
# regex: speed of light, compute pipes, memory (L1/L2/DRAM), warp stalls, occupancy; one launch per
# kernel name. With a third argument `step`, the kernels of one bench-config training step instead
# (the optimizer, the elementwise kernels: what the kernel table does not run); launches then counts
# the matching launches to profile (default 4).
# Run there from the repository root after tools/gpu_check.sh has built build-gpu:
#   tools/gpu_ncu.sh <log-dir> <kernel-regex> [launches | step [launches]]
# writes <log-dir>/ncu-<first word of the regex>.log. Ends with PASS or FAIL (FAIL when ncu profiled nothing).
set -uo pipefail
out=$1
regex=$2
launches=${3:-1}
command=(build-gpu/marrow bench --kernels)
if [ "$launches" = step ]; then
  launches=${4:-4}
  command=(build-gpu/marrow bench configs/bench.toml --data.path=.gpu-carry/qwen3 --checkpoint.every=0 --warmup=0 --steps=1
           --output.dir=runs/ncu)
fi
mkdir -p "$out"
log=$out/ncu-$(echo "$regex" | grep -oE '^[A-Za-z0-9_]+').log
cd "$(dirname "$0")/.."
[ -x build-gpu/marrow ] || { echo "build-gpu/marrow is missing: run tools/gpu_check.sh first"; echo FAIL; exit 1; }
ncu --kernel-name "regex:$regex" --launch-count "$launches" \
  --section SpeedOfLight --section ComputeWorkloadAnalysis --section MemoryWorkloadAnalysis --section WarpStateStats \
  --section Occupancy --section LaunchStats "${command[@]}" > "$log" 2>&1
grep -E "^  [a-zA-Z].*\(|Duration|Pipe|Compute \(SM\) Throughput|Memory Throughput|DRAM Throughput|L2 Hit Rate|L1/TEX Hit|Achieved Occupancy|Registers Per|Stall|Warp Cycles Per Issued|Issued Warp|Shared Memory Configuration|Bank" "$log" | head -150
if grep -q "Duration" "$log"; then echo PASS; else tail -20 "$log"; echo FAIL; exit 1; fi
