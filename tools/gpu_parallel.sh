#!/usr/bin/env bash
# Expert parallelism on the two-GPU machine (device kind nvidia-h200-x2), run there from the
# repository root after tools/gpu_prepare.sh here, with the device tool carrying .gpu-carry:
#   tools/gpu_parallel.sh <log-dir>
# build -> marrow check --only elementwise (the dispatch/combine/router kernels, one GPU) ->
# mpirun -np 2 marrow check --only expert_parallel (the all-to-alls over NCCL) -> the bench config on
# one GPU, with EP = 2 and with DP = 2 on two, each with and without overlapped gradient sums (3 warm-up
# + 17 measured steps each; tokens/s per GPU, all-to-all bytes with and without deduplication) -> the two runs' losses within bf16 tolerance -> a kernel
# trace of two EP = 2 steps on rank 0 (NCCL kernels among the top ten). Ends with PASS or FAIL.
set -uo pipefail
out=${1:-$OUT}
source "$(dirname "$0")/gpu_common.sh"

step "marrow check --only elementwise (one GPU)"
timeout 600 build-gpu/marrow check --only elementwise > "$out/check.log" 2>&1
grep -E "FAIL|checks," "$out/check.log" | head -40
grep -q '^PASS$' "$out/check.log" || fail "marrow check --only elementwise"

step "mpirun -np 2 marrow check --only expert_parallel (NCCL)"
timeout 300 "${mpi[@]}" build-gpu/marrow check --only expert_parallel >> "$out/check.log" 2>&1
grep -E "expert_parallel|checks," "$out/check.log" | tail -12
tail -1 "$out/check.log" | grep -q '^PASS$' || fail "expert_parallel check on 2 GPUs"

bench=(configs/bench.toml --data.path=.gpu-carry/qwen3 --warmup=3 --steps=17 --checkpoint.every=0)
step "bench config on one GPU"
rm -rf runs/bench-1gpu runs/bench-ep2
timeout 400 build-gpu/marrow bench "${bench[@]}" --output.dir=runs/bench-1gpu > "$out/bench.log" 2>&1 || fail "one-GPU bench"
grep -E "^model|^memory|^bench:|error" "$out/bench.log"

step "bench config with EP = 2 on two GPUs"
timeout 400 "${mpi[@]}" build-gpu/marrow bench "${bench[@]}" --parallel.ep=2 --parallel.timeout_s=120 --output.dir=runs/bench-ep2 >> "$out/bench.log" 2>&1 \
  || fail "EP = 2 bench"
sed -n '/parallel.ep=2\|^mesh/,$p' "$out/bench.log" | grep -E "^mesh|^memory|^bench:|^expert|error" | tail -7
sed -n '/^stage (per step)/,$p' "$out/bench.log" | tail -9

step "EP = 2 with the gradient sums after the backward (parallel.overlap_grad_reduce = false)"
timeout 400 "${mpi[@]}" build-gpu/marrow bench "${bench[@]}" --parallel.ep=2 --parallel.timeout_s=120 --parallel.overlap_grad_reduce=false \
  --output.dir=runs/bench-ep2-serial > "$out/bench-serial.log" 2>&1 || fail "EP = 2 bench, serial gradient sums"
grep -E "^bench:|error" "$out/bench-serial.log" | tail -2
sed -n '/^stage (per step)/,$p' "$out/bench-serial.log" | tail -9

for overlap in true false; do
  step "bench config with DP = 2 on two GPUs (every GPU holds the whole model), overlap_grad_reduce = $overlap"
  timeout 400 "${mpi[@]}" build-gpu/marrow bench "${bench[@]}" --parallel.timeout_s=120 --parallel.overlap_grad_reduce=$overlap \
    --output.dir=runs/bench-dp2-$overlap >> "$out/bench-serial.log" 2>&1 || fail "DP = 2 bench"
  grep -E "^bench:|error" "$out/bench-serial.log" | tail -1
done

step "EP = 2 losses against one GPU (bf16 tolerance, 2%)"
python3 tools/compare_runs.py --within 0.02 runs/bench-1gpu/bench/metrics.jsonl runs/bench-ep2/bench/metrics.jsonl 2>&1 \
  | tee "$out/losses.log" | tail -4
[ "${PIPESTATUS[0]}" -eq 0 ] || fail "EP = 2 losses"

step "kernel trace of 2 EP = 2 steps on rank 0"
timeout 400 "${mpi[@]}" build-gpu/marrow bench configs/bench.toml --data.path=.gpu-carry/qwen3 --warmup=2 --steps=2 --checkpoint.every=0 \
  --parallel.ep=2 --output.dir=runs/profile-ep2 --profile-steps=3:4 > "$out/profile.log" 2>&1 || fail "EP = 2 trace"
sed -n '/kernel/,$p' "$out/profile.log" | head -16

if [ $status -eq 0 ]; then echo PASS | tee -a "$out/summary.log"; else echo FAIL | tee -a "$out/summary.log"; fi
exit $status
