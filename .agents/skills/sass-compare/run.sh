#!/usr/bin/env bash
# The SASS of every kernel in one CUDA source, compiled from the working tree and from a base
# revision with the CUDA build's own flags, compared function by function: the check for a change
# that should not change the machine code (a kernel split into device functions, names, comments).
#   .agents/skills/sass-compare/run.sh src/ops/attention.cu [base-rev, default HEAD]
# Needs the CUDA build configured (tools/build.sh makes build/); fetches cuobjdump and nvdisasm
# (NVIDIA's PyPI wheels, ~30 MB) into .cache/cuda-sass/ on first use. Prints per kernel "identical"
# or its instruction counts that differ; ends with PASS when every kernel is identical, else FAIL.
set -euo pipefail
cd "$(dirname "$0")/../../.."
source=${1:?usage: run.sh <file.cu> [base-rev]}
base=${2:-HEAD}
tools=.cache/cuda-sass
if [ ! -x $tools/bin/cuobjdump ] || [ ! -x $tools/bin/nvdisasm ]; then
  mkdir -p $tools/wheels $tools/bin
  python=.venv/bin/python  # tools/setup.sh's, which has pip; Debian's python3 may not
  [ -x $python ] || python=python3
  $python -m pip download --no-deps -q -d $tools/wheels nvidia-cuda-cuobjdump nvidia-cuda-nvdisasm
  for wheel in $tools/wheels/*.whl; do python3 -m zipfile -e "$wheel" $tools/unpacked; done
  cp $tools/unpacked/nvidia/*/bin/cuobjdump $tools/unpacked/nvidia/*/bin/nvdisasm $tools/bin/
  chmod +x $tools/bin/*
fi
export PATH=$PWD/$tools/bin:$PATH
object=CMakeFiles/marrow_lib.dir/$source.o
command=$(ninja -C build -t commands "$object" | tail -1)
[ -n "$command" ] || { echo "no compile command for $object in build/ (configure the CUDA build first)"; echo FAIL; exit 1; }
work=$(mktemp -d)
trap 'git worktree remove --force "$work/base" >/dev/null 2>&1 || true; [ -n "${SASS_KEEP:-}" ] && cp "$work"/*.sass "$SASS_KEEP"/ ; rm -rf "$work"' EXIT
# The build's command with its object and dependency outputs replaced by a cubin of sm_90a.
compile() {  # <repo-root> <out.cubin>
  local cmd=${command//\/work\/main/$1}
  cmd=$(echo "$cmd" | sed -E 's#^\S*nvcc_guard.sh ##; s# -MD -MT \S+ -MF \S+##; s# -c (\S+) -o \S+# -cubin \1 -o '"$2"'#; s#--generate-code=\S+#--generate-code=arch=compute_90a,code=sm_90a#')
  (cd build && eval "$cmd")
}
compile "$PWD" "$work/tree.cubin"
git worktree add --detach -q "$work/base" "$base"
compile "$work/base" "$work/base.cubin"
cuobjdump -sass "$work/tree.cubin" > "$work/tree.sass"
cuobjdump -sass "$work/base.cubin" > "$work/base.sass"
python3 .agents/skills/sass-compare/compare.py "$work/base.sass" "$work/tree.sass"
