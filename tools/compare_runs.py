"""Compares training runs by their metrics.jsonl (tools/gpu_check.sh).

  compare_runs.py CPU.jsonl GPU1.jsonl GPU2.jsonl   GPU losses follow the CPU's within bf16 tolerance
                                                    (2% relative per step) and the two GPU runs are
                                                    bitwise identical.
  compare_runs.py --peak-stable RUN.jsonl           peak memory after the first 10 steps does not grow.
  compare_runs.py --within REL A.jsonl B.jsonl      every step's loss of B within REL (relative) of A's
                                                    (e.g. a layout of several GPUs against one GPU).
Prints a table and PASS or FAIL; exits non-zero on FAIL.
"""
import json
import sys


def read(path):
    with open(path) as f:
        return [json.loads(line) for line in f]


def main():
    if sys.argv[1] == "--within":
        bound, a, b = float(sys.argv[2]), read(sys.argv[3]), read(sys.argv[4])
        ok = len(a) == len(b) > 0
        print(f"{'step':>4} {'loss A':>10} {'loss B':>10} {'rel diff':>9}")
        for x, y in zip(a, b):
            rel = abs(y["loss"] - x["loss"]) / abs(x["loss"])
            ok = ok and rel <= bound
            print(f"{x['step']:>4} {x['loss']:>10.5f} {y['loss']:>10.5f} {rel:>9.2e}")
    elif sys.argv[1] == "--peak-stable":
        run = read(sys.argv[2])
        peaks = [r["peak_bytes"] for r in run]
        early, late = max(peaks[: min(10, len(peaks))]), max(peaks)
        print(f"peak after 10 steps {early / 2**30:.3f} GiB, after {len(peaks)} steps {late / 2**30:.3f} GiB")
        ok = late <= early
    else:
        cpu, gpu1, gpu2 = (read(p) for p in sys.argv[1:4])
        ok = len(cpu) == len(gpu1) == len(gpu2) > 0
        print(f"{'step':>4} {'cpu loss':>10} {'gpu loss':>10} {'rel diff':>9}")
        for c, g in zip(cpu, gpu1):
            rel = abs(g["loss"] - c["loss"]) / abs(c["loss"])
            ok = ok and rel <= 0.02
            print(f"{c['step']:>4} {c['loss']:>10.5f} {g['loss']:>10.5f} {rel:>9.2e}")
        same = [a["loss"] for a in gpu1] == [b["loss"] for b in gpu2]
        print("two GPU runs bitwise identical:", same)
        ok = ok and same
    print("PASS" if ok else "FAIL")
    sys.exit(0 if ok else 1)


main()
