#!/usr/bin/env bash
# Attention on one H200: cuDNN's fused SDPA (ops/attention_cudnn.h) against the own kernels. Run on
# the GPU machine from the repository root after tools/gpu_prepare.sh here (device tool, carry
# [".gpu-carry"]):
#   tools/gpu_attention.sh <log-dir> [check|speed|long|all|final|memory|checks|quick|only|peaks|measure|kernels|pairs|fp8|plans|hopper|launch|traces|oom]
# check: marrow check --only attention (both kernel sets against the CPU reference, bits twice)
# speed: the attention rows of marrow bench --kernels; the bench config (3 + 17 steps) with each
#        kernel set
# long:  train.bf16_weight_copy=false against the default (losses bit for bit); one sequence per
#        step at 16,384 and 32,768 tokens (3 + 7 steps), cuDNN kernels, with and without the copy
# final: marrow check of the model, the grouped GEMMs and attention; the bench config (3 + 27 steps);
#        16,384 tokens with the defaults and 32,768 without the bf16 weight copy, each with cuDNN's
#        deterministic and non-deterministic attention backward
# memory: marrow check --only model; measured against estimated peaks at 4,096 (4 per step), 16,384 and
#         32,768 tokens (with and without the bf16 weight copy), 3 + 5 steps each
# checks: marrow check of elementwise ops, the model, the grouped GEMMs and attention; losses of
#         train.bf16_weight_copy=false against the default, bit for bit (4,096 x 4, 2 + 3 steps)
# quick: marrow check of elementwise ops and the model (or the groups in QUICK_CHECKS); the bench config
#        (3 + 27 steps; its first 5 losses against REF_LOSSES when set); a kernel trace of 2 steps
#        (trace-steps-3-4.json.gz)
# only: the check groups of quick (QUICK_CHECKS) and nothing else
# peaks: the bench config's first 5 losses at full precision (against REF_LOSSES when set), the bench
#        config (3 + 27 steps), one sequence of 16,384 (with and without the weight copy) and of 32,768
#        (3 + 5 steps each): tokens/s, peaks against the estimate
# measure: the bench config (3 + 27 steps); one sequence per step at 16,384 and
#          32,768 tokens with and without the bf16 weight copy, and the bench config without it (3 + 5
#          steps): tokens/s and peaks; then the kernel table
# kernels: marrow bench --kernels [KERNEL_GROUP, e.g. attention], the rows matching the regex KERNEL_ROWS
#          (default: every row)
# fp8: marrow check --only fp8, the FP8 and AdamW rows of marrow bench --kernels experts, then the bench
#      config (3 + 27 steps) with train.fp8=false and true on one machine: tokens/s, peaks (against the
#      estimate), and the first losses of each side by side; FP8_LONG="16384 32768" adds one sequence of each
#      length a step (3 + 7 steps) with train.fp8 off and on, FP8_GLOBAL="8" the bench config with that many
#      micro-batches a step
# plans: marrow bench --attention-plans at the bench's 4,096 (and the lengths in PLAN_SEQS): every plan
#        cuDNN offers for the forward and the deterministic backward, timed and compared with the op's
# pairs: the bench config (3 + 27 steps) with train.pair_expert_grads=false, then the default, on one
#        machine: tokens/s and peaks side by side, losses bit for bit
# launch: the bench config (3 + 27 steps, first 5 losses against REF_LOSSES) and one sequence of 16,384 without
#         the weight copy (3 + 5) with train.dependent_launch=false and true on one machine; a trace of 2 steps with
#         it on
# traces: kernel traces of the bench config (2 steps), of one sequence of 16,384 without the weight
#         copy (1 step) and of one of 32,768 with bf16 moments (1 step, after a 3 + 5-step run for its
#         stage split), for the stage attribution of docs/performance.md
# hopper: Marrow's wgmma attention (train.attention_kernels=hopper, hopper_backward): marrow check
#         --only attention (every command under a timeout: a kernel that hangs ends the run; ring
#         attention's blocks on the wgmma kernels among its rows), marrow bench --kernels attention
#         (every kernel set's rows, the hopper backward's chunk sweep with item timelines, the ring's
#         full blocks on the own and the wgmma kernels), then (unless HOPPER_BENCH=0) the bench config (3 + 27 steps) with each of
#         HOPPER_SETS (default: hopper_backward hopper cudnn), on one machine; the first 5 losses of each;
#         with HOPPER_LONG=1 also one sequence of 16,384 without the weight copy (3 + 5 steps) with each set
# oom: a run over the GPU's memory (one sequence of 98,304 tokens, estimate ~150 GiB): the start-up warning with the
#      settings that save memory, then the out-of-memory sentence and exit status 1; then the first of those settings
#      (bf16 moments) trains the same step without a warning
# Ends with PASS or FAIL; logs in <log-dir>.
set -uo pipefail
out=${1:-$OUT}
what=${2:-all}
source "$(dirname "$0")/gpu_common.sh"
bench=(build-gpu/marrow bench configs/bench.toml --data.path=.gpu-carry/qwen3 --checkpoint.every=0)

