#!/usr/bin/env bash
# The reading budget (issue #49): Marrow stays readable in one sitting only while its map, its docs
# and its code stay under these sizes. Prints each size against its limit; ends with PASS, or FAIL
# when any limit is passed (CI runs it as the ctest `size_budget`). KB here is 1,000 bytes.
# usage: tools/check_sizes.sh [repo-root]
set -uo pipefail
cd "${1:-$(dirname "$0")/..}"
status=0
row() {  # what, size, limit, unit
  local verdict=ok
  [ "$2" -le "$3" ] || { verdict=OVER; status=1; }
  printf '%-34s %8d %8d %-6s %s\n' "$1" "$2" "$3" "$4" "$verdict"
}
bytes() { [ -f "$1" ] && wc -c < "$1" || echo 0; }
nonblank() { grep -cv '^[[:space:]]*$' "$@" /dev/null | awk -F: '{s += $NF} END {print s + 0}'; }

printf '%-34s %8s %8s %-6s\n' what size limit unit
row AGENTS.md "$(bytes AGENTS.md)" 12000 bytes
row README.md "$(bytes README.md)" 8000 bytes
row docs/performance.md "$(bytes docs/performance.md)" 40000 bytes
row docs/architecture.md "$(bytes docs/architecture.md)" 25000 bytes
mapfile -t sources < <(find src -type f \( -name '*.cpp' -o -name '*.h' -o -name '*.cu' -o -name '*.cuh' \) | sort)
row "src/ (${#sources[@]} files)" "$(nonblank "${sources[@]}")" 24000 lines
largest=0 largest_file=none
for f in "${sources[@]}"; do
  n=$(grep -cv '^[[:space:]]*$' "$f")
  [ "$n" -le 800 ] || row "$f" "$n" 800 lines
  [ "$n" -le "$largest" ] || { largest=$n largest_file=$f; }
done
row "largest: $largest_file" "$largest" 800 lines
if [ $status -eq 0 ]; then echo PASS; else echo FAIL; fi
exit $status
