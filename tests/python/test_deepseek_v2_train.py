"""DeepSeek-V2 through the command line on the CPU, configs/tiny-deepseek-v2 (q-LoRA, a dense first layer, shared
experts, group-limited routing), on the demo corpus:
- it trains (the loss falls) and resumes bit for bit;
- its export loads in transformers' DeepseekV2ForCausalLM with every tensor and no other; transformers' greedy generate
  continues three prompts with `marrow sample`'s text at temperature 0, and its logits over the generated sequences
  are Marrow's forward's within 1e-4;
- EP = 2, DP = 2 (FSDP), DP = 2 x EP = 2, CP = 2 (ring attention with q/k heads of 24 and v heads of 16) and DualPipeV
  over two pipeline ranks (four layers, the dense one in the first chunk) train as one process does: every step's
  loss, gradient norm and load balance within 1e-6, the last checkpoint's tensors within 1e-6 (AdamW moments 1e-5);
- EP = 2 resumes one process's checkpoint, and one process EP = 2's, continuing as the run they resume;
- with seq_aux = true (the load balance per sequence) DP = 2 x CP = 2 trains as one process does, within 1e-6;
- train.fp8 trains (finite, falling, within 2% of full precision), and EP = 2 with it as one process within 5e-3.
"""
import argparse
import json
import math
import os
import sys
import tempfile

from transformers import DeepseekV2ForCausalLM

from family_train import (SMOOTH_OPTIMIZER, Family, export_generates, layouts_match, losses, mpi_train, train,
                          trains_and_resumes, worst_metric_error)

TINY = "configs/tiny-deepseek-v2.json"
FAMILY = Family("configs/tiny-deepseek-v2.toml", TINY, DeepseekV2ForCausalLM)


def layouts(args, corpus, work):
    """Each layout against one process on the same sequences, 4 steps: every step's loss, gradient norm and load balance
    within 1e-6 (the sums meet in another order, so not bit for bit: a missing reduction, or a norm that leaves a
    tensor out, is off by far more; the norm's clipping decides every update), and the step-4 checkpoint's tensors
    (slices assembled) one process's. Then EP = 2 resumes one process's step-2 checkpoint and one process EP = 2's,
    steps 3-4 within 1e-6 of the run each continues."""
    smooth = ["--checkpoint.every=2", *SMOOTH_OPTIMIZER]
    one = os.path.join(work, "one")
    r = train(args.marrow, FAMILY, corpus, one, 4, [*smooth, "--train.micro_batch=16"])
    assert r.returncode == 0, r.stderr
    # DualPipeV needs a chunk each way per rank: four layers, the dense one and three with experts.
    four = os.path.join(work, "four-layers.json")
    json.dump(dict(json.load(open(TINY)), num_hidden_layers=4), open(four, "w"))
    pipeline_one = os.path.join(work, "one-four-layers")
    r = train(args.marrow, FAMILY, corpus, pipeline_one, 4, [*smooth, "--train.micro_batch=4"], four)
    assert r.returncode == 0, r.stderr
    runs = [("EP = 2", one, TINY, 2, ["--parallel.ep=2", "--train.micro_batch=8"]),
            ("DP = 2 (FSDP)", one, TINY, 2, ["--train.micro_batch=8"]),
            ("DP = 2 x EP = 2", one, TINY, 4, ["--parallel.ep=2", "--train.micro_batch=4"]),
            ("CP = 2", one, TINY, 2, ["--parallel.cp=2", "--train.micro_batch=16"]),
            ("PP = 2 (DualPipeV)", pipeline_one, four, 2, ["--parallel.pp=2", "--train.micro_batch=4"])]
    ok, dirs = layouts_match(args.marrow, FAMILY, corpus, work, runs, smooth)
    ep = dirs["EP = 2"]
    for name, from_dir, reference, np, layout in [("EP = 2 from one process", one, ep, 2, ["--parallel.ep=2", "--train.micro_batch=8"]),
                                                  ("one process from EP = 2", ep, one, 0, ["--train.micro_batch=16"])]:
        out = os.path.join(work, f"resumed-{np}")
        extra = ["--checkpoint.every=0", "--resume", os.path.join(from_dir, "step-00000002"), *SMOOTH_OPTIMIZER, *layout]
        r = mpi_train(args.marrow, FAMILY, corpus, out, 4, extra, np) if np else train(args.marrow, FAMILY, corpus, out, 4, extra)
        assert r.returncode == 0, r.stderr
        worst = worst_metric_error(reference, out, [3, 4])
        print(f"{name} (resumed at step 2): steps 3-4 within 1e-6 of the run it continues: worst {worst:.1e}")
        ok &= worst <= 1e-6
    return ok