# Prints a run's first 5 losses and gradient norms at full precision and, with REF_LOSSES='[...]'
# set, fails unless the losses equal it bit for bit.
first_losses() {
  python3 -c "import json, os, sys; m = [json.loads(x) for x in open('$1')][:5]; l = [x['loss'] for x in m]; print('losses', l); \
print('gradient norms', [x['grad_norm'] for x in m]); \
r = os.environ.get('REF_LOSSES'); sys.exit(0 if not r else (print('same bits as the reference') or 0) if json.loads(r) == l else (print('DIFFER from', r) or 1))" \
    | tee -a "$out/summary.log"
  [ "${PIPESTATUS[0]}" -eq 0 ] || fail "losses differ from REF_LOSSES"
}

if [ "$what" = check ] || [ "$what" = all ]; then
  step "marrow check --only attention"
  build-gpu/marrow check --only attention > "$out/check.log" 2>&1
  grep -E "FAIL|checks,|error" "$out/check.log" | head -40
  grep -q '^PASS$' "$out/check.log" || fail "marrow check --only attention"
fi

if [ "$what" = hopper ]; then
  step "marrow check --only attention (with the hopper kernels' rows)"
  timeout ${CHECK_TIMEOUT:-480} build-gpu/marrow check --only attention > "$out/check.log" 2>&1
  grep -E "FAIL|checks,|error" "$out/check.log" | head -40
  grep -E "hopper|wgmma" "$out/check.log" | grep -E "dq|dk|dv|wgmma kernels" | head -80 >> "$out/summary.log"
  if grep -q '^PASS$' "$out/check.log"; then
    step "marrow bench --kernels attention"
    timeout 240 build-gpu/marrow bench --kernels attention > "$out/kernels.log" 2>&1 || fail "bench --kernels attention"
    grep -E "^kernel|^attention|^hopper|^ring" "$out/kernels.log" | tee -a "$out/summary.log"
    for kernels in $([ "${HOPPER_BENCH:-1}" = 0 ] || echo ${HOPPER_SETS:-hopper_backward hopper cudnn}); do
      step "bench config, attention kernels $kernels: 3 warm-up + 27 measured steps"
      timeout 240 "${bench[@]}" --warmup=3 --steps=27 --train.attention_kernels=$kernels --output.dir=runs/bench-$kernels \
        > "$out/bench-$kernels.log" 2>&1 || fail "bench $kernels"
      grep -E "^bench:" "$out/bench-$kernels.log" | tee -a "$out/summary.log"
      # REF_LOSSES are the default kernels' (hopper_backward); the other sets print theirs.
      if [ "$kernels" = hopper_backward ]; then first_losses runs/bench-$kernels/bench/metrics.jsonl
      else REF_LOSSES= first_losses runs/bench-$kernels/bench/metrics.jsonl; fi
    done
    for kernels in $([ "${HOPPER_LONG:-0}" = 0 ] || echo ${HOPPER_SETS:-hopper_backward hopper cudnn}); do
      step "one sequence of 16384 tokens, bf16_weight_copy=false, attention kernels $kernels: 3 warm-up + 5 measured steps"
      timeout 240 "${bench[@]}" --warmup=3 --steps=5 --train.seq_len=16384 --train.global_batch=1 --train.micro_batch=1 \
        --train.master_weights=fp32 --train.bf16_weight_copy=false --train.attention_kernels=$kernels --output.dir=runs/long-$kernels \
        > "$out/long-16384-$kernels.log" 2>&1 || fail "bench 16384 $kernels"
      grep -E "^bench:" "$out/long-16384-$kernels.log" | tee -a "$out/summary.log"
    done
  else
    fail "marrow check --only attention"
  fi
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
  step "train.bf16_weight_copy=false (layers cast from the fp32 master before each use) gives the losses of the default bit for bit"
  for copy in true false; do
    "${bench[@]}" --warmup=2 --steps=3 --train.master_weights=fp32 --train.bf16_weight_copy=$copy --output.dir=runs/copy-$copy > "$out/copy-$copy.log" 2>&1 \
      || fail "bench with bf16_weight_copy=$copy"
  done
  grep -E "^bench:" "$out"/copy-*.log
  python3 -c "import json, sys; l = [[json.loads(x)['loss'] for x in open(f'runs/copy-{c}/bench/metrics.jsonl')] for c in ('true', 'false')]; \
print('losses', l[0]); print('same bits' if l[0] == l[1] else f'DIFFER: {l[1]}'); sys.exit(l[0] != l[1])" || fail "losses differ"
  for run in "16384 true" "16384 false" "32768 true" "32768 false"; do
    set -- $run
    step "one sequence of $1 tokens per step, cuDNN attention, bf16_weight_copy=$2: 3 warm-up + 7 measured steps"
    "${bench[@]}" --warmup=3 --steps=7 --train.seq_len=$1 --train.global_batch=1 --train.micro_batch=1 --train.master_weights=fp32 --train.bf16_weight_copy=$2 \
      --output.dir=runs/long-$1-$2 > "$out/long-$1-$2.log" 2>&1 || fail "bench at $1 tokens, bf16_weight_copy=$2"
    grep -E "^estimated peak|error" "$out/long-$1-$2.log" | head -3
    sed -n '/^bench:/,$p' "$out/long-$1-$2.log" | head -12
  done
