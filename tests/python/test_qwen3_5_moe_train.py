"""Qwen3.5-MoE through the command line on the CPU, configs/tiny-qwen3-5-moe (three Gated DeltaNet layers, one gated
attention layer, the gated shared expert), on the demo corpus:
- it trains (the loss falls) and resumes bit for bit;
- its export loads in transformers' Qwen3_5MoeForCausalLM with every tensor and no other; transformers' greedy generate
  (its recurrent delta rule and convolution state for each new token) continues three prompts with `marrow sample`'s
  text at temperature 0, and its logits over the generated sequences are Marrow's forward's within 1e-4;
- EP = 2, DP = 2 (FSDP), DP = 2 x EP = 2, HSDP 2 x 2, DualPipeV over two pipeline ranks, and context parallelism
  (CP = 2, CP = 4 and CP = 2 x EP = 2: ring attention for the attention layer, the sequence chain carrying the DeltaNet
  state and the convolution's earlier tokens across the zigzag chunks, parallel/sequence_chain.h) train as one process
  does: every step's loss, gradient norm and load balance within 1e-6, the last checkpoint's tensors within 1e-6 (AdamW
  moments 1e-5);
- packed documents are refused in one sentence (the state would need resetting at each document), and so is CP with
  chunks shorter than the convolution's reach.
"""
import argparse
import os
import sys
import tempfile

from transformers import Qwen3_5MoeForCausalLM

from family_train import SMOOTH_OPTIMIZER, Family, export_generates, layouts_match, mpi_train, train, trains_and_resumes

FAMILY = Family("configs/tiny-qwen3-5-moe.toml", "configs/tiny-qwen3-5-moe.json", Qwen3_5MoeForCausalLM)


def layouts(args, corpus, work):
    """Each layout against one process on the same sequences, 4 steps (family_train.layouts_match's bounds)."""
    smooth = ["--checkpoint.every=2", *SMOOTH_OPTIMIZER]
    one = os.path.join(work, "one")
    r = train(args.marrow, FAMILY, corpus, one, 4, [*smooth, "--train.micro_batch=16"])
    assert r.returncode == 0, r.stderr
    pipeline_one = os.path.join(work, "one-pipeline")
    r = train(args.marrow, FAMILY, corpus, pipeline_one, 4, [*smooth, "--train.micro_batch=4"])
    assert r.returncode == 0, r.stderr
    tiny = FAMILY.config
    runs = [("EP = 2", one, tiny, 2, ["--parallel.ep=2", "--train.micro_batch=8"]),
            ("DP = 2 (FSDP)", one, tiny, 2, ["--train.micro_batch=8"]),
            ("DP = 2 x EP = 2", one, tiny, 4, ["--parallel.ep=2", "--train.micro_batch=4"]),
            ("HSDP 2 x 2", one, tiny, 4, ["--parallel.dp_shard=2", "--train.micro_batch=4"]),
            ("PP = 2 (DualPipeV)", pipeline_one, tiny, 2, ["--parallel.pp=2", "--train.micro_batch=4"]),
            ("CP = 2", one, tiny, 2, ["--parallel.cp=2", "--train.micro_batch=16"]),
            ("CP = 4", one, tiny, 4, ["--parallel.cp=4", "--train.micro_batch=16"]),
            ("CP = 2 x EP = 2", one, tiny, 4, ["--parallel.cp=2", "--parallel.ep=2", "--train.micro_batch=8"])]
    return layouts_match(args.marrow, FAMILY, corpus, work, runs, smooth)[0]


def refusals(args, corpus, work):
    """data.document_mask, and CP = 2 at seq_len 8 (chunks of 2 tokens, the convolution reaching 3 back), end with one
    sentence naming what is missing."""
    ok = True
    for name, np, extra, words in [("data.document_mask", 0, ["--data.document_mask=true"], ("document_mask", "state reset")),
                                   ("CP = 2 at seq_len 8", 2, ["--parallel.cp=2", "--train.seq_len=8"], ("conv_kernel - 1 = 3", "got 2"))]:
        out = os.path.join(work, "refused-" + name.replace(" ", ""))
        r = mpi_train(args.marrow, FAMILY, corpus, out, 3, extra, np) if np else train(args.marrow, FAMILY, corpus, out, 3, extra)
        said = [line for line in (r.stdout + r.stderr).splitlines() if all(w in line for w in words)]
        print(f"{name}: refused {r.returncode != 0}, in one sentence: {said[:1]}")
        ok &= r.returncode != 0 and bool(said)
    return ok


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--marrow", required=True)
    parser.add_argument("--build-dir", required=True)
    args = parser.parse_args()
    corpus = os.environ["MARROW_DEMO_CORPUS"]
    with tempfile.TemporaryDirectory() as work:
        ok, whole = trains_and_resumes(args.marrow, FAMILY, corpus, work)
        ok &= export_generates(args.marrow, args.build_dir, FAMILY, whole, work)
        ok &= layouts(args, corpus, work)
        ok &= refusals(args, corpus, work)
    print("PASS" if ok else "FAIL")
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
