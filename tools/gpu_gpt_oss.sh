#!/usr/bin/env bash
# GPT-OSS on one H200: its attention variant (sinks, sliding windows) on cuDNN's kernels and the own
# ones, and the bench config configs/bench-gpt-oss.toml (gpt-oss-20b's layer shape, 6 layers). Run on
# the GPU machine from the repository root after tools/gpu_prepare.sh here (device tool, carry
# [".gpu-carry"]), directly or as a tools/gpu_batch.sh part:
#   tools/gpu_gpt_oss.sh <log-dir> [check|bench|all]
# check: marrow check --only attention (the variant's rows on both kernels, same bits twice, cuDNN's
#        chunked backward with a window; the plain op at head_dim 64 and S 4096 on every setting)
#        --only model (tiny GPT-OSS against the CPU) and --only elementwise (the bias and sinks rows)
# bench: the GPT-OSS bench config (3 + 27 steps) twice with the default kernels (the same losses bit
#        for bit), then once on the own attention kernels (train.attention_kernels=own) for the
#        comparison; tokens/s, MFU, peak against the estimate, the stage split
# Ends with PASS or FAIL; logs in <log-dir>.
set -uo pipefail
out=${1:-$OUT}
what=${2:-all}
source "$(dirname "$0")/gpu_common.sh"
bench=("$marrow" bench configs/bench-gpt-oss.toml --data.path="$corpus" --checkpoint.every=0)

if [ "$what" = check ] || [ "$what" = all ]; then
  for group in attention model elementwise; do
    step "marrow check --only $group"
    timeout 420 "$marrow" check --only $group > "$out/check-$group.log" 2>&1
    grep -E "FAIL|checks,|error" "$out/check-$group.log" | head -30 | tee -a "$out/summary.log"
    grep -cE "variant" "$out/check-$group.log" | sed 's/^/variant rows: /' >> "$out/summary.log"
    grep -q '^PASS$' "$out/check-$group.log" || fail "marrow check --only $group"
  done
fi

if [ "$what" = bench ] || [ "$what" = all ]; then
  runs_done=()
  for run in default-1 default-2 own; do
    args=()
    [ "$run" = own ] && args=(--train.attention_kernels=own)
    step "GPT-OSS bench config, 3 warm-up + 27 measured steps ($run)"
    timeout 300 "${bench[@]}" --warmup=3 --steps=27 "${args[@]}" --output.dir=runs/gpt-oss-$run > "$out/bench-$run.log" 2>&1 \
      || fail "GPT-OSS bench ($run)"
    grep -E "^estimated peak|error" "$out/bench-$run.log" | head -3 | tee -a "$out/summary.log"
    sed -n '/^bench:/,$p' "$out/bench-$run.log" | head -14 | tee -a "$out/summary.log"
    [ "$run" = own ] || runs_done+=(runs/gpt-oss-$run)
  done
  same_losses "${runs_done[@]}" | tee -a "$out/summary.log"
  [ "${PIPESTATUS[0]}" -eq 0 ] || fail "the default runs' losses differ"
  same_losses runs/gpt-oss-default-1 runs/gpt-oss-own | tee -a "$out/summary.log"  # expected to differ in the last bits
fi

[ $status -eq 0 ] && echo PASS || echo FAIL
exit $status
