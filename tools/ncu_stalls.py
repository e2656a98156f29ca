#!/usr/bin/env python3
"""Where a kernel's warps wait, from Nsight Compute's per-instruction source page (the sass.csv that
tools/gpu_ncu_source.sh writes): the stall samples by reason, by opcode, and by runs of consecutive
instructions (--runs N: blocks of N SASS lines with their share of the samples and the most executed
count in them, which tells a loop body from a prologue or epilogue).

  tools/ncu_stalls.py <sass.csv> [--top K] [--runs N]
"""
import argparse
import collections
import csv
import sys


def read(path):
    rows = list(csv.reader(open(path, newline="")))
    header_at = next((i for i, r in enumerate(rows) if "Address" in r and "Source" in r), None)
    if header_at is None:
        sys.exit(f"{path}: no 'Address' and 'Source' columns: not an ncu source page in CSV")
    header = rows[header_at]
    index = {name: i for i, name in enumerate(header)}
    records = []
    for r in rows[header_at + 1 :]:
        if len(r) < len(header):
            continue
        words = r[index["Source"]].split()
        opcode = (words[1] if words and words[0].startswith("@") and len(words) > 1 else (words[0] if words else "")).split(".")[0]
        stalls = {h[len("stall_") :]: int(r[index[h]] or 0) for h in header if h.startswith("stall_") and "Not Issued" not in h}
        records.append((opcode, int(r[index["Warp Stall Sampling (All Samples)"]] or 0), int(r[index["Instructions Executed"]] or 0), stalls))
    return records


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("csv")
    parser.add_argument("--top", type=int, default=8)
    parser.add_argument("--runs", type=int, default=0)
    args = parser.parse_args()
    records = read(args.csv)
    total = sum(n for _, n, _, _ in records)
    if total == 0:
        sys.exit(f"{args.csv}: no stall samples")
    by_reason, by_opcode = collections.Counter(), collections.defaultdict(collections.Counter)
    for opcode, _, _, stalls in records:
        for reason, n in stalls.items():
            by_reason[reason] += n
            by_opcode[opcode][reason] += n
    print(f"{total} samples over {len(records)} instructions")
    print("by reason:")
    for reason, n in by_reason.most_common(args.top):
        print(f"  {reason:22s} {100 * n / total:5.1f}%")
    print("by opcode (its top reasons):")
    for opcode, reasons in sorted(by_opcode.items(), key=lambda kv: -sum(kv[1].values()))[: args.top]:
        top = ", ".join(f"{r} {100 * n / total:.1f}" for r, n in reasons.most_common(3) if n)
        print(f"  {opcode:12s} {100 * sum(reasons.values()) / total:5.1f}%  {top}")
    if args.runs:
        print(f"runs of {args.runs} instructions with at least 1% of the samples (first line, share, most executed):")
        for start in range(0, len(records), args.runs):
            run = records[start : start + args.runs]
            n = sum(r[1] for r in run)
            if n >= total / 100:
                ops = collections.Counter()
                for opcode, samples, _, _ in run:
                    ops[opcode] += samples
                print(f"  {start:6d} {100 * n / total:5.1f}% {max(r[2] for r in run):10d}  {', '.join(o for o, _ in ops.most_common(3))}")


if __name__ == "__main__":
    main()
