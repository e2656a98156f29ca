# Sourced by the two-GPU scripts (gpu_parallel.sh, gpu_fsdp.sh, gpu_pipeline.sh) after they set
# `out`: the environment of the GPU machine, the summary log helpers, the two-process launcher, and
# the build (build-gpu/marrow; exits with FAIL when it does not build).
mkdir -p "$out"
cd "$(dirname "${BASH_SOURCE[0]}")/.."
export PKG_CONFIG_PATH=$PWD/.gpu-carry/pcre2/lib/pkgconfig OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
status=0
step() { echo "== [$(date +%T)] $*" | tee -a "$out/summary.log"; }
fail() { echo "FAILED: $*" | tee -a "$out/summary.log"; status=1; }
mpi=(mpirun --allow-run-as-root --bind-to none -np 2)

step "build (commit $(cat .gpu-carry/commit 2>/dev/null || echo unknown: rerun tools/gpu_prepare.sh))"
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader | tee -a "$out/summary.log"
if ! { cmake -S . -B build-gpu -G Ninja -DMARROW_CUDA=ON -DMARROW_PYTHON=python3 && ninja -C build-gpu marrow; } > "$out/build.log" 2>&1; then
  grep -E "error|Error" "$out/build.log" | head -40; echo FAIL; exit 1
fi
rm -f "$out/build.log"