fi

if [ "$what" = final ]; then
  for group in model gemm attention; do
    step "marrow check --only $group"
    build-gpu/marrow check --only $group > "$out/check-$group.log" 2>&1
    grep -E "FAIL|checks,|error" "$out/check-$group.log" | head -20
    grep -q '^PASS$' "$out/check-$group.log" || fail "marrow check --only $group"
  done
  step "bench config: 3 warm-up + 27 measured steps"
  "${bench[@]}" --warmup=3 --steps=27 --output.dir=runs/final > "$out/bench.log" 2>&1 || fail "bench"
  grep -E "^estimated peak|error" "$out/bench.log" | head -3
  sed -n '/^bench:/,$p' "$out/bench.log" | head -12
  for run in "16384 true cudnn" "16384 true cudnn_nondeterministic" "32768 false cudnn" "32768 false cudnn_nondeterministic"; do
    set -- $run
    step "one sequence of $1 tokens per step, bf16_weight_copy=$2, attention kernels $3: 3 warm-up + 7 measured steps"
    "${bench[@]}" --warmup=3 --steps=7 --train.seq_len=$1 --train.global_batch=1 --train.micro_batch=1 --train.master_weights=fp32 --train.bf16_weight_copy=$2 \
      --train.attention_kernels=$3 --output.dir=runs/final-$1-$3 > "$out/long-$1-$3.log" 2>&1 || fail "bench at $1 tokens, $3"
    grep -E "^estimated peak|error" "$out/long-$1-$3.log" | head -3
    sed -n '/^bench:/,$p' "$out/long-$1-$3.log" | head -5
  done
fi

