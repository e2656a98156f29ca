#!/usr/bin/env bash
# The AdamW moments in bf16 (optimizer.moments) on one H200. Run on the GPU machine from the
# repository root after tools/gpu_prepare.sh here (device tool, carry [".gpu-carry"]):
#   tools/gpu_moments.sh <log-dir> [check|bench|long|all]
# check: marrow check --only elementwise (AdamW with bf16 moments bit for bit against the CPU among
#        its rows); the AdamW rows of marrow bench --kernels experts (fp32 and bf16 moments)
# bench: the bench config (3 + 27 steps) with optimizer.moments = fp32, then bf16, on one machine:
#        tokens/s, peaks against the estimate, and the 30 losses side by side
# long:  one sequence per step (3 + MOMENTS_STEPS steps, default 7): 16,384 tokens with fp32 and bf16
#        moments, 32,768 with bf16 (MOMENTS_LONG="16384:fp32 16384:bf16 32768:bf16" by default; an entry
#        may repeat, for rounds on one machine)
# curve: the bench config for CURVE_STEPS steps (default 100: with bench's steps/4 stage-timed ones, 125 x 4
#        sequences of 4,096, what the carried corpus holds) with fp32 and with bf16 moments: the loss
#        curves side by side, by 10-step means
# resume: the tiny model on the GPU with bf16 moments: 20 steps saving at 10 and 20, then step 10 resumed
#        to 20; losses and the step-20 files (sha256 in meta.json) bit for bit, the moment files bf16
# Ends with PASS or FAIL; logs in <log-dir>.
set -uo pipefail
out=${1:-$OUT}
what=${2:-all}
source "$(dirname "$0")/gpu_common.sh"
bench=(build-gpu/marrow bench configs/bench.toml --data.path=.gpu-carry/qwen3 --checkpoint.every=0)

if [ "$what" = check ] || [ "$what" = all ]; then
  step "marrow check --only elementwise"
  timeout 300 build-gpu/marrow check --only elementwise > "$out/check-elementwise.log" 2>&1
  grep -E "FAIL|checks,|error" "$out/check-elementwise.log" | head -20
  grep -E "bf16 moments" "$out/check-elementwise.log" | head -20 >> "$out/summary.log"
  grep -q '^PASS$' "$out/check-elementwise.log" || fail "marrow check --only elementwise"
  step "AdamW rows of marrow bench --kernels experts"
  timeout 240 build-gpu/marrow bench --kernels experts > "$out/kernels.log" 2>&1 || fail "bench --kernels experts"
  grep -E "^kernel|adamw" "$out/kernels.log" | tee -a "$out/summary.log"
fi

if [ "$what" = bench ] || [ "$what" = all ]; then
  for moments in fp32 bf16; do
    step "bench config, optimizer.moments = $moments: 3 warm-up + 27 measured steps"
    timeout 240 "${bench[@]}" --warmup=3 --steps=27 --optimizer.moments=$moments --output.dir=runs/moments-$moments \
      > "$out/bench-$moments.log" 2>&1 || fail "bench with $moments moments"
    grep -E "^estimated peak|error" "$out/bench-$moments.log" | head -3 | tee -a "$out/summary.log"
    grep -E "^bench:" "$out/bench-$moments.log" | tee -a "$out/summary.log"
  done
  python3 - runs/moments-fp32/bench/metrics.jsonl runs/moments-bf16/bench/metrics.jsonl <<'PY' | tee -a "$out/summary.log"
import json, sys
a, b = ([json.loads(x)["loss"] for x in open(f)] for f in sys.argv[1:3])
for i, (x, y) in enumerate(zip(a, b)):
    print(f"step {i + 1:2d}  fp32 {x:.6f}  bf16 {y:.6f}  relative {(y - x) / x:+.2e}")
print(f"largest relative difference {max(abs(y - x) / x for x, y in zip(a, b)):.2e}; mean of the last 10: fp32 "
      f"{sum(a[-10:]) / 10:.5f}, bf16 {sum(b[-10:]) / 10:.5f}")
PY
fi

