# Sourced by the GPU run scripts after they set `out` (and `ranks` where a run takes more than two
# processes): the environment of the GPU machine, the summary log helpers, the launcher, and the build
# (build-gpu/marrow; exits with FAIL when it does not build). Sets marrow, python, corpus, mpi and runs
# (where the runs' output directories go).
# DRY_RUN=1 (the several-GPU scripts' own test, tests/python/test_tools.py): no build and no GPU; the
# CPU build's binary (MARROW, default build-cpu/marrow), its demo corpus (MARROW_DEMO_CORPUS), .venv's
# python (PYTHON) and mpirun --oversubscribe. The scripts then swap the model for a tiny one.
mkdir -p "$out"
cd "$(dirname "${BASH_SOURCE[0]}")/.."
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
status=0
step() { echo "== [$(date +%T)] $*" | tee -a "$out/summary.log"; }
fail() { echo "FAILED: $*" | tee -a "$out/summary.log"; status=1; }
dry=${DRY_RUN:-0}

# Every run directory given has the same losses, bit for bit.
same_losses() {
  python3 - "$@" <<'PY'
import json, sys
runs = [[json.loads(x)["loss"] for x in open(f"{d}/bench/metrics.jsonl")] for d in sys.argv[1:]]
same = all(r == runs[0] for r in runs)
print(f"{len(runs)} runs of {len(runs[0])} steps: the same losses bit for bit: {same}; first three {runs[0][:3]}")
sys.exit(0 if same else 1)
PY
}

if [ "$dry" = 1 ]; then
  export OMPI_MCA_btl_vader_single_copy_mechanism=none
  marrow=${MARROW:-build-cpu/marrow} python=${PYTHON:-.venv/bin/python}
  corpus=${MARROW_DEMO_CORPUS:-build-cpu/demo-corpus}/corpus runs=$out/runs
  mpi=(mpirun --allow-run-as-root --oversubscribe --bind-to none -np "${ranks:-2}")
  step "dry run on the CPU: $marrow, the tiny model, no kernel traces, no marrow check (it needs a GPU)"
  return 0
fi

export PKG_CONFIG_PATH=$PWD/.gpu-carry/libs/lib/pkgconfig
marrow=build-gpu/marrow python=python3 corpus=.gpu-carry/qwen3 runs=runs
mpi=(mpirun --allow-run-as-root --bind-to none -np "${ranks:-2}")
step "build (commit $(cat .gpu-carry/commit 2>/dev/null || echo unknown: rerun tools/gpu_prepare.sh))"
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader | tee -a "$out/summary.log"
if ! { cmake -S . -B build-gpu -G Ninja -DMARROW_CUDA=ON -DMARROW_PYTHON=python3 && ninja -C build-gpu marrow; } > "$out/build.log" 2>&1; then
  grep -E "error|Error" "$out/build.log" | head -40; echo FAIL; exit 1
fi
rm -f "$out/build.log"
