#!/usr/bin/env python3
"""Compares two `marrow check` logs row by row (before and after a change, on the same card).

usage: tools/compare_checks.py <before-check.log> <after-check.log>

A row is `name  error  bound  ok|FAIL`. Prints the counts of each side, the rows that passed before
and fail or are missing after, and the rows new after. Ends with PASS when every row that passed
before passes after, else FAIL. Repeated names (a row printed twice) are compared as multisets.
"""
import collections
import sys


def rows(path):
    passed, failed, errors = collections.Counter(), collections.Counter(), collections.defaultdict(list)
    for line in open(path, errors="replace"):
        parts = line.split()
        if len(parts) < 4 or parts[-1] not in ("ok", "FAIL"):
            continue
        try:
            float(parts[-2]), float(parts[-3])
        except ValueError:
            continue
        name = " ".join(parts[:-3])
        (passed if parts[-1] == "ok" else failed)[name] += 1
        errors[name].append(parts[-3])
    return passed, failed, errors


def main():
    if len(sys.argv) != 3:
        sys.exit(__doc__)
    (bp, bf, be), (ap, af, ae) = rows(sys.argv[1]), rows(sys.argv[2])
    print(f"before: {sum(bp.values())} passed, {sum(bf.values())} failed")
    print(f"after:  {sum(ap.values())} passed, {sum(af.values())} failed")
    lost = bp - ap
    for name, n in sorted(lost.items()):
        print(f"passed before, {'FAILS' if af[name] else 'missing'} after: {name}" + (f" (x{n})" if n > 1 else ""))
    new = (ap + af) - (bp + bf)
    for name, n in sorted(new.items()):
        print(f"new after ({'ok' if ap[name] else 'FAIL'}): {name}")
    common = [n for n in be if n in ae]
    moved = [n for n in common if be[n] != ae[n]]
    print(f"{len(common) - len(moved)} of {len(common)} rows in both kept their error to the digit")
    for name in sorted(moved):
        print(f"error moved: {name}: {' '.join(be[name])} -> {' '.join(ae[name])}")
    print("PASS" if not lost else "FAIL")
    sys.exit(0 if not lost else 1)


main()