if [ "$what" = memory ]; then
  step "marrow check --only model"
  build-gpu/marrow check --only model > "$out/check-model.log" 2>&1
  grep -E "FAIL|checks,|error" "$out/check-model.log" | head -20
  grep -q '^PASS$' "$out/check-model.log" || fail "marrow check --only model"
  for run in "4096 true 4" "16384 true 1" "32768 true 1" "32768 false 1"; do
    set -- $run
    step "peak at $1 tokens x $3 per step, bf16_weight_copy=$2: 3 warm-up + 5 measured steps"
    "${bench[@]}" --warmup=3 --steps=5 --train.seq_len=$1 --train.global_batch=$3 --train.micro_batch=1 --train.master_weights=fp32 --train.bf16_weight_copy=$2 \
      --output.dir=runs/memory-$1-$2 > "$out/memory-$1-$2.log" 2>&1 || fail "bench at $1 tokens, bf16_weight_copy=$2"
    grep -E "^estimated peak|^bench:|error" "$out/memory-$1-$2.log" | head -3
  done
fi

if [ "$what" = checks ]; then
  for group in elementwise model gemm attention; do
    step "marrow check --only $group"
    build-gpu/marrow check --only $group > "$out/check-$group.log" 2>&1
    grep -E "FAIL|checks,|error" "$out/check-$group.log" | head -20
    grep -q '^PASS$' "$out/check-$group.log" || fail "marrow check --only $group"
  done
  step "train.bf16_weight_copy=false gives the losses of the default bit for bit"
  for copy in true false; do
    "${bench[@]}" --warmup=2 --steps=3 --train.master_weights=fp32 --train.bf16_weight_copy=$copy --output.dir=runs/copy-$copy > "$out/copy-$copy.log" 2>&1 \
      || fail "bench with bf16_weight_copy=$copy"
  done
  grep -E "^bench:" "$out"/copy-*.log
  python3 -c "import json, sys; l = [[json.loads(x)['loss'] for x in open(f'runs/copy-{c}/bench/metrics.jsonl')] for c in ('true', 'false')]; \
print('losses', l[0]); print('same bits' if l[0] == l[1] else f'DIFFER: {l[1]}'); sys.exit(l[0] != l[1])" || fail "losses differ"
fi

if [ "$what" = kernels ]; then
  step "marrow bench --kernels ${KERNEL_GROUP:-}"
  timeout 300 build-gpu/marrow bench --kernels ${KERNEL_GROUP:-} > "$out/kernels.log" 2>&1 || fail "bench --kernels"
  grep -E "${KERNEL_ROWS:-.}" "$out/kernels.log"
fi

if [ "$what" = plans ]; then
  for seq in ${PLAN_SEQS:-4096}; do
    step "marrow bench --attention-plans $seq"
    build-gpu/marrow bench --attention-plans "$seq" > "$out/plans-$seq.log" 2>&1 || fail "bench --attention-plans $seq"
    cat "$out/plans-$seq.log" | tee -a "$out/summary.log"
  done
fi

if [ "$what" = pairs ]; then
  for pair in false true; do
    step "bench config, train.pair_expert_grads=$pair: 3 warm-up + 27 measured steps"
    "${bench[@]}" --warmup=3 --steps=27 --train.pair_expert_grads=$pair --output.dir=runs/pairs-$pair > "$out/bench-pairs-$pair.log" 2>&1 \
      || fail "bench with pair_expert_grads=$pair"
    grep -E "^estimated peak|^data:|error" "$out/bench-pairs-$pair.log" | head -3
    sed -n '/^bench:/,$p' "$out/bench-pairs-$pair.log" | head -11
  done
  python3 -c "import json, sys; l = [[json.loads(x)['loss'] for x in open(f'runs/pairs-{p}/bench/metrics.jsonl')] for p in ('false', 'true')]; \
print('same bits' if l[0] == l[1] else f'DIFFER: {l[0][:3]} {l[1][:3]}'); sys.exit(l[0] != l[1])" | tee -a "$out/summary.log"
  [ "${PIPESTATUS[0]}" -eq 0 ] || fail "losses differ with and without pairs"
fi

