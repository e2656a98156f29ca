#!/usr/bin/env bash
# Split master weights (train.master_weights = "split", core/split_f32.h) against an fp32 master on
# one H200. Run on the GPU machine from the repository root after tools/gpu_prepare.sh here (device
# tool, carry [".gpu-carry"]):
#   tools/gpu_master.sh <log-dir> [check|bench|long|resume|trace|steps|power|all]
# check:  marrow check --only elementwise (split_f32, join_f32 and AdamW on split weights bit for bit
#         against the CPU among its rows); the AdamW rows of marrow bench --kernels experts
# bench:  the bench config (3 + 27 steps), master fp32 then split, MASTER_ROUNDS times (default 2) on
#         one machine: tokens/s, peaks against the estimate, the losses side by side; each master's
#         rounds must give the same losses bit for bit, and REF_LOSSES / FP32_REF_LOSSES (comma-separated,
#         the first five) must be the split / fp32 master's first five
# long:   one sequence per step (3 + MASTER_STEPS, default 7): MASTER_LONG entries seq:moments:master,
#         default "16384:fp32:fp32 16384:fp32:split 16384:fp32:fp32 16384:fp32:split 32768:fp32:split"
# resume: the tiny model on the GPU with the split master: 20 steps saving at 10 and 20, then step 10
#         resumed to 20; losses and the step-20 files (sha256 in meta.json) bit for bit, the weights F32
# trace:  a kernel trace of one bench step (after 2 warm-up) with each master: the optimizer's kernels
#         summed by name side by side (trace-<master>.json.gz)
# steps:  a kernel trace of steps 3-8 at one sequence of 16,384 (the default master): each step's GPU span and
#         the kernels whose time differs most between steps (trace-16384-steps-3-8.json.gz)
# power:  nvidia-smi every 50 ms during 3 + 12 steps of one sequence of 16,384 (POWER_ARGS: other bench
#         arguments, e.g. "" for the bench config): SM clock, power against the limit and the clock event
#         reasons under load (0x4: the software power cap), per-step times
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
  grep -E "split" "$out/check-elementwise.log" | head -40 >> "$out/summary.log"
  grep -q '^PASS$' "$out/check-elementwise.log" || fail "marrow check --only elementwise"
  step "AdamW rows of marrow bench --kernels experts"
  timeout 240 build-gpu/marrow bench --kernels experts > "$out/kernels.log" 2>&1 || fail "bench --kernels experts"
  grep -E "^kernel|adamw" "$out/kernels.log" | tee -a "$out/summary.log"
fi

if [ "$what" = bench ] || [ "$what" = all ]; then
  for round in $(seq "${MASTER_ROUNDS:-2}"); do
    for master in fp32 split; do
      step "bench config, train.master_weights = $master (round $round): 3 warm-up + 27 measured steps"
      timeout 240 "${bench[@]}" --warmup=3 --steps=27 --train.master_weights=$master --output.dir=runs/master-$master-$round \
        > "$out/bench-$master-$round.log" 2>&1 || fail "bench with the $master master"
      grep -E "^estimated peak|error" "$out/bench-$master-$round.log" | head -3 | tee -a "$out/summary.log"
      sed -n '/^bench:/,$p' "$out/bench-$master-$round.log" | head -12 | tee -a "$out/summary.log"
    done
  done
  python3 - "${MASTER_ROUNDS:-2}" "${REF_LOSSES:-}" "${FP32_REF_LOSSES:-}" <<'PY' | tee -a "$out/summary.log"
import json, sys
rounds, ref, fp32_ref = int(sys.argv[1]), *([float(v) for v in arg.split(",") if v] for arg in sys.argv[2:4])
losses = {(m, r): [json.loads(x)["loss"] for x in open(f"runs/master-{m}-{r}/bench/metrics.jsonl")]
          for m in ("fp32", "split") for r in range(1, rounds + 1)}
a, b = losses["fp32", 1], losses["split", 1]
ok = all(losses[m, r] == losses[m, 1] for m in ("fp32", "split") for r in range(1, rounds + 1))
print(f"each master's {rounds} rounds give the same losses bit for bit: {ok}")
print(f"{sum(x == y for x, y in zip(a, b))} of {len(a)} losses the same bits with the two masters; "
      f"largest relative difference {max(abs(y - x) / x for x, y in zip(a, b)):.2e}")
for i, (x, y) in enumerate(zip(a, b)):
    print(f"step {i + 1:2d}  fp32 {x!r}  split {y!r}")
