#!/usr/bin/env bash
# Issue #15: the whole Qwen3-30B-A3B (configs/qwen3-30b-a3b.toml) on one 8 x H200 node (device kind
# nvidia-h200-x8), run there from the repository root after tools/gpu_prepare.sh here, with the device
# tool carrying .gpu-carry:
#   tools/gpu_full_node.sh <log-dir> <part> [layout arguments, default the config's EP = 8]
# Each part fits one device command (10 minutes); run them in order on one warm machine, since the
# checkpoints live in /dev/shm, which a released machine loses. The run keeps the AdamW moments in
# bf16 (MOMENTS=fp32 for fp32): one checkpoint is then 227 GiB, with fp32 moments 341 GiB, more than
# the machine's disk and than tmpfs's default half of its 560 GiB; the train part holds two (steps 25
# and 50) and refuses to start, naming both figures, where /dev/shm has less room:
#   estimate  build; marrow estimate of the layout (no GPU): the peak per GPU to compare with the run's
#   train     50 steps (checkpoints at 25 and 50, a kernel trace of steps 10-11 on rank 0): loss, tokens/s
#             and TFLOP/s per GPU, MFU, peak per GPU, the all-to-all time hidden under compute
#   export    marrow export of step 50 (bf16); transformers loads it on the CPU and its loss on 256 tokens
#             matches Marrow's forward (tools/gpu_export_check.py); the export is deleted after the check
#   resume    the step-25 checkpoint resumed on 8 processes to step 50: its losses and step 50's weight and
#             moment files equal the straight run's bit for bit (the sha256 of each file in meta.json; the
#             straight run's step-50 files are deleted first, so two checkpoints at most share /dev/shm)
# DRY_RUN=1 runs the same parts on this machine's CPU under mpirun --oversubscribe with the tiny model
# (8 experts, 4 steps, checkpoints at 2 and 4, no kernel trace): the script's own test, in CI through
# tests/python/test_tools.py (`DRY_RUN=1 tools/gpu_full_node.sh /tmp/node all`; MARROW, MARROW_DEMO_CORPUS
# and PYTHON default to build-cpu's binary, its demo corpus and .venv). Ends with PASS or FAIL.
set -uo pipefail
out=${1:-$OUT}
part=${2:-all}
shift 2 2>/dev/null || shift $#
layout=("$@")
[ ${#layout[@]} -gt 0 ] || layout=(--parallel.ep=8)

ranks=8
source "$(dirname "$0")/gpu_common.sh"
if [ "$dry" = 1 ]; then
  root=$out/runs
  config=(configs/tiny-moe.toml --data.path="$corpus" --train.device=cpu --optimizer.moments=${MOMENTS:-bf16}
          --train.global_batch=16 --train.micro_batch=1 --train.steps=4 --schedule.warmup_steps=1 --parallel.timeout_s=300)
  save=2 last=4 seq=64
  profile=()  # CUPTI traces need the CUDA build
else
  ninja -C build-gpu model_forward > "$out/build-tools.log" 2>&1 || fail "build model_forward"
  root=/dev/shm/marrow-30b
  config=(configs/qwen3-30b-a3b.toml --data.path="$corpus" --optimizer.moments=${MOMENTS:-bf16})
  save=25 last=50 seq=256
  profile=(--profile-steps=10:11)
fi
straight=$root/straight resumed=$root/resumed hf=$root/hf
ckpt() { printf '%s/step-%08d' "$1" "$2"; }

if [ "$part" = estimate ] || [ "$part" = all ]; then
  step "marrow estimate, 8 processes, ${layout[*]}"
  $marrow estimate "${config[@]}" "${layout[@]}" --world=8 > "$out/estimate.log" 2>&1 || fail "estimate"
  grep -E "trainer's peak|^total|fits|one checkpoint" "$out/estimate.log" | tee -a "$out/summary.log"
fi

if [ "$part" = train ] || [ "$part" = all ]; then
  step "train $last steps on 8 processes, ${layout[*]}; checkpoints every $save steps in $straight"
  rm -rf "$straight" "$resumed" "$hf"
  mkdir -p "$root"
  one=$($marrow estimate "${config[@]}" "${layout[@]}" --world=8 2>/dev/null | sed -n 's/^one checkpoint: \([0-9.]*\) GiB.*/\1/p')
  free=$(df --output=avail -B1 "$root" | tail -1)
  echo "one checkpoint ${one:-?} GiB; $root has $((free >> 30)) GiB free" | tee -a "$out/summary.log"
  $python -c "import sys; sys.exit(0 if $free >= 2 * ${one:-1e9} * 2**30 else 1)" \
    || { fail "two checkpoints of ${one:-?} GiB do not fit in the $((free >> 30)) GiB free in $root (tmpfs: try mount -o remount,size=480G /dev/shm)"
         part=none; }
fi

if [ "$part" = train ] || [ "$part" = all ]; then
  timeout 590 "${mpi[@]}" $marrow train "${config[@]}" "${layout[@]}" --output.dir="$straight" --checkpoint.every=$save \
    --checkpoint.keep=2 "${profile[@]}" > "$out/train.log" 2>&1 || fail "train"
  grep -E "^mesh|^memory|^estimated|^step|communication|compute kernels|error" "$out/train.log" | tail -24 | tee -a "$out/summary.log"
  gzip -c "$straight"/trace-steps-*.json > "$out/trace.json.gz" 2>/dev/null
fi

if [ "$part" = export ] || [ "$part" = all ]; then
  step "export step $last (bf16); transformers loads it on the CPU"
  rm -rf "$hf"
  $marrow export "$(ckpt "$straight" $last)" "$hf" --dtype=bfloat16 > "$out/export.log" 2>&1 || fail "export"
  forward=$(dirname $marrow)/tests/model_forward
  corpus=$(printf '%s\n' "${config[@]}" | sed -n 's/^--data.path=//p')
  timeout 590 $python tools/gpu_export_check.py --model-forward "$forward" --checkpoint "$(ckpt "$straight" $last)" --hf "$hf" \
    --corpus "$corpus" --out "$root/export-check" --seq $seq --device cpu > "$out/export-check.log" 2>&1 \
    || fail "export check"
  grep -vi warning "$out/export-check.log" | tail -6 | tee -a "$out/summary.log"
  rm -rf "$hf" "$root/export-check"  # room for the resumed run's checkpoint
fi

if [ "$part" = resume ] || [ "$part" = all ]; then
  step "resume step $save on 8 processes to step $last"
  rm -rf "$resumed"
  # The straight run's step-$last files give way to the resumed run's; their sha256s stay in its meta.json.
  rm -f "$(ckpt "$straight" $last)"/*.safetensors
  timeout 590 "${mpi[@]}" $marrow train "${config[@]}" "${layout[@]}" --output.dir="$resumed" --checkpoint.every=$save \
    --checkpoint.keep=1 --checkpoint.resume="$(ckpt "$straight" $save)" > "$out/resume.log" 2>&1 || fail "resume"
  grep -E "resuming|^step|error" "$out/resume.log" | tail -6
  $python - "$straight" "$resumed" "$save" "$last" <<'PY' | tee -a "$out/summary.log" || fail "the resumed run differs"
import json, sys
straight, resumed, save, last = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
loss = lambda run: {m["step"]: m["loss"] for m in map(json.loads, open(f"{run}/metrics.jsonl"))}
a, b = loss(straight), loss(resumed)
same_losses = all(a[s] == b[s] for s in range(save + 1, last + 1))
files = lambda run: {(f["group"], f["file"]): f["sha256"] for f in json.load(open(f"{run}/step-{last:08d}/meta.json"))["files"]
                     if f["group"] in ("weights", "exp_avg", "exp_avg_sq")}
fa, fb = files(straight), files(resumed)
print(f"steps {save + 1}-{last}: losses equal bit for bit: {same_losses}; step {last}: {len(fa)} weight and moment files, "
      f"equal sha256: {fa == fb}")
sys.exit(0 if same_losses and fa == fb and fa else 1)
PY
fi

if [ $status -eq 0 ]; then echo PASS | tee -a "$out/summary.log"; else echo FAIL | tee -a "$out/summary.log"; fi
exit $status
