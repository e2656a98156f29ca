#!/usr/bin/env bash
# Context parallelism (zigzag ring attention, parallel/ring_attention.h) on the two-GPU machine (device
# kind nvidia-h200-x2), run there from the repository root after tools/gpu_prepare.sh here, with the
# device tool carrying .gpu-carry:
#   tools/gpu_context.sh <log-dir> [check|long|fit|all]
# (each part fits the device tool's 10 minutes a command; all runs them one after the other)
# check: build -> marrow check --only attention (the causal op, ring attention's blocks and merge
#     against the CPU) -> mpirun -np 2 marrow check --only ring_attention (ring attention over NCCL
#     against the CPU's causal op on the whole sequence) -> CP = 2 against one GPU on the bench config at
#     sequence 8192, 6 steps: losses within bf16 tolerance (2%).
# long: the bench config at sequence 65,536 with CP = 2, 20 steps: tokens/s per GPU, peak per GPU and
#     marrow estimate's figure for it; then a kernel trace of 2 such steps on rank 0: the communication
#     table's SendRecv row is the ring (K/V and dK/dV hops), its "hidden" column the share of the ring's
#     time that ran under compute (the attention blocks).
# fit: the largest sequence that fits two GPUs with CP = 1 (DP = 2: the same shards of the state, a
#     whole sequence per GPU) and with CP = 2: marrow estimate proposes (rounded down to a multiple of
#     1024), a 2-step bench tries it, and 90% of it when it does not fit.
# Ends with PASS or FAIL.
set -uo pipefail
out=${1:-$OUT}
what=${2:-all}
source "$(dirname "$0")/gpu_common.sh"

bench=(configs/bench.toml --data.path=.gpu-carry/qwen3 --checkpoint.every=0 --parallel.timeout_s=300)
show() { grep -E "^mesh|^memory|^estimated|^bench:|error" "$1" | tail -8; }
# The largest train.seq_len marrow estimate proposes for `args`, rounded down to a multiple of 1024.
proposed() { build-gpu/marrow estimate "$@" | sed -n 's/^largest train.seq_len that fits at micro_batch 1: //p' | awk '{print int($1 / 1024) * 1024}'; }

if [ "$what" = check ] || [ "$what" = all ]; then
  step "marrow check --only attention (the causal op, ring attention's blocks and merge)"
  timeout 400 build-gpu/marrow check --only attention > "$out/check-attention.log" 2>&1
  grep -E "checks,|FAIL" "$out/check-attention.log" | tail -5
  tail -1 "$out/check-attention.log" | grep -q '^PASS$' || fail "marrow check --only attention"

  step "mpirun -np 2 marrow check --only ring_attention (the K/V and dK/dV hops over NCCL)"
  timeout 300 "${mpi[@]}" build-gpu/marrow check --only ring_attention > "$out/check-ring.log" 2>&1
  grep -E "checks,|FAIL" "$out/check-ring.log" | tail -5
  tail -1 "$out/check-ring.log" | grep -q '^PASS$' || fail "ring_attention check on 2 GPUs"

  step "CP = 2 against one GPU: the bench config at sequence 8192, 6 steps"
  short=("${bench[@]}" --train.seq_len=8192 --warmup=0 --steps=6)
  timeout 400 build-gpu/marrow bench "${short[@]}" --output.dir=runs/cp-one > "$out/cp-one.log" 2>&1 || fail "one GPU at 8192"
  timeout 400 "${mpi[@]}" build-gpu/marrow bench "${short[@]}" --parallel.cp=2 --output.dir=runs/cp-two > "$out/cp-two.log" 2>&1 \
    || fail "CP = 2 at 8192"
  python3 tools/compare_runs.py --within 0.02 runs/cp-one/bench/metrics.jsonl runs/cp-two/bench/metrics.jsonl 2>&1 \
    | tee "$out/cp-losses.log" | tail -4
  [ "${PIPESTATUS[0]}" -eq 0 ] || fail "CP = 2 losses against one GPU"
fi

# One sequence per step: the corpus of tools/gpu_prepare.sh holds 31 sequences of 65,536 tokens.
long=("${bench[@]}" --train.seq_len=65536 --parallel.cp=2 --train.global_batch=1)
if [ "$what" = long ] || [ "$what" = all ]; then
  step "the bench config at sequence 65,536 with CP = 2, 20 steps"
  build-gpu/marrow estimate "${long[@]}" --world=2 > "$out/cp2-65536-estimate.log" 2>&1 || fail "estimate at 65,536"
  grep -E "^micro-batch|^activations|ring attention|trainer's peak|fits" "$out/cp2-65536-estimate.log"
  timeout 580 "${mpi[@]}" build-gpu/marrow bench "${long[@]}" --warmup=3 --steps=17 --output.dir=runs/cp2-65536 > "$out/cp2-65536.log" 2>&1 \
    || fail "CP = 2 at 65,536"
  show "$out/cp2-65536.log"
  step "kernel trace of 2 CP = 2 steps at 65,536 on rank 0 (SendRecv: the ring)"
  timeout 580 "${mpi[@]}" build-gpu/marrow bench "${long[@]}" --warmup=2 --steps=2 --profile-steps=3:4 --output.dir=runs/cp2-profile \
    > "$out/cp2-profile.log" 2>&1 || fail "CP = 2 trace"
  sed -n '/communication kernels/,$p' "$out/cp2-profile.log" | head -12
  grep -q "SendRecv" "$out/cp2-profile.log" || fail "the trace shows no SendRecv kernel (the ring)"
fi

if [ "$what" = fit ] || [ "$what" = all ]; then
  for cp in 1 2; do
    step "the largest sequence that fits two GPUs with CP = $cp"
    gb=$(( 2 / cp ))  # one sequence per data-parallel rank
    seq=$(proposed "${bench[@]}" --parallel.cp=$cp --train.global_batch=$gb --world=2)
    echo "marrow estimate proposes $seq" | tee -a "$out/summary.log"
    [ -n "$seq" ] && [ "$seq" -gt 0 ] || { fail "no proposal for CP = $cp"; continue; }
    for try in "$seq" $(( seq * 9 / 10 / 1024 * 1024 )); do
      if timeout 580 "${mpi[@]}" build-gpu/marrow bench "${bench[@]}" --parallel.cp=$cp --train.seq_len=$try --train.global_batch=$gb \
          --warmup=1 --steps=1 \
          --output.dir=runs/cp$cp-largest > "$out/cp$cp-largest-$try.log" 2>&1; then
        echo "CP = $cp: sequence $try fits" | tee -a "$out/summary.log"
        show "$out/cp$cp-largest-$try.log"
        break
      fi
      echo "CP = $cp: sequence $try does not fit: $(grep -m1 -E 'error' "$out/cp$cp-largest-$try.log")" | tee -a "$out/summary.log"
      [ "$try" = "$seq" ] || fail "CP = $cp: neither the proposed sequence nor 90% of it fits"
    done
  done
fi

if [ $status -eq 0 ]; then echo PASS | tee -a "$out/summary.log"; else echo FAIL | tee -a "$out/summary.log"; fi
exit $status
