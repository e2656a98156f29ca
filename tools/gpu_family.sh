#!/usr/bin/env bash
# A model family's GPU must-show on one H100 (issues #50 and #53): its kernels' check rows, then its bench config
# trained by marrow bench and, in the same command, by its PyTorch peer (tools/reference_run.py bench:
# transformers' model class, fp32 master weights, bf16 autocast, grouped_mm experts, fused AdamW) on the same
# config, corpus and batches. Run on the GPU machine from the repository root after tools/gpu_prepare.sh here
# (device tool, carry [".gpu-carry"]), directly or as a tools/gpu_batch.sh part:
#   tools/gpu_family.sh <log-dir> <family> [check|bench|kernels|all]          (default bench)
# family: deepseek-v2 (configs/bench-deepseek-v2-h100.toml: V2-Lite's layer shape, 5 layers; goal 2x the peer)
#         qwen3-5-moe (configs/bench-qwen3-5-moe-h100.toml: 35B-A3B's layer shape, 3 layers; goal 1.5x; the peer
#         runs transformers' chunked delta rule from flash-linear-attention when .gpu-carry/wheels holds its
#         wheels (tools/gpu_prepare.sh puts them there), with transformers 5.24 if the machine's lacks the family)
# check (~5-6 min with a fresh build, ~2 min of it the build): the marrow check groups that hold the family's
#        rows (marrow check filters by group only): every row must pass; the summary counts the new ones
#        (DeepSeek: mla_*, router_* with its options, attention D192 Dv128, the tiny model's; Qwen3.5: the
#        linear_attention group, the zero-centred norm and partial RoPE rows (elementwise), attention D256, the
#        tiny model's)
# bench (~7-8 min with a fresh build): the marrow estimate line; marrow bench, 3 warm-up + 20 measured
#        steps (+5 stage-timed) on .gpu-carry/qwen3; then reference_run.py init --init-device cuda (drawn on
#        the GPU, written in 2 GB shards), bench --attention auto (3 candidates x 3 steps, then 3 + 20 steps)
#        and, unless TORCH_COMPILE=0 or fewer than 150 s of a 570 s budget are left (SECONDS counts the
#        build), the same with --compile layers (under a timeout of what is left, at most 240 s); both sides'
#        losses must be finite and fall (mean of the last 5 below that of the first 3); the summary gives both
#        tokens/s, the ratio against the faster PyTorch run, and each side's MFU from one FLOP count: 6 x active
#        parameters (LM head included) + the family's attention FLOPs (models/*.h attention_flops_per_token;
#        reference_run.py flops_per_token) against the card's dense bf16 peak (H100 SXM and H200: 989 TFLOP/s;
#        H100 PCIe 756; PEAK_TFLOPS overrides)
# kernels (~3 min with a fresh build): marrow bench --kernels mla (DeepSeek: cuDNN's attention at q/k 192, v
#        128) or gated_delta (Qwen3.5: the chunked delta rule's forward and backward at the bench shape).
# quick: check (CHECK_GROUPS may cut it), kernels, and marrow bench alone (no peer, no summary's ratio), in one call.
# all: check then bench: past one call's 10 minutes on a fresh machine: run check, then bench in a second
#        call on the same warm machine (build-gpu/ stays, the build is then seconds).
# DRY_RUN=1: the bench part on the CPU (build-cpu/marrow, the demo corpus, the family's tiny config at S 64) to
# try the script's plumbing here. Ends with PASS or FAIL (a run that broke; the ratio's goal is reported, not required); logs in <log-dir>.
set -uo pipefail
out=${1:-$OUT}
family=${2:-deepseek-v2}
what=${3:-bench}
case "$family" in
  deepseek-v2) tiny=configs/tiny-deepseek-v2.toml goal=2 kernels=mla groups="elementwise attention model" ;;
  qwen3-5-moe) tiny=configs/tiny-qwen3-5-moe.toml goal=1.5 kernels=gated_delta groups="linear_attention elementwise attention model" ;;
  *) echo "unknown family '$family' (deepseek-v2 or qwen3-5-moe)"; echo FAIL; exit 1 ;;
