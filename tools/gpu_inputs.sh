#!/usr/bin/env bash
# The experts' inputs kept for the backward (train.expert_inputs) and the projections' input
# gradients summed by their GEMMs, on one H200. Run on the GPU machine from the repository root after
# tools/gpu_prepare.sh here (device tool, carry [".gpu-carry"]), directly or as a tools/gpu_batch.sh part:
#   tools/gpu_inputs.sh <log-dir> [check|bench|long|all]
# check:  marrow check --only gemm (linear bwd_input accumulating among its rows) and --only model
# bench:  the bench config (3 + 27 steps) INPUTS_ROUNDS times (default 2): every round's losses the same
#         bits; the first five printed at full precision and compared with REF_LOSSES (comma-separated)
#         when given
# long:   one sequence of 16,384 a step, fp32 moments (3 + 27 steps), train.expert_inputs = gather then
#         auto (which keeps them there), INPUTS_ROUNDS rounds alternating on one machine: tokens/s, peak
#         against the estimate, and the same losses both ways; then 32,768 with auto (3 + 7 steps)
# Ends with PASS or FAIL; logs in <log-dir>.
set -uo pipefail
out=${1:-$OUT}
what=${2:-all}
source "$(dirname "$0")/gpu_common.sh"
bench=(build-gpu/marrow bench configs/bench.toml --data.path=.gpu-carry/qwen3 --checkpoint.every=0)
rounds=${INPUTS_ROUNDS:-2}

# The first five losses of a run at full precision; with REF_LOSSES, whether they are those bits.
first_losses() {
  python3 - "$1" "${REF_LOSSES:-}" <<'PY'
import json, sys
losses = [json.loads(x)["loss"] for x in open(sys.argv[1])][:5]
print("first five losses:", json.dumps(losses))
ref = [float(v) for v in sys.argv[2].split(",") if v]
if ref:
    print(f"the reference's bits: {losses[:len(ref)] == ref}")
    sys.exit(0 if losses[:len(ref)] == ref else 1)
PY
}

if [ "$what" = check ] || [ "$what" = all ]; then
  for group in gemm model; do
    step "marrow check --only $group"
    timeout 300 build-gpu/marrow check --only $group > "$out/check-$group.log" 2>&1
    grep -E "FAIL|checks,|error" "$out/check-$group.log" | head -20 | tee -a "$out/summary.log"
    grep -E "bwd_input x2" "$out/check-$group.log" | head -8 >> "$out/summary.log"
    grep -q '^PASS$' "$out/check-$group.log" || fail "marrow check --only $group"
  done
fi

if [ "$what" = bench ] || [ "$what" = all ]; then
  dirs=()
  for round in $(seq "$rounds"); do
    step "bench config, 3 warm-up + 27 measured steps (round $round)"
    timeout 240 "${bench[@]}" --warmup=3 --steps=27 --output.dir=runs/inputs-bench-$round > "$out/bench-$round.log" 2>&1 \
      || fail "bench config, round $round"
    grep -E "^estimated peak|error" "$out/bench-$round.log" | head -3 | tee -a "$out/summary.log"
    sed -n '/^bench:/,$p' "$out/bench-$round.log" | head -12 | tee -a "$out/summary.log"
    dirs+=(runs/inputs-bench-$round)
  done
  same_losses "${dirs[@]}" | tee -a "$out/summary.log"
  [ "${PIPESTATUS[0]}" -eq 0 ] || fail "the bench rounds' losses differ"
  first_losses runs/inputs-bench-1/bench/metrics.jsonl | tee -a "$out/summary.log"
  [ "${PIPESTATUS[0]}" -eq 0 ] || fail "the first losses are not REF_LOSSES"
fi

if [ "$what" = long ] || [ "$what" = all ]; then
  long16=(--train.seq_len=16384 --train.global_batch=1 --train.micro_batch=1 --optimizer.moments=fp32)
  dirs=()
  for round in $(seq "$rounds"); do
    for inputs in gather auto; do
      step "one sequence of 16,384, fp32 moments, train.expert_inputs = $inputs (round $round): 3 + 27 steps"
      timeout 240 "${bench[@]}" --warmup=3 --steps=27 "${long16[@]}" --train.expert_inputs=$inputs \
        --output.dir=runs/inputs-16384-$inputs-$round > "$out/long-16384-$inputs-$round.log" 2>&1 || fail "16,384 with $inputs"
      grep -E "^estimated peak|error" "$out/long-16384-$inputs-$round.log" | head -3 | tee -a "$out/summary.log"
      sed -n '/^bench:/,$p' "$out/long-16384-$inputs-$round.log" | head -12 | tee -a "$out/summary.log"
      dirs+=(runs/inputs-16384-$inputs-$round)
    done
  done
  same_losses "${dirs[@]}" | tee -a "$out/summary.log"
  [ "${PIPESTATUS[0]}" -eq 0 ] || fail "16,384's runs' losses differ between the two ways or the rounds"
  step "one sequence of 32,768, fp32 moments, train.expert_inputs = auto: 3 + 7 steps"
  timeout 240 "${bench[@]}" --warmup=3 --steps=7 --train.seq_len=32768 --train.global_batch=1 --train.micro_batch=1 \
    --output.dir=runs/inputs-32768 > "$out/long-32768.log" 2>&1 || fail "32,768"
  grep -E "^estimated peak|error" "$out/long-32768.log" | head -3 | tee -a "$out/summary.log"
  sed -n '/^bench:/,$p' "$out/long-32768.log" | head -12 | tee -a "$out/summary.log"
fi

[ $status -eq 0 ] && echo PASS || echo FAIL
exit $status
