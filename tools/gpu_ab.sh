#!/usr/bin/env bash
# Two versions of marrow side by side on one GPU machine: the tree sent (build-gpu) against an earlier
# commit (build-ab), their bench runs alternating, so that a change of a few percent is not lost in
# the 2-5% by which the GPU machines differ from call to call.
#   tools/gpu_ab.sh prepare <commit>            on this machine, before tools/gpu_prepare.sh: the
#                                               commit's sources into .gpu-carry/ab-base (carried)
#   tools/gpu_ab.sh <log-dir> [rounds]          on the GPU machine (device tool, carry [".gpu-carry"]),
#                                               directly or as a tools/gpu_batch.sh part ("gpu_ab.sh 2")
#   tools/gpu_ab.sh <log-dir> check             on the GPU machine: `marrow check` with the base, then with
#                                               the tree, compared row by row (tools/compare_checks.py);
#                                               rerun on the warm machine, it resumes after a time limit
# Each round runs the bench config (3 + 27 steps; AB_CONFIG another run config, e.g.
# configs/bench-gpt-oss.toml) with the base, then with the tree; AB_ARGS adds bench
# options to both (e.g. '--train.seq_len=32768 --train.global_batch=1'), AB_WARMUP and AB_STEPS set the
# steps; KERNEL_ROWS='regex' adds both binaries' `marrow bench --kernels` rows that match. The summary has every run's bench line,
# each side's mean tokens/s and whether the two sides' losses are the same bits (reported, not
# required: a change may alter them on purpose). Ends with PASS or FAIL.
set -uo pipefail
cd "$(dirname "$0")/.."
base=.gpu-carry/ab-base
if [ "${1:-}" = prepare ]; then
  commit=${2:?usage: tools/gpu_ab.sh prepare <commit>}
  rm -rf "$base" && mkdir -p "$base"
  git archive "$commit" -- CMakeLists.txt src configs tests tools | tar -x -C "$base" || { echo FAIL; exit 1; }
  git rev-parse --short "$commit" > "$base/.commit"
  echo "base $(cat "$base/.commit") in $base ($(du -sh "$base" | cut -f1))"
  echo PASS
  exit 0
fi
out=${1:-$OUT}
mode=${2:-2}
rounds=$mode
[[ $rounds =~ ^[0-9]+$ ]] || rounds=2  # gpu_batch.sh passes "all" when a part names no mode
[ -f "$base/.commit" ] || { echo "no base sources: run tools/gpu_ab.sh prepare <commit> here before tools/gpu_prepare.sh"; echo FAIL; exit 1; }
source tools/gpu_common.sh
step "build of the base (commit $(cat "$base/.commit"))"
if ! { cmake -S "$base" -B build-ab -G Ninja -DMARROW_CUDA=ON -DMARROW_PYTHON=python3 \
         -DTOMLPP_INCLUDE_DIR="$PWD/.gpu-carry/tomlplusplus/include" \
         -DCUDNN_FRONTEND_INCLUDE_DIR="$PWD/.gpu-carry/cudnn-frontend/include" && ninja -C build-ab marrow; } > "$out/build-ab.log" 2>&1; then
  grep -E "error|Error" "$out/build-ab.log" | head -40; echo FAIL; exit 1
fi

# side: base or tree; its binary and its runs' directories.
binary() { [ "$1" = base ] && echo build-ab/marrow || echo build-gpu/marrow; }
if [ "$mode" = check ]; then
  # A side's finished log stays in runs/ so that a second call on the same warm machine goes on where a
  # first one hit the device tool's time limit.
  mkdir -p runs
  for side in base tree; do
    if grep -q "checks," "runs/check-$side.log" 2>/dev/null; then
      step "$side: marrow check (finished in an earlier call)"
    else
      step "$side: marrow check"
      "$(binary $side)" check > "runs/check-$side.log" 2>&1
    fi
    cp "runs/check-$side.log" "$out/check-$side.log"
    grep -E "checks," "$out/check-$side.log" | tee -a "$out/summary.log"
  done
  python3 tools/compare_checks.py "$out/check-base.log" "$out/check-tree.log" | tee -a "$out/summary.log"
  [ "${PIPESTATUS[0]}" -eq 0 ] || fail "rows that passed with the base do not pass with the tree"
  if [ $status -eq 0 ]; then echo PASS; else echo FAIL; fi
  exit $status
fi
for round in $(seq 1 "$rounds"); do
  for side in base tree; do
    step "round $round, $side: ${AB_CONFIG:-configs/bench.toml} ${AB_ARGS:-}, ${AB_WARMUP:-3} warm-up + ${AB_STEPS:-27} measured steps"
    "$(binary $side)" bench ${AB_CONFIG:-configs/bench.toml} --data.path=.gpu-carry/qwen3 --checkpoint.every=0 --warmup=${AB_WARMUP:-3} \
      --steps=${AB_STEPS:-27} ${AB_ARGS:-} --output.dir=runs/ab-$side-$round > "$out/bench-$side-$round.log" 2>&1 \
      || fail "bench ($side, round $round)"
    grep -E "^bench:" "$out/bench-$side-$round.log" | tee -a "$out/summary.log"
  done
done
for side in base tree; do
  grep -h "^bench:" "$out"/bench-$side-*.log | sed -E 's/.*\| ([0-9]+) tokens\/s.*/\1/' \
    | awk -v side=$side '{s += $1; n++} END {if (n) printf "%s: mean %.0f tokens/s over %d runs\n", side, s / n, n}' | tee -a "$out/summary.log"
done
python3 -c "import json; l = [[json.loads(x)['loss'] for x in open(f'runs/ab-{s}-1/bench/metrics.jsonl')] for s in ('base', 'tree')]; \
print('losses: same bits' if l[0] == l[1] else f'losses differ: base {l[0][:3]} tree {l[1][:3]}')" | tee -a "$out/summary.log"
if [ -n "${KERNEL_ROWS:-}" ]; then
  for side in base tree; do
    step "$side: marrow bench --kernels, rows matching $KERNEL_ROWS"
    "$(binary $side)" bench --kernels > "$out/kernels-$side.log" 2>&1 || fail "bench --kernels ($side)"
    grep -E "$KERNEL_ROWS" "$out/kernels-$side.log" | tee -a "$out/summary.log"
  done
fi
if [ $status -eq 0 ]; then echo PASS; else echo FAIL; fi
exit $status