esac
groups=${CHECK_GROUPS:-$groups}  # CHECK_GROUPS="linear_attention model": fewer groups when device time is short
source "$(dirname "$0")/gpu_common.sh"
config=configs/bench-$family-h100.toml
common=(--data.path="$corpus" --checkpoint.every=0)
torch_dev=(--device=cuda) init_dev=(--init-device=cuda --shard-size=2GB) attention=auto compile=${TORCH_COMPILE:-1}
warmup=3 steps=20
if [ "$dry" = 1 ]; then
  config=$tiny
  common+=(--train.seq_len=64 --train.device=cpu --train.global_batch=4 --train.micro_batch=2 --eval.every=0)
  torch_dev=(--device=cpu) init_dev=(--init-device=cpu) attention=sdpa compile=0 warmup=1 steps=4
  [ "$what" = bench ] || { echo "DRY_RUN=1 runs the bench part only"; echo FAIL; exit 1; }
fi
export PYTHONUNBUFFERED=1 PYTORCH_CUDA_ALLOC_CONF=${PYTORCH_CUDA_ALLOC_CONF:-expandable_segments:True}
card=$(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | head -1)
card=${card:-cpu}
case "$card" in *H100*PCIe*) peak_default=756 ;; *) peak_default=989 ;; esac
peak=${PEAK_TFLOPS:-$peak_default}

