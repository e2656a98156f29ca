#!/usr/bin/env bash
# Runs a GPU script from the last commit's sources instead of the working tree the device tool copied,
# so that edits in progress here (other engineers, helpers) do not reach the GPU machine's build.
#   here:            tools/gpu_from_head.sh prepare     (after tools/gpu_prepare.sh: HEAD's sources into
#                                                        .gpu-carry/head.tar, .gpu-carry/commit = HEAD)
#   on the device:   tools/gpu_from_head.sh <script> [args...]   e.g. tools/gpu_from_head.sh tools/gpu_ab.sh $OUT check
# The sources unpack into ../marrow-head beside the copy (kept on a warm machine, so its build
# directories and runs/ carry over between calls; tar keeps the files' times, so ninja rebuilds nothing
# that did not change); its .gpu-carry is a link to this copy's.
set -euo pipefail
cd "$(dirname "$0")/.."
if [ "${1:-}" = prepare ]; then
  git archive --format=tar HEAD -- CMakeLists.txt src configs tests tools > .gpu-carry/head.tar
  git rev-parse --short HEAD > .gpu-carry/commit
  echo "HEAD $(cat .gpu-carry/commit) in .gpu-carry/head.tar ($(du -h .gpu-carry/head.tar | cut -f1))"
  exit 0
fi
[ -f .gpu-carry/head.tar ] || { echo "no .gpu-carry/head.tar: run tools/gpu_from_head.sh prepare here first"; echo FAIL; exit 1; }
head=$(cd .. && pwd)/marrow-head
mkdir -p "$head"
tar -x -C "$head" -f .gpu-carry/head.tar
ln -sfn "$PWD/.gpu-carry" "$head/.gpu-carry"
cd "$head"
exec "$@"
