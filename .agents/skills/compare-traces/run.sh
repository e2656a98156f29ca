#!/usr/bin/env bash
# Kernel ms per step of two traces side by side (see SKILL.md). Ends with PASS or FAIL.
# usage: run.sh <before-trace> <after-trace> [--steps N] [--top K] [--match REGEX]
set -uo pipefail
[ $# -ge 2 ] || { echo "usage: $0 <before-trace> <after-trace> [--steps N] [--top K] [--match REGEX]"; echo FAIL; exit 2; }
for f in "$1" "$2"; do [ -f "$f" ] || { echo "no such trace: $f"; echo FAIL; exit 1; }; done
python3 "$(dirname "$0")/compare.py" "$@"
