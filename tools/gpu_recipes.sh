#!/usr/bin/env bash
# Issue #51's training recipes on one GPU. Run on the GPU machine from the repository root after
# tools/gpu_prepare.sh here (device tool, carry [".gpu-carry"]; or through tools/gpu_from_head.sh):
#   tools/gpu_recipes.sh <log-dir> [check|bench|all]
# check: marrow check --only elementwise and --only attention (Muon's momentum, Newton-Schulz and
#        update rows, the router's load-balance and expert-bias rows, the document-mask attention rows)
# bench: configs/bench-h100.toml (3 warm-up + 12 measured steps) with AdamW (the default), Muon,
#        train.load_balance = global_batch, the own attention kernels unpacked and with data.document_mask
#        (packed documents run on those only); then AdamW and Muon with 8x the global batch (32 sequences
#        of 4,096 a step, two passes over the carried corpus: Muon's cost is per step, not per token)
# Ends with PASS or FAIL; logs in <log-dir>.
set -uo pipefail
out=${1:-$OUT}
what=${2:-all}
source "$(dirname "$0")/gpu_common.sh"
bench=(build-gpu/marrow bench configs/bench-h100.toml --data.path=.gpu-carry/qwen3 --checkpoint.every=0)

if [ "$what" = check ] || [ "$what" = all ]; then
  for group in elementwise attention; do
    step "marrow check --only $group"
    timeout 300 build-gpu/marrow check --only $group > "$out/check-$group.log" 2>&1
    grep -E "FAIL|checks,|error" "$out/check-$group.log" | head -20 | tee -a "$out/summary.log"
    grep -iE "muon|newton|expert_bias|load_balance|document" "$out/check-$group.log" | head -40 >> "$out/summary.log"
    grep -q '^PASS$' "$out/check-$group.log" || fail "marrow check --only $group"
  done
fi

if [ "$what" = bench ] || [ "$what" = all ]; then
  for run in "adamw:" "muon:--optimizer.kind=muon" "global-batch:--train.load_balance=global_batch" \
             "own:--train.attention_kernels=own" "document-mask:--train.attention_kernels=own --data.document_mask=true" \
             "adamw-x8:--train.global_batch=32 --data.max_epochs=2" \
             "muon-x8:--optimizer.kind=muon --train.global_batch=32 --data.max_epochs=2"; do
    name=${run%%:*} args=${run#*:}
    step "bench-h100, $name: 3 warm-up + 12 measured steps"
    # shellcheck disable=SC2086
    timeout 300 "${bench[@]}" --warmup=3 --steps=12 $args --output.dir=runs/recipes-$name > "$out/bench-$name.log" 2>&1 \
      || fail "bench $name"
    grep -E "^estimated peak|error" "$out/bench-$name.log" | head -3 | tee -a "$out/summary.log"
    grep -E "^bench:|optimizer" "$out/bench-$name.log" | tail -4 | tee -a "$out/summary.log"
  done
fi

if [ $status -eq 0 ]; then echo PASS | tee -a "$out/summary.log"; else echo FAIL | tee -a "$out/summary.log"; fi
exit $status
