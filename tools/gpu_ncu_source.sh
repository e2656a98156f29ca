#!/usr/bin/env bash
# Nsight Compute's full set, with the per-instruction (SASS) source view, for the first launch of a
# kernel in one bench-config training step: where an elementwise kernel's time goes (instruction
# mix, stalls by instruction) before predicting a change to it. Run on the GPU machine from the
# repository root after build-gpu is built (gpu_attention.sh quick builds it), directly or as a
# gpu_batch.sh part:
#   tools/gpu_ncu_source.sh <log-dir> <kernel-regex without spaces> [launches to skip first]
#   tools/gpu_batch.sh $OUT "gpu_attention.sh quick" "gpu_ncu_source.sh rmsnorm_rope_forward"
#   tools/gpu_batch.sh $OUT "gpu_attention.sh build" "gpu_ncu_source.sh adamw_step_kernel 3"  (layer 0's experts)
# writes <log-dir>/details.log (every section) and <log-dir>/sass.csv (per-instruction counters), and
# in the summary where the warps wait (tools/ncu_stalls.py: by reason, opcode and runs of 50 lines).
# Ends with PASS or FAIL (FAIL when ncu profiled nothing).
set -uo pipefail
out=$1
regex=$2
skip=${3:-0}
cd "$(dirname "$0")/.."
mkdir -p "$out"
[ -x build-gpu/marrow ] || { echo "build-gpu/marrow is missing: run a build first (gpu_attention.sh quick)" | tee "$out/summary.log"; echo FAIL; exit 1; }
ncu --kernel-name "regex:$regex" --launch-skip "$skip" --launch-count 1 --set full --import-source yes -f -o "$out/report" \
  build-gpu/marrow bench configs/bench.toml --data.path=.gpu-carry/qwen3 --checkpoint.every=0 --warmup=0 --steps=1 \
  --output.dir=runs/ncu-source > "$out/profile.log" 2>&1
ncu --import "$out/report.ncu-rep" --page details > "$out/details.log" 2>&1
ncu --import "$out/report.ncu-rep" --page source --csv --print-source sass > "$out/sass.csv" 2>&1
rm -f "$out/report.ncu-rep"
{
  grep -E "Duration|Executed Instructions|Issue Slots Busy|Memory Throughput|DRAM Throughput|Achieved Occupancy|Registers Per|Warp Cycles Per Issued|Theoretical Occupancy|Block Limit" "$out/details.log" | head -30
  echo "sass.csv: $(wc -l < "$out/sass.csv") lines"
  python3 tools/ncu_stalls.py "$out/sass.csv" --runs 50
} | tee "$out/summary.log"
if grep -q "Duration" "$out/details.log"; then echo PASS; else tail -20 "$out/profile.log"; echo FAIL; exit 1; fi
