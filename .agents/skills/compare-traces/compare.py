"""Kernel time per step of two kernel traces (marrow's --profile-steps Chrome JSON, plain or gzipped), side by side.

usage: compare.py <before-trace> <after-trace> [--steps N] [--top K] [--match REGEX] [--gaps]
Prints, per kernel name (first 80 characters), ms per step before and after, the difference, calls per step and the mean
duration of a call after; then the totals, the span of each trace and its busy time (the figures to compare when
kernels launch as programmatic dependents, whose durations include their wait for the kernel before them). Machines differ by a few percent in kernel speed: compare the kernels a change
touched, and read the untouched GEMMs' difference as the machine's.
--gaps adds where the GPU waited in each trace: the time between consecutive kernels, copies and memsets, split into
launch gaps (at most 3 us: back-to-back kernels) and longer ones (a wait for the host), the longer ones by the pair of
names around them.
"""
import argparse
import collections
import gzip
import json
import re
import sys


def kernel_times(path):
    opener = gzip.open if path.endswith(".gz") else open
    with opener(path, "rt") as f:
        events = json.load(f)["traceEvents"]
    total, calls = collections.Counter(), collections.Counter()
    for e in events:
        if e.get("ph") == "X" and e.get("cat") == "kernel":
            total[e["name"][:80]] += e["dur"]
            calls[e["name"][:80]] += 1
    return total, calls


SHORT_GAP_US = 3.0


def gpu_operations(path):
    opener = gzip.open if path.endswith(".gz") else open
    with opener(path, "rt") as f:
        events = json.load(f)["traceEvents"]
    return sorted((e for e in events if e.get("ph") == "X" and e.get("cat") in ("kernel", "memcpy", "memset")),
                  key=lambda e: e["ts"])


def span_and_busy(path):
    """Microseconds from the first GPU operation's start to the last one's end, and how much of it some operation ran.
    With dependent launches a kernel starts before the one it waits for has ended, so the per-kernel sums overstate
    the step: these two are the figures to compare then."""
    ops = gpu_operations(path)
    busy, end = 0.0, None
    for e in ops:
        start, stop = e["ts"], e["ts"] + e["dur"]
        if end is None or start >= end:
            busy += stop - start
            end = stop
        elif stop > end:
            busy += stop - end
            end = stop
    return (end - ops[0]["ts"] if ops else 0.0), busy


def gpu_waits(path, steps, top):
    """Prints the idle time per step between the GPU's operations (kernels, copies, memsets) of one trace."""
    ops = gpu_operations(path)
    short = long_ = 0.0
    short_count = 0
    pairs = collections.Counter()
    end, last = None, None
    for e in ops:
        if end is not None and e["ts"] > end:
            gap = e["ts"] - end
            if gap <= SHORT_GAP_US:
                short += gap
                short_count += 1
            else:
                long_ += gap
                pairs[(last["name"][:40], e["name"][:40])] += gap
        if end is None or e["ts"] + e["dur"] > end:
            end, last = e["ts"] + e["dur"], e
    print(f"{path}: GPU idle per step {(short + long_) / 1000 / steps:.2f} ms: launch gaps (<= {SHORT_GAP_US:g} us) "
          f"{short / 1000 / steps:.2f} ms in {short_count // steps} gaps, longer gaps {long_ / 1000 / steps:.2f} ms")
    for (a, b), us in pairs.most_common(top):
        print(f"  {us / steps:9.1f} us/step  {a} -> {b}")


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("before")
    parser.add_argument("after")
    parser.add_argument("--steps", type=int, default=2, help="steps in each trace (--profile-steps=3:4 traces 2)")
    parser.add_argument("--top", type=int, default=30)
    parser.add_argument("--match", default="", help="only kernels whose name matches this regex")
    parser.add_argument("--gaps", action="store_true", help="also where the GPU waited in each trace")
    args = parser.parse_args()
    before, _ = kernel_times(args.before)
    after, calls = kernel_times(args.after)
    if not before or not after:
        print(f"no kernel events in {args.before if not before else args.after}")
        print("FAIL")
        return 1
    scale = 1000.0 * args.steps  # microseconds over the traced steps -> ms per step
    names = sorted(set(before) | set(after), key=lambda n: -max(before[n], after[n]))
    names = [n for n in names if re.search(args.match, n)][:args.top]
    print(f"{'before':>9} {'after':>9} {'diff':>8} {'calls':>6} {'us/call':>9}  kernel (ms per step)")
    for n in names:
        per_call = after[n] / calls[n] if calls[n] else 0.0
        print(f"{before[n] / scale:9.2f} {after[n] / scale:9.2f} {(after[n] - before[n]) / scale:+8.2f} "
              f"{calls[n] // args.steps:6d} {per_call:9.1f}  {n}")
    b, a = sum(before.values()) / scale, sum(after.values()) / scale
    print(f"{b:9.2f} {a:9.2f} {a - b:+8.2f}  all kernels")
    (span_b, busy_b), (span_a, busy_a) = span_and_busy(args.before), span_and_busy(args.after)
    print(f"{span_b / scale:9.2f} {span_a / scale:9.2f} {(span_a - span_b) / scale:+8.2f}  span: first GPU operation to last")
    print(f"{busy_b / scale:9.2f} {busy_a / scale:9.2f} {(busy_a - busy_b) / scale:+8.2f}  busy: some operation running")
    if args.gaps:
        for path in (args.before, args.after):
            gpu_waits(path, args.steps, 8)
    print("PASS")
    return 0


if __name__ == "__main__":
    sys.exit(main())