if [ "$what" = fp8 ]; then
  step "marrow check --only fp8"
  timeout "${CHECK_TIMEOUT:-300}" build-gpu/marrow check --only fp8 > "$out/check-fp8.log" 2>&1
  grep -E "FAIL|checks,|error" "$out/check-fp8.log" | head -20
  grep -q '^PASS$' "$out/check-fp8.log" || fail "marrow check --only fp8"
  step "marrow bench --kernels experts: the FP8 and AdamW rows"
  timeout 300 build-gpu/marrow bench --kernels experts > "$out/kernels-experts.log" 2>&1 || fail "bench --kernels experts"
  grep -E "fp8|adamw|fwd  " "$out/kernels-experts.log"
  for fp8 in false true; do
    step "bench config, train.fp8=$fp8: 3 warm-up + 27 measured steps"
    "${bench[@]}" --warmup=3 --steps=27 --train.fp8=$fp8 --output.dir=runs/fp8-$fp8 > "$out/bench-fp8-$fp8.log" 2>&1 || fail "bench with train.fp8=$fp8"
    grep -E "^estimated peak|^data:|error" "$out/bench-fp8-$fp8.log" | head -3
    sed -n '/^bench:/,$p' "$out/bench-fp8-$fp8.log" | head -11
  done
  python3 -c "import json; l = [[json.loads(x)['loss'] for x in open(f'runs/fp8-{p}/bench/metrics.jsonl')] for p in ('false', 'true')]; \
print('first losses, bf16 then fp8:'); [print(f'  {a:.5f} {b:.5f}') for a, b in zip(l[0][:8], l[1][:8])]" | tee -a "$out/summary.log"
  for batch in ${FP8_GLOBAL:-}; do
    for fp8 in false true; do
      step "bench config with $batch micro-batches a step, train.fp8=$fp8: 3 warm-up + 7 measured steps"
      "${bench[@]}" --warmup=3 --steps=7 --train.global_batch=$batch --train.fp8=$fp8 --output.dir=runs/fp8-batch-$batch-$fp8 \
        > "$out/batch-$batch-fp8-$fp8.log" 2>&1 || fail "bench with global_batch=$batch, train.fp8=$fp8"
      grep -E "^estimated peak|error" "$out/batch-$batch-fp8-$fp8.log" | head -3
      sed -n '/^bench:/,$p' "$out/batch-$batch-fp8-$fp8.log" | head -11
    done
  done
  for seq in ${FP8_LONG:-}; do
    for fp8 in false true; do
      step "one sequence of $seq tokens per step, train.fp8=$fp8: 3 warm-up + 7 measured steps"
      "${bench[@]}" --warmup=3 --steps=7 --train.seq_len=$seq --train.global_batch=1 --train.micro_batch=1 --train.fp8=$fp8 \
        --output.dir=runs/fp8-long-$seq-$fp8 > "$out/long-$seq-fp8-$fp8.log" 2>&1 || fail "bench at $seq tokens, train.fp8=$fp8"
      grep -E "^estimated peak|error" "$out/long-$seq-fp8-$fp8.log" | head -3
      sed -n '/^bench:/,$p' "$out/long-$seq-fp8-$fp8.log" | head -11
    done
  done
fi

if [ "$what" = quick ] || [ "$what" = only ]; then
  for group in ${QUICK_CHECKS:-elementwise model}; do
    step "marrow check --only $group"
    timeout 300 build-gpu/marrow check --only $group > "$out/check-$group.log" 2>&1
    grep -E "FAIL|checks,|error" "$out/check-$group.log" | head -20
    grep -q '^PASS$' "$out/check-$group.log" || fail "marrow check --only $group"
  done
fi
if [ "$what" = quick ]; then
  step "bench config: 3 warm-up + 27 measured steps"
  "${bench[@]}" --warmup=3 --steps=27 --output.dir=runs/quick > "$out/bench.log" 2>&1 || fail "bench"
  sed -n '/^bench:/,$p' "$out/bench.log" | head -10
  first_losses runs/quick/bench/metrics.jsonl
  step "kernel trace: 2 bench steps after 2 warm-up"
  "${bench[@]}" --warmup=2 --steps=2 --profile-steps=3:4 --output.dir=runs/quick-trace > "$out/profile.log" 2>&1 || fail "trace"
  gzip -c runs/quick-trace/bench/trace-steps-3-4.json > "$out/trace-steps-3-4.json.gz" 2>/dev/null