def sequence_aux(args, corpus, work):
    """seq_aux = true (DeepSeek-V2's load balance per sequence, averaged): DP = 2 x CP = 2 within 1e-6 of one process,
    the load balance included. Each data-parallel rank's sequences are their own rows of the statistics summed over
    the ranks, and the context-parallel ranks' shares of a sequence add up in its row; rows shared by different
    ranks' sequences would put the load balance ~1% off."""
    model = os.path.join(work, "seq-aux.json")
    json.dump(dict(json.load(open(TINY)), seq_aux=True), open(model, "w"))
    one, many = os.path.join(work, "seq-aux-one"), os.path.join(work, "seq-aux-many")
    extra = ["--checkpoint.every=0", *SMOOTH_OPTIMIZER]
    r = train(args.marrow, FAMILY, corpus, one, 3, [*extra, "--train.micro_batch=16"], model)
    assert r.returncode == 0, r.stderr
    r = mpi_train(args.marrow, FAMILY, corpus, many, 3, [*extra, "--parallel.cp=2", "--train.micro_batch=8"], 4, model)
    assert r.returncode == 0, r.stderr
    worst = worst_metric_error(one, many, [1, 2, 3])
    print(f"seq_aux, DP = 2 x CP = 2 against one process: losses, gradient norms and load balance within 1e-6: worst {worst:.1e}")
    return worst <= 1e-6


def fp8_experts(args, corpus, whole, work):
    """train.fp8: the experts' GEMMs from E4M3 operands train at the demo's learning rate, the losses finite and
    falling, within 2% of full precision's and not the same numbers; and EP = 2 within 5e-3 of one process (each rank
    quantizes its own experts' rows, by blocks that never cross an expert), as tests/python/test_gpt_oss_train.py holds
    GPT-OSS's: an input a rounding apart can land on the other side of an E4M3 step, an expert quantized from another's
    rows is off by far more."""
    fp8 = os.path.join(work, "fp8")
    r = train(args.marrow, FAMILY, corpus, fp8, 6, ["--checkpoint.every=0", "--train.fp8=true"])
    assert r.returncode == 0, r.stderr
    got, plain = losses(fp8), losses(whole)
    finite = all(math.isfinite(v) for v in got.values())
    falls = got[6] < got[1]
    close = max(abs(got[s] - plain[s]) / plain[s] for s in plain) <= 2e-2
    one, ep = os.path.join(work, "fp8-one"), os.path.join(work, "fp8-ep")
    common = ["--checkpoint.every=0", "--train.fp8=true", *SMOOTH_OPTIMIZER]
    r = train(args.marrow, FAMILY, corpus, one, 4, [*common, "--train.micro_batch=16"])
    assert r.returncode == 0, r.stderr
    r = mpi_train(args.marrow, FAMILY, corpus, ep, 4, [*common, "--parallel.ep=2", "--train.micro_batch=8"])
    assert r.returncode == 0, r.stderr
    to_one = worst_metric_error(one, ep, [1, 2, 3, 4])
    print(f"train.fp8: loss {got[1]:.4f} -> {got[6]:.4f}, finite {finite}, falls {falls}; within 2% of full precision {close}, "
          f"other numbers {got != plain}; EP = 2 within 5e-3 of one process (worst {to_one:.1e})")
    return finite and falls and close and got != plain and to_one <= 5e-3


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
        ok &= sequence_aux(args, corpus, work)
        ok &= fp8_experts(args, corpus, whole, work)
    print("PASS" if ok else "FAIL")
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
