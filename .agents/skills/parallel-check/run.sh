#!/usr/bin/env bash
# The CPU side of parallel-check (SKILL.md): builds, runs the multi-process tests. Ends with PASS or FAIL.
# usage: run.sh [build-dir]   (default: build, made by tools/build.sh)
set -uo pipefail
cd "$(dirname "$0")/../../.."
build=${1:-build}
[ -f "$build/build.ninja" ] || tools/build.sh >/dev/null || { echo "build failed"; echo FAIL; exit 1; }
ninja -C "$build" marrow parallel_check > /dev/null || { echo "build failed"; echo FAIL; exit 1; }
corpus=$build/demo-corpus
[ -f "$corpus/corpus/manifest.json" ] || tools/make_demo_corpus.sh "$build/marrow" "$corpus" > /dev/null
status=0
ctest --test-dir "$build" -R '^parallel\.' --output-on-failure || status=1
log=$(mktemp)
MARROW_DEMO_CORPUS=$corpus timeout 1200 .venv/bin/python tests/python/test_parallel.py --marrow "$build/marrow" --build-dir "$build" > "$log" 2>&1 \
  || status=1
grep -E "^(FAILED|FAIL)" "$log"
grep -c "^ok" "$log" | sed 's/$/ checks of test_parallel.py ok/'
rm -f "$log"
if [ $status -eq 0 ]; then echo PASS; else echo FAIL; fi
exit $status
