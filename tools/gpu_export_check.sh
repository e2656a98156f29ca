#!/usr/bin/env bash
# Export check on the GPU machine (run there from the repository root, after tools/gpu_prepare.sh
# here, with the device tool carrying .gpu-carry):
#   build -> train the bench config 20 steps, saving a weights-only checkpoint at step 20
#   -> marrow export --dtype=bfloat16 -> tools/gpu_export_check.py: transformers loads the export on
#   the GPU and its loss on a 4096-token batch of the corpus matches Marrow's forward (bf16 tolerance).
# Each stage is skipped when its result is already there, so if the 10-minute limit of one command
# cuts it short, the same command continues (a cut training run saves on SIGTERM and resumes).
# Disk: ~22 GiB checkpoint (fp32 weights; no AdamW moments) + ~11 GiB export.
# Logs go to the folder given as the first argument (default $OUT). Ends with PASS or FAIL.
set -uo pipefail
out=${1:-$OUT}
mkdir -p "$out"
cd "$(dirname "$0")/.."
export PKG_CONFIG_PATH=$PWD/.gpu-carry/libs/lib/pkgconfig
run=runs/bench-export
hf=runs/bench-export-hf
step() { echo "== $*" | tee -a "$out/export-summary.log"; }

step "build"
if ! { cmake -S . -B build-gpu -G Ninja -DMARROW_CUDA=ON -DMARROW_PYTHON=python3 && ninja -C build-gpu marrow model_forward; } \
    > "$out/export-build.log" 2>&1; then
  tail -40 "$out/export-build.log"; echo FAIL; exit 1
fi

if [ ! -f "$run/step-00000020/meta.json" ]; then
  step "train the bench config for 20 steps (checkpoint at step 20, weights only)"
  build-gpu/marrow train configs/bench.toml --data.path=.gpu-carry/qwen3 --output.dir=$run --train.steps=20 \
    --checkpoint.every=20 --checkpoint.keep=1 --checkpoint.optimizer_state=false 2>&1 | tee -a "$out/export-train.log" | tail -8
  [ -f "$run/step-00000020/meta.json" ] || { echo "no checkpoint at step 20"; echo FAIL; exit 1; }
fi

if [ ! -f "$hf/model.safetensors.index.json" ]; then
  step "export (bf16)"
  rm -rf "$hf.partial"
  start=$SECONDS
  build-gpu/marrow export "$run" "$hf.partial" --dtype=bfloat16 2>&1 | tee -a "$out/export.log"
  [ "${PIPESTATUS[0]}" -eq 0 ] || { echo FAIL; exit 1; }
  echo "export took $((SECONDS - start)) s" | tee -a "$out/export.log"
  mv "$hf.partial" "$hf"
fi
ls -la "$hf" | tee -a "$out/export.log"
du -sh "$run/step-00000020" "$hf" | tee -a "$out/export.log"

step "transformers loads the export; loss vs Marrow's forward"
python3 tools/gpu_export_check.py --model-forward build-gpu/tests/model_forward --checkpoint "$run" --hf "$hf" \
  --corpus .gpu-carry/qwen3 --out runs/bench-export-check 2>&1 | tee "$out/export-check.log" | grep -v Warning | tail -20
grep -q '^PASS$' "$out/export-check.log" && { echo PASS | tee -a "$out/export-summary.log"; exit 0; }
echo FAIL | tee -a "$out/export-summary.log"; exit 1
