#!/usr/bin/env python3
"""Tokenizer throughput: Marrow against Hugging Face `tokenizers` on the same text and tokenizer.

Prints MB/s of text for: tokenizers' encode_batch on one thread (RAYON_NUM_THREADS=1) and on all
threads; Marrow's encoder alone on one thread (tests/tools/tokenizer_tool bench); and the whole
`marrow tokenize` command (read JSONL, encode, write shards) on one and on all threads. Each figure
is the best of --repeats runs; tokenizer loading is not timed except in `marrow tokenize`.

usage: tools/bench_tokenizer.py --build-dir build --tokenizer tokenizer.json --text docs.jsonl [--python .venv/bin/python]
"""
import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time

HF_SNIPPET = r"""
import json, sys, time
from tokenizers import Tokenizer
docs = [json.loads(l)["text"] for l in open(sys.argv[2], encoding="utf-8") if l.strip()]
tokenizer = Tokenizer.from_file(sys.argv[1])
tokenizer.encode_batch(docs[:4])
best = 1e9
for _ in range(int(sys.argv[3])):
    start = time.perf_counter()
    tokenizer.encode_batch(docs, add_special_tokens=False)
    best = min(best, time.perf_counter() - start)
print(best)
"""


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--build-dir", required=True)
    parser.add_argument("--tokenizer", required=True)
    parser.add_argument("--text", required=True, help="JSONL with a 'text' field")
    parser.add_argument("--python", default=sys.executable, help="a Python with tokenizers installed")
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    threads = os.cpu_count()
    with open(args.text, encoding="utf-8") as f:
        text_bytes = sum(len(json.loads(line)["text"].encode()) for line in f if line.strip())
    marrow = os.path.join(args.build_dir, "marrow")
    tool = os.path.join(args.build_dir, "tests", "tokenizer_tool")
    results = []

    def hf(thread_count):
        env = dict(os.environ, RAYON_NUM_THREADS=str(thread_count))
        out = subprocess.run([args.python, "-c", HF_SNIPPET, args.tokenizer, args.text, str(args.repeats)],
                             env=env, capture_output=True, text=True, check=True)
        return float(out.stdout.strip())

    def marrow_encoder():
        best = 1e9
        for _ in range(args.repeats):
            out = subprocess.run([tool, "bench", args.tokenizer, args.text], capture_output=True, text=True, check=True)
            best = min(best, float(re.search(r"in ([0-9.]+) s", out.stdout).group(1)))
        return best

    def marrow_tokenize(thread_count):
        best = 1e9
        work = tempfile.mkdtemp(prefix="marrow-bench-")
        try:
            for _ in range(args.repeats):
                out = os.path.join(work, "corpus")
                start = time.perf_counter()
                subprocess.run([marrow, "tokenize", "--quiet", "--input", args.text, "--tokenizer", args.tokenizer,
                                "--out", out, "--threads", str(thread_count), "--overwrite"], check=True, capture_output=True)
                best = min(best, time.perf_counter() - start)
        finally:
            shutil.rmtree(work)
        return best

    results.append(("tokenizers encode_batch, 1 thread", hf(1)))
    results.append((f"tokenizers encode_batch, {threads} threads", hf(threads)))
    results.append(("marrow encoder, 1 thread", marrow_encoder()))
    results.append(("marrow tokenize (end to end), 1 thread", marrow_tokenize(1)))
    results.append((f"marrow tokenize (end to end), {threads} threads", marrow_tokenize(threads)))
    print(f"text: {args.text} ({text_bytes / 1e6:.1f} MB), tokenizer: {args.tokenizer}")
    print("| what | seconds | MB/s |\n|---|---:|---:|")
    for name, seconds in results:
        print(f"| {name} | {seconds:.2f} | {text_bytes / 1e6 / seconds:.1f} |")


if __name__ == "__main__":
    main()
