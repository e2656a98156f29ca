#!/usr/bin/env bash
# Everything the GPU machine checks and measures, run there from the repository root after
# tools/gpu_prepare.sh here, with the device tool carrying .gpu-carry:
#   tools/gpu_check.sh <log-dir> [correctness|speed|model|profile|all]
# correctness: build (cmake + ninja, sm_90a) -> marrow check -> tiny model (Qwen3-MoE, then GPT-OSS) GPU vs CPU and
#              GPU determinism -> Hugging Face parity of the bf16 forward
# model:       build -> marrow check --only model -> Hugging Face parity
# check:       build -> marrow check, every group in one process (check.log; tools/compare_checks.py compares
#              two such logs row by row, e.g. before and after a refactor)
# speed:       build -> marrow bench --kernels -> marrow bench on the bench config (20 steps:
#              memory bill, peak, tokens/s) -> leak check over 200 short steps -> profile
# profile:     build -> kernel trace of 2 bench steps and the top-10 kernels (.agents/skills/profile-kernels);
#              the trace JSON comes back when under 20 MB (gzipped otherwise)
# all:         correctness and speed, without the profile (its two files would pass the 8-file limit)
# Logs go to <log-dir> (at most 8 files, as the device tool returns). Ends with PASS or FAIL.
set -uo pipefail
out=${1:-$OUT}
what=${2:-all}
mkdir -p "$out"
cd "$(dirname "$0")/.."
export PKG_CONFIG_PATH=$PWD/.gpu-carry/libs/lib/pkgconfig
status=0
step() { echo "== $*" | tee -a "$out/summary.log"; }
fail() { echo "FAILED: $*" | tee -a "$out/summary.log"; status=1; }

step "build (commit $(cat .gpu-carry/commit 2>/dev/null || echo unknown: rerun tools/gpu_prepare.sh))"
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader | tee -a "$out/summary.log"
if ! { cmake -S . -B build-gpu -G Ninja -DMARROW_CUDA=ON -DMARROW_PYTHON=python3 && ninja -C build-gpu marrow hf_dump; } \
    > "$out/build.log" 2>&1; then
  grep -E "error|Error" "$out/build.log" | head -40; echo FAIL; exit 1
fi

if [ "$what" = model ]; then
  step "marrow check --only model"
  build-gpu/marrow check --only model > "$out/check.log" 2>&1
  grep -vE " ok$" "$out/check.log"
  grep -q '^PASS$' "$out/check.log" || fail "marrow check --only model"
fi

if [ "$what" = check ]; then
  step "marrow check"
  build-gpu/marrow check > "$out/check.log" 2>&1
  grep -E "FAIL|checks," "$out/check.log" | head -60
  grep -q '^PASS$' "$out/check.log" || fail "marrow check"
fi

if [ "$what" = model ] || [ "$what" = correctness ] || [ "$what" = all ]; then
  step "Hugging Face parity of the GPU forward (bf16)"
  python3 tools/gpu_hf_parity.py build-gpu/tests/hf_dump runs/hf-parity 2>&1 | grep -v Loading | tee "$out/hf-parity.log" | tail -4
  [ "${PIPESTATUS[0]}" -eq 0 ] || fail "GPU Hugging Face parity"
fi