if [ "$what" = long ] || [ "$what" = all ]; then
  round=0
  for run in ${MOMENTS_LONG:-16384:fp32 16384:bf16 32768:bf16}; do
    seq=${run%:*} moments=${run#*:} round=$((round + 1)) steps=${MOMENTS_STEPS:-7}
    log="$out/long-$seq-$moments-$round.log"
    step "one sequence of $seq tokens a step, optimizer.moments = $moments: 3 warm-up + $steps measured steps"
    timeout 240 "${bench[@]}" --warmup=3 --steps=$steps --train.seq_len=$seq --train.global_batch=1 --train.micro_batch=1 \
      --optimizer.moments=$moments --output.dir=runs/long-$seq-$moments-$round > "$log" 2>&1 \
      || fail "bench at $seq tokens with $moments moments"
    grep -E "^estimated peak|error" "$log" | head -3 | tee -a "$out/summary.log"
    sed -n '/^bench:/,$p' "$log" | head -12 | tee -a "$out/summary.log"
  done
fi

if [ "$what" = curve ]; then
  for moments in fp32 bf16; do
    step "bench config, optimizer.moments = $moments: ${CURVE_STEPS:-100} steps"
    timeout 300 "${bench[@]}" --warmup=0 --steps=${CURVE_STEPS:-100} --optimizer.moments=$moments --output.dir=runs/curve-$moments \
      > "$out/curve-$moments.log" 2>&1 || fail "bench with $moments moments"
    grep -E "^bench:|error" "$out/curve-$moments.log" | tee -a "$out/summary.log"
  done
  python3 - runs/curve-fp32/bench/metrics.jsonl runs/curve-bf16/bench/metrics.jsonl <<'PY' | tee -a "$out/summary.log"
import json, sys
a, b = ([json.loads(x)["loss"] for x in open(f)] for f in sys.argv[1:3])
n = min(len(a), len(b))
for i in range(0, n, 10):
    x, y = sum(a[i:i + 10]) / len(a[i:i + 10]), sum(b[i:i + 10]) / len(b[i:i + 10])
    print(f"steps {i + 1:3d}-{min(i + 10, n):3d}  fp32 {x:.5f}  bf16 {y:.5f}  relative {(y - x) / x:+.2e}")
print(f"{n} steps; largest relative difference of one step {max(abs(y - x) / x for x, y in zip(a, b)):.2e}")
PY
fi

if [ "$what" = resume ]; then
  tiny=(build-gpu/marrow train configs/tiny-moe.toml --data.path=.gpu-carry/demo/corpus --train.steps=20 --schedule.warmup_steps=5
        --train.device=cuda --optimizer.moments=bf16 --checkpoint.every=10)
  rm -rf runs/moments-straight runs/moments-resumed
  step "tiny model on the GPU, bf16 moments: 20 steps, then step 10 resumed to 20"
  "${tiny[@]}" --output.dir=runs/moments-straight > "$out/resume.log" 2>&1 || fail "straight run"
  "${tiny[@]}" --output.dir=runs/moments-resumed --checkpoint.resume=runs/moments-straight/step-00000010 >> "$out/resume.log" 2>&1 \
    || fail "resumed run"
  grep -E "^memory|resuming|error" "$out/resume.log" | head -4 | tee -a "$out/summary.log"
  python3 - runs/moments-straight runs/moments-resumed <<'PY' | tee -a "$out/summary.log"
import json, struct, sys
a, b = sys.argv[1:3]
loss = lambda run: {m["step"]: m["loss"] for m in map(json.loads, open(f"{run}/metrics.jsonl"))}
files = lambda run: {f["file"]: f["sha256"] for f in json.load(open(f"{run}/step-00000020/meta.json"))["files"] if f["group"] != "config"}
def dtypes(run, group):
    out = set()
    for f in json.load(open(f"{run}/step-00000020/meta.json"))["files"]:
        if f["group"] == group:
            with open(f"{run}/step-00000020/{f['file']}", "rb") as h:
                header = json.loads(h.read(struct.unpack("<Q", h.read(8))[0]))
            out |= {v["dtype"] for k, v in header.items() if k != "__metadata__"}
    return out
la, lb = loss(a), loss(b)
same_losses = all(la[s] == lb[s] for s in range(11, 21))
same_files = files(a) == files(b) and len(files(a)) > 0
kinds = (dtypes(a, "weights"), dtypes(a, "exp_avg"), dtypes(a, "exp_avg_sq"))
print(f"steps 11-20: losses equal bit for bit: {same_losses}; step 20: {len(files(a))} files, equal sha256: {same_files}; "
      f"dtypes weights {kinds[0]}, exp_avg {kinds[1]}, exp_avg_sq {kinds[2]}")
sys.exit(0 if same_losses and same_files and kinds == ({"F32"}, {"BF16"}, {"BF16"}) else 1)
PY
  [ "${PIPESTATUS[0]}" -eq 0 ] || fail "the resumed run differs, or the files' dtypes"
fi

if [ $status -eq 0 ]; then echo PASS | tee -a "$out/summary.log"; else echo FAIL | tee -a "$out/summary.log"; fi
exit $status
