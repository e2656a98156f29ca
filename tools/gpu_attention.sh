#!/usr/bin/env bash
# Attention on one H200: cuDNN's fused SDPA (ops/attention_cudnn.h) against the own kernels. Run on
# the GPU machine from the repository root after tools/gpu_prepare.sh here (device tool, carry
# [".gpu-carry"]):
#   tools/gpu_attention.sh <log-dir> [check|speed|long|all]
# check: marrow check --only attention (both kernel sets against the CPU reference, bits twice)
# speed: the attention rows of marrow bench --kernels; the bench config (3 + 17 steps) with each
#        kernel set
# long:  one sequence per step at 16,384 and 32,768 tokens (3 + 7 steps), cuDNN kernels
# Ends with PASS or FAIL; logs in <log-dir>.
set -uo pipefail
out=${1:-$OUT}
what=${2:-all}
source "$(dirname "$0")/gpu_common.sh"
bench=(build-gpu/marrow bench configs/bench.toml --data.path=.gpu-carry/qwen3 --checkpoint.every=0)

if [ "$what" = check ] || [ "$what" = all ]; then
  step "marrow check --only attention"
  build-gpu/marrow check --only attention > "$out/check.log" 2>&1
  grep -E "FAIL|checks,|error" "$out/check.log" | head -40
  grep -q '^PASS$' "$out/check.log" || fail "marrow check --only attention"
fi

if [ "$what" = speed ] || [ "$what" = all ]; then
  step "kernel table (attention rows)"
  build-gpu/marrow bench --kernels > "$out/kernels.log" 2>&1 || fail "bench --kernels"
  grep -E "^kernel|^attention" "$out/kernels.log"
  for kernels in cudnn own; do
    step "bench config, attention kernels $kernels: 3 warm-up + 17 measured steps"
    "${bench[@]}" --warmup=3 --steps=17 --train.attention_kernels=$kernels --output.dir=runs/bench-$kernels \
      > "$out/bench-$kernels.log" 2>&1 || fail "bench $kernels"
    grep -E "^memory|error" "$out/bench-$kernels.log" | head -5
    sed -n '/^bench:/,$p' "$out/bench-$kernels.log" | head -30
  done
fi

if [ "$what" = long ] || [ "$what" = all ]; then
  for seq in 16384 32768; do
    step "one sequence of $seq tokens per step, cuDNN attention: 3 warm-up + 7 measured steps"
    "${bench[@]}" --warmup=3 --steps=7 --train.seq_len=$seq --train.global_batch=1 --train.micro_batch=1 \
      --output.dir=runs/long-$seq > "$out/long-$seq.log" 2>&1 || fail "bench at $seq tokens"
    grep -E "^memory|error" "$out/long-$seq.log" | head -5
    sed -n '/^bench:/,$p' "$out/long-$seq.log" | head -12
  done
fi

if [ $status -eq 0 ]; then echo PASS | tee -a "$out/summary.log"; else echo FAIL | tee -a "$out/summary.log"; fi
exit $status