for name, want, got in (("split (the default)", ref, b), ("fp32", fp32_ref, a)):
    if want:
        print(f"first {len(want)} losses of the {name} master the reference's bits: {got[:len(want)] == want}")
        ok = ok and got[:len(want)] == want
sys.exit(0 if ok else 1)
PY
  [ "${PIPESTATUS[0]}" -eq 0 ] || fail "a round differs, or the first losses are not the reference's"
fi

if [ "$what" = long ] || [ "$what" = all ]; then
  round=0
  for run in ${MASTER_LONG:-16384:fp32:fp32 16384:fp32:split 16384:fp32:fp32 16384:fp32:split 32768:fp32:split}; do
    IFS=: read -r seq moments master <<< "$run"
    round=$((round + 1)) steps=${MASTER_STEPS:-7}
    log="$out/long-$seq-$moments-$master-$round.log"
    step "one sequence of $seq tokens a step, $moments moments, $master master: 3 warm-up + $steps measured steps"
    timeout 240 "${bench[@]}" --warmup=3 --steps=$steps --train.seq_len=$seq --train.global_batch=1 --train.micro_batch=1 \
      --optimizer.moments=$moments --train.master_weights=$master --output.dir=runs/long-$round > "$log" 2>&1 \
      || fail "bench at $seq tokens, $moments moments, $master master"
    grep -E "^estimated peak|error" "$log" | head -3 | tee -a "$out/summary.log"
    sed -n '/^bench:/,$p' "$log" | head -12 | tee -a "$out/summary.log"
  done
fi

if [ "$what" = resume ] || [ "$what" = all ]; then
  tiny=(build-gpu/marrow train configs/tiny-moe.toml --data.path=.gpu-carry/demo/corpus --train.steps=20 --schedule.warmup_steps=5
        --train.device=cuda --train.master_weights=split --checkpoint.every=10)
  rm -rf runs/master-straight runs/master-resumed
  step "tiny model on the GPU, split master: 20 steps, then step 10 resumed to 20"
  "${tiny[@]}" --output.dir=runs/master-straight > "$out/resume.log" 2>&1 || fail "straight run"
  "${tiny[@]}" --output.dir=runs/master-resumed --checkpoint.resume=runs/master-straight/step-00000010 >> "$out/resume.log" 2>&1 \
    || fail "resumed run"
  grep -E "^memory|resuming|error" "$out/resume.log" | head -4 | tee -a "$out/summary.log"
  python3 - runs/master-straight runs/master-resumed <<'PY' | tee -a "$out/summary.log"
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
print(f"steps 11-20: losses equal bit for bit: {same_losses}; step 20: {len(files(a))} files, equal sha256: {same_files}; "
      f"weights {dtypes(a, 'weights')}")
sys.exit(0 if same_losses and same_files and dtypes(a, "weights") == {"F32"} else 1)
PY
  [ "${PIPESTATUS[0]}" -eq 0 ] || fail "the resumed run differs, or the weights' dtype"
  step "the same 20 steps with the fp32 master: the losses side by side (a split master weight exactly halfway between two bf16 values above an odd one moves a unit, ~1 in 131,072 a step)"
  rm -rf runs/master-fp32-tiny
  "${tiny[@]}" --train.master_weights=fp32 --checkpoint.every=0 --output.dir=runs/master-fp32-tiny >> "$out/resume.log" 2>&1 || fail "fp32 run"
  python3 - runs/master-straight runs/master-fp32-tiny <<'PY' | tee -a "$out/summary.log"
import json, sys
a, b = ([m["loss"] for m in map(json.loads, open(f"{run}/metrics.jsonl"))] for run in sys.argv[1:3])
print(f"tiny model, 20 steps: {sum(x == y for x, y in zip(a, b))} of {len(a)} losses the same bits with the split and the fp32 master; "
      f"largest relative difference {max(abs(x - y) / y for x, y in zip(a, b)):.1e}")
PY
fi

if [ "$what" = trace ]; then
  for master in fp32 split; do
    step "kernel trace of one bench step after 2 warm-up, $master master"
    "${bench[@]}" --warmup=2 --steps=1 --profile-steps=3:3 --train.master_weights=$master --output.dir=runs/trace-$master \
      > "$out/trace-$master.log" 2>&1 || fail "trace with the $master master"
    gzip -c runs/trace-$master/bench/trace-steps-3-3.json > "$out/trace-$master.json.gz" 2>/dev/null
  done
  python3 - "$out/trace-fp32.json.gz" "$out/trace-split.json.gz" <<'PY' | tee -a "$out/summary.log"
