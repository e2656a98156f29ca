#!/usr/bin/env bash
# Fully sharded data parallelism on the two-GPU machine (device kind nvidia-h200-x2), run there from
# the repository root after tools/gpu_prepare.sh here, with the device tool carrying .gpu-carry:
#   tools/gpu_fsdp.sh <log-dir>
# build -> mpirun -np 2 marrow check --only expert_parallel (the collectives over NCCL, incl. the
# in-place all_gather and accumulating reduce_scatter FSDP uses) -> the bench config (3 warm-up + 17
# measured steps) on one GPU, then DP = 2 with FSDP (default: gathered per stage, gradients
# reduce-scattered per micro-batch), with parallel.keep_gathered, with it and keep_whole_grads, and
# replicated (dp_shard = 1) ->
# DP = 2 losses against one GPU (bf16 tolerance) -> the bench config with 16 layers (does not fit
# one H200) on two GPUs with FSDP, 20 steps, losses falling, and with keep_gathered. Each run prints the memory bill, the
# estimated peak and the measured one. Ends with PASS or FAIL.
set -uo pipefail
out=${1:-$OUT}
source "$(dirname "$0")/gpu_common.sh"

step "mpirun -np 2 marrow check --only expert_parallel (NCCL collectives)"
timeout 300 "${mpi[@]}" build-gpu/marrow check --only expert_parallel > "$out/check.log" 2>&1
grep -E "comm (all_gather|reduce_scatter)|checks," "$out/check.log" | tail -8
tail -1 "$out/check.log" | grep -q '^PASS$' || fail "collectives and expert_parallel check on 2 GPUs"

bench=(configs/bench.toml --data.path=.gpu-carry/qwen3 --warmup=3 --steps=17 --checkpoint.every=0 --parallel.timeout_s=180)
show() { grep -E "^mesh|^memory|^estimated|^bench:|peak|error" "$1" | grep -v "^step" | tail -8; }
run() {  # run <name> <log> <mpirun or ""> args...
  local name=$1 log=$2 launcher=$3
  shift 3
  step "$name"
  if [ -n "$launcher" ]; then timeout 500 "${mpi[@]}" build-gpu/marrow bench "$@" > "$log" 2>&1 || fail "$name"
  else timeout 500 build-gpu/marrow bench "$@" > "$log" 2>&1 || fail "$name"; fi
  show "$log"
}
rm -rf runs/fsdp-*
run "bench config on one GPU" "$out/bench-1gpu.log" "" "${bench[@]}" --output.dir=runs/fsdp-1gpu
run "DP = 2, FSDP (gather per stage, reduce-scatter per micro-batch)" "$out/bench-fsdp.log" mpi "${bench[@]}" --output.dir=runs/fsdp-dp2
sed -n '/^stage (per step)/,$p' "$out/bench-fsdp.log" | tail -9
run "DP = 2, FSDP with parallel.keep_gathered (weights gathered once per step)" "$out/bench-fsdp-weights.log" mpi "${bench[@]}" \
  --parallel.keep_gathered=true --output.dir=runs/fsdp-dp2-weights
run "DP = 2, FSDP with keep_gathered and keep_whole_grads (gradients reduce-scattered once per step)" "$out/bench-fsdp-kept.log" mpi \
  "${bench[@]}" --parallel.keep_gathered=true --parallel.keep_whole_grads=true --output.dir=runs/fsdp-dp2-kept
sed -n '/^stage (per step)/,$p' "$out/bench-fsdp-kept.log" | tail -9
run "DP = 2, replicated (parallel.dp_shard = 1)" "$out/bench-ddp.log" mpi "${bench[@]}" --parallel.dp_shard=1 --output.dir=runs/fsdp-ddp

step "DP = 2 (FSDP) losses against one GPU (bf16 tolerance, 2%)"
python3 tools/compare_runs.py --within 0.02 runs/fsdp-1gpu/bench/metrics.jsonl runs/fsdp-dp2/bench/metrics.jsonl 2>&1 \
  | tee "$out/losses.log" | tail -3
[ "${PIPESTATUS[0]}" -eq 0 ] || fail "DP = 2 losses"

run "16 layers (does not fit one H200) on two GPUs, FSDP, 20 steps" "$out/bench-16layers.log" mpi "${bench[@]}" \
  --model.config=configs/bench-moe-16.json --output.dir=runs/fsdp-16
python3 - "$out/bench-16layers.log" runs/fsdp-16/bench/metrics.jsonl <<'PY' | tee -a "$out/summary.log" || fail "16 layers: losses do not fall"
import json, sys
losses = [json.loads(l)["loss"] for l in open(sys.argv[2])]
first, last = sum(losses[:3]) / 3, sum(losses[-3:]) / 3
print(f"16 layers: {len(losses)} steps, loss {losses[0]:.3f} -> {losses[-1]:.3f} (mean of first 3 {first:.3f}, last 3 {last:.3f})")
sys.exit(0 if len(losses) == 20 and last < first else 1)
PY
run "16 layers on two GPUs, FSDP with parallel.keep_gathered" "$out/bench-16layers-weights.log" mpi "${bench[@]}" \
  --model.config=configs/bench-moe-16.json --parallel.keep_gathered=true --output.dir=runs/fsdp-16-weights
sed -n '/^stage (per step)/,$p' "$out/bench-16layers-weights.log" | tail -9

if [ $status -eq 0 ]; then echo PASS | tee -a "$out/summary.log"; else echo FAIL | tee -a "$out/summary.log"; fi
exit $status
