#!/usr/bin/env bash
# Traces two bench steps after two warm-up steps and prints the ten heaviest kernels (see SKILL.md).
# usage: run.sh <marrow-binary> <run-config> <log-dir> [--section.key=value ...]
# Writes <log-dir>/profile.log; the trace is <output.dir>/bench/trace-steps-3-4.json. Ends with PASS or FAIL.
set -uo pipefail
[ $# -ge 3 ] || { echo "usage: $0 <marrow-binary> <run-config> <log-dir> [--section.key=value ...]"; echo FAIL; exit 2; }
marrow=$1 config=$2 logs=$3
shift 3
mkdir -p "$logs"
log=$logs/profile.log
finish() { echo "$1"; [ "$1" = PASS ]; exit $?; }

"$marrow" bench "$config" --warmup=2 --steps=2 --profile-steps=3:4 "$@" > "$log" 2>&1
code=$?
[ $code -eq 0 ] || { tail -5 "$log"; echo "marrow bench exited with $code (log: $log)"; finish FAIL; }
grep "^warning" "$log"
trace=$(sed -n 's/^kernel trace: \([^ ]*\) .*/\1/p' "$log" | tail -1)
[ -n "$trace" ] && [ -f "$trace" ] || { echo "no trace was written (log: $log)"; finish FAIL; }
python3 - "$trace" <<'PY' || finish FAIL
import json, sys
with open(sys.argv[1]) as f:
    events = json.load(f)["traceEvents"]
kernels = sum(1 for e in events if e.get("ph") == "X" and e.get("cat") == "kernel")
ranges = sum(1 for e in events if e.get("ph") == "X" and e.get("cat") == "nvtx")
print(f"{sys.argv[1]}: valid JSON, {kernels} kernel events, {ranges} NVTX ranges")
sys.exit(0 if kernels > 0 else 1)
PY
awk '/^top [0-9]+ kernels by total time/ { table = 1 } table && !/^(top|all|other|memcpy)/ && !/ [0-9.]+%$/ { exit } table' "$log"
grep "^bench:" "$log" | sed 's/$/ (with CUPTI attached)/'
finish PASS