fi

if [ "$what" = launch ]; then
  for dl in false true; do
    step "bench config, train.dependent_launch=$dl: 3 warm-up + 27 measured steps"
    timeout 240 "${bench[@]}" --warmup=3 --steps=27 --train.dependent_launch=$dl --output.dir=runs/launch-$dl \
      > "$out/bench-launch-$dl.log" 2>&1 || fail "bench dependent_launch=$dl"
    grep -E "^bench:" "$out/bench-launch-$dl.log" | tee -a "$out/summary.log"
    first_losses runs/launch-$dl/bench/metrics.jsonl
    step "one sequence of 16384 tokens without the weight copy, train.dependent_launch=$dl: 3 warm-up + 5 measured steps"
    timeout 240 "${bench[@]}" --warmup=3 --steps=5 --train.seq_len=16384 --train.global_batch=1 --train.micro_batch=1 \
      --train.master_weights=fp32 --train.bf16_weight_copy=false --train.dependent_launch=$dl --output.dir=runs/launch-long-$dl > "$out/long-launch-$dl.log" 2>&1 \
      || fail "16384 dependent_launch=$dl"
    grep -E "^bench:" "$out/long-launch-$dl.log" | tee -a "$out/summary.log"
  done
  step "kernel trace with train.dependent_launch=true: 2 bench steps after 2 warm-up"
  "${bench[@]}" --warmup=2 --steps=2 --profile-steps=3:4 --output.dir=runs/launch-trace > "$out/launch-trace.log" 2>&1 || fail "trace"
  gzip -c runs/launch-trace/bench/trace-steps-3-4.json > "$out/trace-launch-steps-3-4.json.gz" 2>/dev/null
fi

