#!/usr/bin/env bash
# Several GPU scripts in one device command (a machine start and a build shared), their logs packed
# into one file after each part, since the device tool returns at most 8 files of $OUT and nothing
# of a part that a later part's timeout kills:
#   tools/gpu_batch.sh <out> "<script> <mode>" ...
#   e.g. tools/gpu_batch.sh $OUT "gpu_context.sh check" "gpu_attention.sh checks"
# Part i logs under /tmp/marrow-logs/<i>-<script>-<mode>/; <out>/logs.tgz holds them all and
# <out>/summary.log every part's summary. Ends with PASS when every part passed, else FAIL.
set -uo pipefail
out=${1:?usage: tools/gpu_batch.sh <out> "<script> <mode>" ...}
shift
cd "$(dirname "$0")/.."
logs=/tmp/marrow-logs
mkdir -p "$out" "$logs"
status=0
i=0
for part in "$@"; do
  i=$((i + 1))
  set -- $part
  dir=$logs/$i-${1%.sh}-${2:-all}
  echo "#### part $i: $part ($(date +%T))" | tee -a "$out/summary.log"
  tools/$1 "$dir" "${2:-all}" "${@:3}" || status=1
  cat "$dir/summary.log" >> "$out/summary.log" 2>/dev/null
  tar czf "$out/logs.tgz" -C "$logs" .
done
echo "#### end ($(date +%T))" | tee -a "$out/summary.log"
if [ $status -eq 0 ]; then echo PASS; else echo FAIL; fi
exit $status
