#!/usr/bin/env python3
"""Issue #52's agreement between two runs' metrics.jsonl (marrow train and tools/reference_run.py).

  reference_compare.py <marrow-run> <reference-run> [--exported eval.json]

Prints the mean training loss of each window of 100 steps after the first 200 of both runs with
their relative gap, every common validation loss, and the tokens/s of each (the median step).
Passes (exit 0) when every window's gap is within 1% and the final validation losses within 0.5%;
with --exported (reference_run.py eval of the exported final model, bf16 in transformers), instead
when that held-out loss equals Marrow's own final evaluation within 1e-3 relative.
"""
import argparse
import json
import statistics
import sys


def metrics(run_dir):
    try:
        with open(f"{run_dir}/metrics.jsonl") as f:
            return {m["step"]: m for m in map(json.loads, f)}
    except OSError as e:
        sys.exit(f"reference_compare: error: cannot read {run_dir}/metrics.jsonl: {e.strerror}")


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("marrow_run")
    parser.add_argument("reference_run")
    parser.add_argument("--exported")
    parser.add_argument("--window", type=int, default=100)
    parser.add_argument("--skip", type=int, default=200)
    args = parser.parse_args()
    a, b = metrics(args.marrow_run), metrics(args.reference_run)
    steps = sorted(set(a) & set(b))
    if not steps:
        sys.exit("reference_compare: error: the two runs have no step in common")
    ok = True
    for name, run in (("marrow", a), ("reference", b)):
        rates = [run[s]["tokens_per_s"] for s in sorted(run) if s > 3 and "tokens_per_s" in run[s]]
        print(f"{name}: {len(run)} steps, median {statistics.median(rates) if rates else float('nan'):.0f} tokens/s")
    for first in range(args.skip + 1, steps[-1] + 1, args.window):
        window = [s for s in steps if first <= s < first + args.window]
        if len(window) < args.window:
            break
        ma, mb = (statistics.fmean(r[s]["loss"] for s in window) for r in (a, b))
        gap = (mb - ma) / ma
        ok &= abs(gap) <= 0.01
        print(f"steps {first}-{first + args.window - 1}: mean loss marrow {ma:.4f} reference {mb:.4f} gap {100 * gap:+.3f}%")
    validation = [s for s in steps if "val_loss" in a[s] and "val_loss" in b[s]]
    for s in validation:
        print(f"step {s}: validation marrow {a[s]['val_loss']:.4f} reference {b[s]['val_loss']:.4f} "
              f"gap {100 * (b[s]['val_loss'] - a[s]['val_loss']) / a[s]['val_loss']:+.3f}%")
    if validation:
        last = validation[-1]
        final_gap = abs(b[last]["val_loss"] - a[last]["val_loss"]) / a[last]["val_loss"]
        ok &= final_gap <= 0.005
        print(f"final validation gap {100 * final_gap:.3f}% (bound 0.5%)")
    if args.exported:
        own = a[max(s for s in a if "val_loss" in a[s])]["val_loss"]
        theirs = json.load(open(args.exported))["val_loss"]
        gap = abs(theirs - own) / own
        print(f"exported model: transformers {theirs:.5f}, Marrow's own evaluation {own:.5f}, gap {gap:.2e} (bound 1e-3)")
        sys.exit(0 if gap <= 1e-3 else 1)
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