if [ "$what" = traces ]; then
  step "kernel trace: the bench config, 2 steps after 2 warm-up"
  "${bench[@]}" --warmup=2 --steps=2 --profile-steps=3:4 --output.dir=runs/trace-bench > "$out/trace-bench.log" 2>&1 || fail "trace bench"
  gzip -c runs/trace-bench/bench/trace-steps-3-4.json > "$out/trace-bench-steps-3-4.json.gz" 2>/dev/null
  step "kernel trace: one sequence of 16,384 without the weight copy, 1 step after 2 warm-up"
  "${bench[@]}" --warmup=2 --steps=1 --profile-steps=3:3 --train.seq_len=16384 --train.global_batch=1 --train.micro_batch=1 \
    --train.master_weights=fp32 --train.bf16_weight_copy=false --output.dir=runs/trace-16384 > "$out/trace-16384.log" 2>&1 || fail "trace 16384"
  gzip -c runs/trace-16384/bench/trace-steps-3-3.json > "$out/trace-16384-steps-3-3.json.gz" 2>/dev/null
  step "one sequence of 32,768 with bf16 moments: 3 + 5 steps (stage split), then a trace of 1 step after 2 warm-up"
  long32=("${bench[@]}" --train.seq_len=32768 --train.global_batch=1 --train.micro_batch=1 --optimizer.moments=bf16)
  "${long32[@]}" --warmup=3 --steps=5 --output.dir=runs/split-32768 > "$out/split-32768.log" 2>&1 || fail "bench 32768"
  sed -n '/^bench:/,$p' "$out/split-32768.log" | head -14
  "${long32[@]}" --warmup=2 --steps=1 --profile-steps=3:3 --output.dir=runs/trace-32768 > "$out/trace-32768.log" 2>&1 || fail "trace 32768"
  gzip -c runs/trace-32768/bench/trace-steps-3-3.json > "$out/trace-32768-steps-3-3.json.gz" 2>/dev/null
  ls -la "$out"/*.json.gz
fi

if [ "$what" = oom ]; then
  over=("${bench[@]}" --warmup=0 --steps=1 --train.seq_len=98304 --train.global_batch=1 --train.micro_batch=1)
  step "one sequence of 98,304 tokens: over the GPU's memory"
  "${over[@]}" --output.dir=runs/oom > "$out/oom.log" 2>&1
  code=$?
  grep -E "^estimated peak|^warning|^  --|all of the above|error" "$out/oom.log" | head -8 | tee -a "$out/summary.log"
  { [ $code -eq 1 ] && grep -q "^warning: the estimated total" "$out/oom.log" && grep -q "out of GPU memory allocating" "$out/oom.log"; } \
    || fail "no warning, out-of-memory sentence and exit status 1 (exit status $code)"
  step "the same with --optimizer.moments=bf16, the warning's first setting"
  "${over[@]}" --optimizer.moments=bf16 --output.dir=runs/oom-bf16 > "$out/oom-bf16.log" 2>&1 || fail "bf16 moments at 98,304"
  grep -E "^estimated peak|^warning|^bench:|error" "$out/oom-bf16.log" | head -4 | tee -a "$out/summary.log"
  grep -q "^warning" "$out/oom-bf16.log" && fail "a warning with bf16 moments"
fi

if [ "$what" = peaks ]; then
  step "bench config, 2 + 3 steps: losses at full precision (REF_LOSSES='[...]' compares them bit for bit)"
  "${bench[@]}" --warmup=2 --steps=3 --output.dir=runs/bits > "$out/bits.log" 2>&1 || fail "bench 2 + 3"
  first_losses runs/bits/bench/metrics.jsonl
  step "bench config: 3 warm-up + 27 measured steps"
  "${bench[@]}" --warmup=3 --steps=27 --output.dir=runs/peaks > "$out/bench.log" 2>&1 || fail "bench"
  grep -E "^estimated peak" "$out/bench.log"
  sed -n '/^bench:/,$p' "$out/bench.log" | head -9
  for run in "16384 false" "16384 true" "32768 true"; do
    set -- $run
    step "one sequence of $1 tokens per step, bf16_weight_copy=$2: 3 warm-up + 5 measured steps"
    "${bench[@]}" --warmup=3 --steps=5 --train.seq_len=$1 --train.global_batch=1 --train.micro_batch=1 --train.master_weights=fp32 --train.bf16_weight_copy=$2 \
      --output.dir=runs/peaks-$1-$2 > "$out/long-$1-$2.log" 2>&1 || fail "bench at $1 tokens, bf16_weight_copy=$2"
    grep -E "^estimated peak|^bench:|error" "$out/long-$1-$2.log" | head -3
  done
fi

if [ "$what" = measure ]; then
  step "bench config: 3 warm-up + 27 measured steps"
  "${bench[@]}" --warmup=3 --steps=27 --output.dir=runs/measure > "$out/bench.log" 2>&1 || fail "bench"
  grep -E "^estimated peak|error" "$out/bench.log" | head -3
  sed -n '/^bench:/,$p' "$out/bench.log" | head -14
  for run in "16384 true 1" "16384 false 1" "32768 true 1" "32768 false 1" "4096 false 4"; do
    set -- $run
    step "$3 sequence(s) of $1 tokens per step, bf16_weight_copy=$2: 3 warm-up + 5 measured steps"
    "${bench[@]}" --warmup=3 --steps=5 --train.seq_len=$1 --train.global_batch=$3 --train.micro_batch=1 --train.master_weights=fp32 --train.bf16_weight_copy=$2 \
      --output.dir=runs/measure-$1-$2 > "$out/long-$1-$2.log" 2>&1 || fail "bench at $1 tokens, bf16_weight_copy=$2"
    grep -E "^estimated peak|error" "$out/long-$1-$2.log" | head -3
    sed -n '/^bench:/,$p' "$out/long-$1-$2.log" | head -8
  done
  step "kernel table"
  build-gpu/marrow bench --kernels > "$out/kernels.log" 2>&1 || fail "bench --kernels"
  grep -E "^kernel|^attention|^grouped|weight" "$out/kernels.log" | head -40
fi

if [ $status -eq 0 ]; then echo PASS | tee -a "$out/summary.log"; else echo FAIL | tee -a "$out/summary.log"; fi
exit $status