if [ "$what" = correctness ] || [ "$what" = all ]; then
  step "marrow check"
  build-gpu/marrow check > "$out/check.log" 2>&1
  grep -E "FAIL|checks," "$out/check.log" | head -60
  grep -q '^PASS$' "$out/check.log" || fail "marrow check"

  step "tiny model: 20 steps on CPU and twice on GPU"
  rm -rf runs/tiny-*
  tiny=(configs/tiny-moe.toml --data.path=.gpu-carry/demo/corpus --train.steps=20 --schedule.warmup_steps=5 --output.log_every=5
        --checkpoint.every=0)
  for run in cpu gpu1 gpu2; do
    device=cuda; [ $run = cpu ] && device=cpu
    build-gpu/marrow train "${tiny[@]}" --train.device=$device --output.dir=runs/tiny-$run >> "$out/tiny.log" 2>&1 || fail "tiny $run run"
  done
  python3 tools/compare_runs.py runs/tiny-cpu/metrics.jsonl runs/tiny-gpu1/metrics.jsonl runs/tiny-gpu2/metrics.jsonl \
    2>&1 | tee -a "$out/tiny.log" | tail -4
  [ "${PIPESTATUS[0]}" -eq 0 ] || fail "tiny model GPU vs CPU"

  step "tiny GPT-OSS: 20 steps on CPU and twice on GPU"
  for run in cpu gpu1 gpu2; do
    device=cuda; [ $run = cpu ] && device=cpu
    build-gpu/marrow train "${tiny[@]}" --model.config=configs/tiny-gpt-oss.json --train.device=$device \
      --output.dir=runs/tiny-gpt-oss-$run >> "$out/tiny-gpt-oss.log" 2>&1 || fail "tiny GPT-OSS $run run"
  done
  python3 tools/compare_runs.py runs/tiny-gpt-oss-{cpu,gpu1,gpu2}/metrics.jsonl 2>&1 | tee -a "$out/tiny-gpt-oss.log" | tail -4
  [ "${PIPESTATUS[0]}" -eq 0 ] || fail "tiny GPT-OSS GPU vs CPU"

fi

if [ "$what" = speed ] || [ "$what" = all ]; then
  step "kernel table"
  build-gpu/marrow bench --kernels 2>&1 | tee "$out/kernels.log"
  [ "${PIPESTATUS[0]}" -eq 0 ] || fail "bench --kernels"

  step "bench config: 3 warm-up + 17 measured steps"
  build-gpu/marrow bench configs/bench.toml --data.path=.gpu-carry/qwen3 --warmup=3 --steps=17 --output.dir=runs/bench \
    --checkpoint.every=0 > "$out/bench.log" 2>&1 || fail "bench config"
  grep -E "^model|^memory|error" "$out/bench.log"
  sed -n '/^bench:/,$p' "$out/bench.log"

  step "leak check: 200 steps of 1 x 1024 tokens on the bench model"
  build-gpu/marrow train configs/bench.toml --data.path=.gpu-carry/qwen3 --train.steps=200 --train.global_batch=1 \
    --train.seq_len=1024 --output.log_every=50 --checkpoint.every=0 --output.dir=runs/leak > "$out/leak.log" 2>&1 || fail "leak run"
  python3 tools/compare_runs.py --peak-stable runs/leak/metrics.jsonl 2>&1 | tee -a "$out/leak.log" | tail -2
  [ "${PIPESTATUS[0]}" -eq 0 ] || fail "peak memory grows"
fi

if [ "$what" = speed ] || [ "$what" = profile ]; then
  step "kernel trace: 2 bench steps after 2 warm-up"
  trace=runs/profile/bench/trace-steps-3-4.json
  rm -f "$trace"
  .agents/skills/profile-kernels/run.sh build-gpu/marrow configs/bench.toml "$out" --data.path=.gpu-carry/qwen3 \
    --output.dir=runs/profile --checkpoint.every=0 | tail -n 20
  [ "${PIPESTATUS[0]}" -eq 0 ] || fail "kernel trace"
  limit=$((20 * 1000 * 1000))
  if [ -f "$trace" ]; then
    copy=$out/$(basename "$trace")
    if [ "$(stat -c %s "$trace")" -lt $limit ]; then cp "$trace" "$copy"; else copy=$copy.gz; gzip -c "$trace" > "$copy"; fi
    [ "$(stat -c %s "$copy")" -lt $limit ] || { rm "$copy"; echo "the trace is over 20 MB even gzipped: not copied"; }
  fi
fi

if [ $status -eq 0 ]; then echo PASS | tee -a "$out/summary.log"; else echo FAIL | tee -a "$out/summary.log"; fi
exit $status
