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
# CP_CONFIG names another bench config (e.g. configs/bench-qwen3-5-moe-h100.toml: Qwen3.5's DeltaNet state
# passed along the sequence chain over NCCL) and CP_SEQ the check's sequence (default 8192); CP_TINY the
# dry run's config (default configs/tiny-moe.toml).
# DRY_RUN=1 runs the parts on this machine's CPU with the tiny model (tools/gpu_common.sh), sequences of
# 256 for 8,192 and 512 for 65,536, the fit part against 4 GiB of GPU memory and up to 1,024 tokens:
# the script's own test (tests/python/test_tools.py). Ends with PASS or FAIL.
set -uo pipefail
out=${1:-$OUT}
what=${2:-all}
source "$(dirname "$0")/gpu_common.sh"

if [ "$dry" = 1 ]; then
  bench=("${CP_TINY:-configs/tiny-moe.toml}" --data.path="$corpus" --train.device=cpu --train.micro_batch=1 --eval.every=0 --checkpoint.every=0
         --parallel.timeout_s=300)
  short_seq=256 long_seq=512 long_steps=2 fit_gpu=(--train.device=cuda --gpu-memory 4) fit_most=1024
else
  bench=("${CP_CONFIG:-configs/bench.toml}" --data.path="$corpus" --checkpoint.every=0 --parallel.timeout_s=300)
  short_seq=${CP_SEQ:-8192} long_seq=65536 long_steps=17 fit_gpu=() fit_most=$((1 << 30))
fi
show() { grep -E "^mesh|^memory|^estimated|^bench:|error" "$1" | tail -8; }
# The largest train.seq_len marrow estimate proposes for `args`, rounded down to a multiple of 1024.
proposed() { $marrow estimate "$@" "${fit_gpu[@]}" | sed -n 's/^largest train.seq_len that fits at micro_batch 1: //p' \
  | awk -v most=$fit_most '{s = int($1 / 1024) * 1024; print (s < most ? s : most)}'; }

if [ "$what" = check ] || [ "$what" = all ]; then
  if [ "$dry" = 0 ]; then
    step "marrow check --only attention (the causal op, ring attention's blocks and merge)"
    timeout 400 $marrow check --only attention > "$out/check-attention.log" 2>&1
    grep -E "checks,|FAIL" "$out/check-attention.log" | tail -5
    tail -1 "$out/check-attention.log" | grep -q '^PASS$' || fail "marrow check --only attention"

    step "mpirun -np 2 marrow check --only ring_attention (the K/V and dK/dV hops over NCCL)"
    timeout 300 "${mpi[@]}" $marrow check --only ring_attention > "$out/check-ring.log" 2>&1
    grep -E "checks,|FAIL" "$out/check-ring.log" | tail -5
    tail -1 "$out/check-ring.log" | grep -q '^PASS$' || fail "ring_attention check on 2 GPUs"
  fi

  step "CP = 2 against one GPU: the bench config at sequence $short_seq, 6 steps"
  short=("${bench[@]}" --train.seq_len=$short_seq --warmup=0 --steps=6)
  timeout 400 $marrow bench "${short[@]}" --output.dir=$runs/cp-one > "$out/cp-one.log" 2>&1 || fail "one GPU at $short_seq"
  timeout 400 "${mpi[@]}" $marrow bench "${short[@]}" --parallel.cp=2 --output.dir=$runs/cp-two > "$out/cp-two.log" 2>&1 \
    || fail "CP = 2 at $short_seq"
  $python tools/compare_runs.py --within 0.02 $runs/cp-one/bench/metrics.jsonl $runs/cp-two/bench/metrics.jsonl 2>&1 \
    | tee "$out/cp-losses.log" | tail -4
  [ "${PIPESTATUS[0]}" -eq 0 ] || fail "CP = 2 losses against one GPU"
fi

# One sequence per step: the corpus of tools/gpu_prepare.sh holds 31 sequences of 65,536 tokens.
long=("${bench[@]}" --train.seq_len=$long_seq --parallel.cp=2 --train.global_batch=1)
if [ "$what" = long ] || [ "$what" = all ]; then
  step "the bench config at sequence $long_seq with CP = 2, $((3 + long_steps)) steps"
  $marrow estimate "${long[@]}" --world=2 > "$out/cp2-$long_seq-estimate.log" 2>&1 || fail "estimate at $long_seq"
  grep -E "^micro-batch|^activations|ring attention|trainer's peak|fits" "$out/cp2-$long_seq-estimate.log"
  timeout 580 "${mpi[@]}" $marrow bench "${long[@]}" --warmup=3 --steps=$long_steps --output.dir=$runs/cp2-$long_seq \
    > "$out/cp2-$long_seq.log" 2>&1 || fail "CP = 2 at $long_seq"
  show "$out/cp2-$long_seq.log"
  if [ "$dry" = 0 ]; then
    step "kernel trace of 2 CP = 2 steps at $long_seq on rank 0 (SendRecv: the ring)"
    timeout 580 "${mpi[@]}" $marrow bench "${long[@]}" --warmup=2 --steps=2 --profile-steps=3:4 --output.dir=$runs/cp2-profile \
      > "$out/cp2-profile.log" 2>&1 || fail "CP = 2 trace"
    sed -n '/communication kernels/,$p' "$out/cp2-profile.log" | head -12
    grep -q "SendRecv" "$out/cp2-profile.log" || fail "the trace shows no SendRecv kernel (the ring)"
  fi
fi

if [ "$what" = fit ] || [ "$what" = all ]; then
  for cp in 1 2; do
    step "the largest sequence that fits two GPUs with CP = $cp"
    gb=$(( 2 / cp ))  # one sequence per data-parallel rank
    seq=$(proposed "${bench[@]}" --parallel.cp=$cp --train.global_batch=$gb --world=2)
    echo "marrow estimate proposes $seq" | tee -a "$out/summary.log"
    [ -n "$seq" ] && [ "$seq" -gt 0 ] || { fail "no proposal for CP = $cp"; continue; }
    for try in "$seq" $(( seq * 9 / 10 / 1024 * 1024 )); do
      if timeout 580 "${mpi[@]}" $marrow bench "${bench[@]}" --parallel.cp=$cp --train.seq_len=$try --train.global_batch=$gb \
          --warmup=1 --steps=1 \
          --output.dir=$runs/cp$cp-largest > "$out/cp$cp-largest-$try.log" 2>&1; then
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