# Qwen3.5's peer: flash-linear-attention's kernels (and transformers 5.24 where the machine's lacks the family),
# installed from the carried wheels into a directory on PYTHONPATH.
if [ "$family" = qwen3-5-moe ] && [ "$dry" != 1 ] && ls .gpu-carry/wheels/*.whl > /dev/null 2>&1; then
  wanted=(.gpu-carry/wheels/fla*.whl .gpu-carry/wheels/flash_linear_attention*.whl)
  $python -c "import transformers.models.qwen3_5_moe" 2> /dev/null || wanted+=(.gpu-carry/wheels/transformers-*.whl)
  $python -m pip install -q --no-deps --target "$PWD/.peer-packages" "${wanted[@]}" > "$out/peer-packages.log" 2>&1 \
    && export PYTHONPATH=$PWD/.peer-packages${PYTHONPATH:+:$PYTHONPATH}
  tail -2 "$out/peer-packages.log" | tee -a "$out/summary.log"
fi

if [ "$what" = check ] || [ "$what" = all ] || [ "$what" = quick ]; then
  for group in $groups; do
    step "marrow check --only $group"
    timeout 420 "$marrow" check --only $group > "$out/check-$group.log" 2>&1
    grep -E "FAIL|checks,|error" "$out/check-$group.log" | head -30 | tee -a "$out/summary.log"
    grep -q '^PASS$' "$out/check-$group.log" || fail "marrow check --only $group"
  done
  { echo "new rows (all passed unless listed above):"
    if [ "$family" = deepseek-v2 ]; then
      echo "  mla_*: $(grep -cE '^mla_' "$out/check-elementwise.log")"
      echo "  router_* with DeepSeek's options: $(grep -cE '^router_.* groups [0-9]+ top' "$out/check-elementwise.log")"
      echo "  attention ... D192 Dv128: $(grep -cE '^attention.*D192 Dv128' "$out/check-attention.log")"
      echo "  tiny deepseek_v2 model: $(grep -cE 'deepseek_v2' "$out/check-model.log")"
    else
      echo "  linear_attention group: $(grep -cE ' ok$' "$out/check-linear_attention.log")"
      echo "  attention ... D256: $(grep -cE '^attention.*D256' "$out/check-attention.log")"
      echo "  tiny qwen3_5_moe model: $(grep -cE 'qwen3_5' "$out/check-model.log")"
    fi; } | tee -a "$out/summary.log"
fi

if [ "$what" = kernels ] || [ "$what" = quick ]; then
  step "marrow bench --kernels $kernels"
  timeout 300 "$marrow" bench --kernels $kernels > "$out/kernels-$kernels.log" 2>&1 || fail "marrow bench --kernels $kernels"
  tee -a "$out/summary.log" < "$out/kernels-$kernels.log"
fi

if [ "$what" = bench ] || [ "$what" = all ] || [ "$what" = quick ]; then
  ours=$runs/$family-marrow hf=$runs/$family-hf
  rm -rf "$ours"
  step "marrow estimate $config"
  "$marrow" estimate $config "${common[@]}" > "$out/estimate.log" 2>&1 || fail "marrow estimate"
  grep -E "^model:|^trainer's peak|^total|^fits" "$out/estimate.log" | head -4 | tee -a "$out/summary.log"

  step "marrow bench $config: $warmup warm-up + $steps measured steps"
  timeout 300 "$marrow" bench $config "${common[@]}" --warmup=$warmup --steps=$steps --output.dir="$ours" > "$out/marrow-bench.log" 2>&1 \
    || fail "marrow bench"
  grep -E "^model|^estimated peak|error" "$out/marrow-bench.log" | head -3 | tee -a "$out/summary.log"
  sed -n '/^bench:/,$p' "$out/marrow-bench.log" | head -12 | tee -a "$out/summary.log"
fi

if [ "$what" = bench ] || [ "$what" = all ]; then

  $python -c "import torch, transformers; print(f'torch {torch.__version__}, transformers {transformers.__version__}')" 2>&1 | tail -1 \
    | tee -a "$out/summary.log"
  step "reference_run.py init (${init_dev[*]})"
  rm -rf "$hf"
  timeout 300 $python tools/reference_run.py init $config "$hf" "${common[@]}" "${init_dev[@]}" > "$out/torch-init.log" 2>&1 \
    || fail "reference_run.py init"
  grep -E "initial weights|rror" "$out/torch-init.log" | tail -3 | tee -a "$out/summary.log"

  torch_bench() {  # torch_bench <name> <timeout> <args...>
    local name=$1 limit=$2
    step "reference_run.py bench ($name): $warmup warm-up + $steps measured steps"
    timeout "$limit" $python tools/reference_run.py bench $config "$hf" "${common[@]}" "${torch_dev[@]}" --warmup=$warmup --steps=$steps \
      --peak-tflops="$peak" --json="$out/torch-$name.json" "${@:3}" > "$out/torch-$name.log" 2>&1
    local code=$?
    grep -E "^attention|^torch bench|rror|out of memory" "$out/torch-$name.log" | tail -6 | tee -a "$out/summary.log"
    [ $code -eq 0 ] || { echo "reference_run.py bench ($name) exited $code" | tee -a "$out/summary.log"; rm -f "$out/torch-$name.json"; }
  }
  [ -f "$hf/config.json" ] && torch_bench eager 300 --attention=$attention
  if [ "$compile" = 1 ] && [ -f "$out/torch-eager.json" ]; then
    left=$((570 - SECONDS))  # of one device call's 600 s, the summary's few seconds kept
    if [ $left -ge 150 ]; then
      chosen=$(python3 -c "import json, sys; print(json.load(open(sys.argv[1]))['attention'])" "$out/torch-eager.json")
      torch_bench compiled $((left < 240 ? left : 240)) --attention="$chosen" --compile=layers
    else
      echo "torch.compile run skipped: $SECONDS s into the script, it needs ~150-240 s of the call's 600" | tee -a "$out/summary.log"
    fi
  fi

  step "summary"
  python3 - "$out" "$ours/bench/metrics.jsonl" "$peak" "$card" "$warmup" "$steps" "$goal" <<'PY' | tee -a "$out/summary.log"
import json, math, os, re, sys
out, metrics, peak, card = sys.argv[1], sys.argv[2], float(sys.argv[3]), sys.argv[4]
warmup, steps, goal = int(sys.argv[5]), int(sys.argv[6]), float(sys.argv[7])
bad = []
line = next((l for l in open(os.path.join(out, "marrow-bench.log")) if l.startswith("bench:")), "") if os.path.exists(os.path.join(out, "marrow-bench.log")) else ""
m_tps = float(re.search(r"\| (\d+) tokens/s", line).group(1)) if line else None
m_losses = [json.loads(x)["loss"] for x in open(metrics)][:warmup + steps] if os.path.exists(metrics) else []
torch_runs = {}
for name in ("eager", "compiled"):
    path = os.path.join(out, f"torch-{name}.json")
    if os.path.exists(path):
        torch_runs[name] = json.load(open(path))

def falling(name, losses):
    finite = bool(losses) and all(math.isfinite(x) for x in losses)
    ok = finite and len(losses) == warmup + steps and sum(losses[-5:]) / 5 < sum(losses[:3]) / 3
    head = ", ".join(f"{x:.4f}" for x in losses[:3]); tail = ", ".join(f"{x:.4f}" for x in losses[-3:])
    print(f"{name} losses ({len(losses)} steps): {head} ... {tail}: {'finite and falling' if ok else 'NOT finite and falling'}")
    if not ok:
        bad.append(f"{name} losses")

falling("marrow", m_losses)
for name, r in torch_runs.items():
    falling(f"torch {name}", r["losses"])
if m_losses and torch_runs:
    t = next(iter(torch_runs.values()))["losses"]
    n = min(len(t), len(m_losses))
    worst = max(abs(a - b) / abs(a) for a, b in zip(m_losses[:n], t[:n]))
    print(f"marrow and torch step by step (other initialisations of one distribution, same batches): worst relative difference {worst:.3g}")
    print("  " + " ".join(f"{a:.3f}/{b:.3f}" for a, b in zip(m_losses[:n], t[:n])))
if m_tps is None:
    bad.append("no marrow bench line")
if not torch_runs:
    bad.append("no PyTorch bench result")
if m_tps is not None and torch_runs:
    best_name, best = max(torch_runs.items(), key=lambda kv: kv[1]["tokens_per_s"])
    fpt = best["flops_per_token"]
    mfu = lambda tps: 100 * tps * fpt / (peak * 1e12)
    ratio = m_tps / best["tokens_per_s"]
    print(f"FLOP count: {fpt / 1e9:.4f} GFLOP a token = 6 x {best['active_parameters'] / 1e6:.2f}M active parameters "
          f"+ attention {(fpt - 6 * best['active_parameters']) / 1e9:.4f} GFLOP; peak {peak:g} TFLOP/s ({card})")
    for name, r in torch_runs.items():
        print(f"torch {name}: {r['tokens_per_s']:.0f} tokens/s, {r['ms_per_step']:.1f} ms/step, MFU {mfu(r['tokens_per_s']):.1f}%, "
              f"peak {r['peak_gib']:.2f} GiB, attention {r['attention']}, compile {r['compile']}, torch {r['torch']}")
    print(f"summary: marrow {m_tps:.0f} tokens/s (MFU {mfu(m_tps):.1f}%) | torch {best['tokens_per_s']:.0f} tokens/s "
          f"(MFU {mfu(best['tokens_per_s']):.1f}%, {best_name}, attention {best['attention']}) | ratio {ratio:.2f} (goal >= {goal:g}: "
          f"{'met' if ratio >= goal else 'NOT met'})")
if bad:
    print("FAILED: " + "; ".join(bad))
sys.exit(1 if bad else 0)
PY
  [ "${PIPESTATUS[0]}" -eq 0 ] || status=1
fi

# The device tool brings back at most 8 files: every log but the summary goes into one archive.
logs=$(cd "$out" && ls -- *.log *.json 2>/dev/null | grep -vx summary.log)
[ -n "$logs" ] && (cd "$out" && tar -czf $family-logs.tgz $logs && rm -f $logs)
[ $status -eq 0 ] && echo PASS || echo FAIL
exit $status