import collections, gzip, json, sys
def sums(path):
    events = json.load(gzip.open(path))
    events = events["traceEvents"] if isinstance(events, dict) else events
    out = collections.defaultdict(lambda: [0, 0.0])
    for e in events:
        if e.get("ph") == "X" and ("adamw" in e["name"] or e["name"] in ("optimizer", "step 3") or "sum_squares" in e["name"]):
            out[e["name"][:60]][0] += 1
            out[e["name"][:60]][1] += e["dur"] / 1e3
    return out
a, b = (sums(p) for p in sys.argv[1:3])
for name in sorted(set(a) | set(b)):
    print(f"{name:60s} fp32 {a[name][0]:3d} x {a[name][1]:8.3f} ms   split {b[name][0]:3d} x {b[name][1]:8.3f} ms")
PY
fi

long16=(--train.seq_len=16384 --train.global_batch=1 --train.micro_batch=1)
if [ "$what" = steps ]; then
  step "kernel trace of steps 3-8, one sequence of 16,384"
  "${bench[@]}" --warmup=2 --steps=6 --profile-steps=3:8 "${long16[@]}" --output.dir=runs/steps-16384 > "$out/steps-16384.log" 2>&1 \
    || fail "trace of steps 3-8"
  grep -E "^step|^bench" "$out/steps-16384.log" | tee -a "$out/summary.log"
  gzip -c runs/steps-16384/bench/trace-steps-3-8.json > "$out/trace-16384-steps-3-8.json.gz"
  python3 - "$out/trace-16384-steps-3-8.json.gz" <<'PY' | tee -a "$out/summary.log"
import collections, gzip, json, sys
events = json.load(gzip.open(sys.argv[1]))
events = events["traceEvents"] if isinstance(events, dict) else events
steps = sorted((e for e in events if e.get("ph") == "X" and e["name"].startswith("step ")), key=lambda e: e["ts"])
kernels = [e for e in events if e.get("ph") == "X" and e.get("cat") in ("kernel", "memset", "memcpy")]
per = []
for s in steps:
    by = collections.defaultdict(float)
    for e in kernels:
        if s["ts"] <= e["ts"] < s["ts"] + s["dur"]:
            by[e["name"][:55]] += e["dur"] / 1e3
    per.append(by)
print("steps: " + "  ".join(f"{s['name']} {s['dur'] / 1e3:.1f} ms" for s in steps))
names = sorted(set().union(*per), key=lambda n: -(max(p.get(n, 0) for p in per) - min(p.get(n, 0) for p in per)))
for n in names[:12]:
    print(f"{n:55s} " + " ".join(f"{p.get(n, 0):7.2f}" for p in per))
PY
fi

if [ "$what" = power ]; then
  power_args=(${POWER_ARGS-${long16[*]}})
  step "nvidia-smi every 50 ms during 3 + 12 steps, bench arguments: ${power_args[*]:-(the bench config)}"
  nvidia-smi --query-gpu=timestamp,clocks.sm,clocks.mem,power.draw,power.limit,temperature.gpu,clocks_event_reasons.active \
    --format=csv -lms 50 > "$out/smi.csv" 2>&1 &
  smi=$!
  "${bench[@]}" --warmup=3 --steps=12 "${power_args[@]}" --output.dir=runs/power > "$out/power.log" 2>&1 || fail "bench under nvidia-smi"
  kill $smi
  grep -E "^step|^bench" "$out/power.log" | tee -a "$out/summary.log"
  python3 - "$out/smi.csv" <<'PY' | tee -a "$out/summary.log"
import csv, statistics, sys
rows = [r for r in list(csv.reader(open(sys.argv[1]), skipinitialspace=True))[1:] if len(r) > 6 and "MHz" in r[1]]
load = [(int(r[1].split()[0]), float(r[3].split()[0]), float(r[4].split()[0]), r[6]) for r in rows if float(r[3].split()[0]) > 400]
if load:
    print(f"{len(load)} samples under load: SM clock mean {statistics.mean(v[0] for v in load):.0f} MHz "
          f"(min {min(v[0] for v in load)}, max {max(v[0] for v in load)}), power mean {statistics.mean(v[1] for v in load):.0f} W "
          f"against {load[0][2]:.0f} W, clock event reasons {sorted(set(v[3] for v in load))}")
PY
fi

if [ $status -eq 0 ]; then echo PASS | tee -a "$out/summary.log"; else echo FAIL | tee -a "$out/summary.log"; fi
exit $status
