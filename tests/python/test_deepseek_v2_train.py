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
import subprocess
import sys
import tempfile

import torch
from safetensors.torch import load_file
from transformers import AutoTokenizer, DeepseekV2ForCausalLM

from checkpoint_tensors import checkpoint_tensors, relative_error

TINY = "configs/tiny-deepseek-v2.json"


def train(marrow, corpus, out, steps, extra=(), model=TINY):
    cmd = [marrow, "train", "configs/tiny-deepseek-v2.toml", f"--model.config={model}", f"--data.path={corpus}/corpus",
           f"--train.steps={steps}", "--schedule.warmup_steps=2", "--train.device=cpu", "--checkpoint.every=3", "--eval.every=0",
           f"--output.dir={out}", *extra]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=600)


# mpirun as root, oversubscribed, on a machine without shared-memory single copy, waiting ranks yielding their
# cores (tests/python/test_parallel.py); `timeout` ends a hung job, and a rank that fails ends the others.
MPI_ENV = dict(os.environ, OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1", OMPI_MCA_rmaps_base_oversubscribe="1",
               OMPI_MCA_btl_vader_single_copy_mechanism="none", OMPI_MCA_mpi_yield_when_idle="1")


def mpi_train(args, corpus, out, steps, extra, np=2, model=TINY):
    return subprocess.run(["timeout", "300", "mpirun", "--oversubscribe", "--bind-to", "none", "-np", str(np), args.marrow, "train",
                           "configs/tiny-deepseek-v2.toml", f"--model.config={model}", f"--data.path={corpus}/corpus",
                           f"--train.steps={steps}", "--schedule.warmup_steps=2", "--train.device=cpu", "--eval.every=0",
                           f"--output.dir={out}", *extra],
                          capture_output=True, text=True, env=MPI_ENV)


def losses(out):
    return {r["step"]: r["loss"] for r in map(json.loads, open(os.path.join(out, "metrics.jsonl")))}


def worst_metric_error(dir_a, dir_b, steps):
    """The worst relative difference of the two runs' losses, gradient norms and load balance at the given steps
    (both runs must have logged exactly those among their steps)."""
    records = [[r for r in map(json.loads, open(os.path.join(d, "metrics.jsonl"))) if r["step"] in steps] for d in (dir_a, dir_b)]
    assert [r["step"] for r in records[0]] == [r["step"] for r in records[1]] == steps, records
    return max(abs(a[k] - b[k]) / abs(a[k]) for a, b in zip(*records) for k in ("loss", "grad_norm", "load_balance"))


def worst_tensor_error(dir_a, dir_b, step):
    """Whether the two runs' checkpoints at `step` hold the same tensors, and the worst tensor's error in units of its
    bound: 1e-6 for the weights (relative to the initialisation's scale at least), 1e-5 for the AdamW moments (as
    tests/python/test_parallel.py holds Qwen3-MoE's layouts)."""
    a, b = (checkpoint_tensors(os.path.join(d, f"step-{step:08d}")) for d in (dir_a, dir_b))
    bound, floor = {"weights": 1e-6, "exp_avg": 1e-5, "exp_avg_sq": 1e-5}, {"weights": 0.02, "exp_avg": 1e-30, "exp_avg_sq": 1e-30}
    return a.keys() == b.keys(), max(relative_error(a[k], b[k], floor[k[0]]) / bound[k[0]] for k in a if k in b)


# A small learning rate and an epsilon above the gradients' rounding, as tests/python/test_parallel.py trains its
# layouts: routing to 2 of 8 experts (of 2 of 4 groups) is discontinuous, so a rounding's difference in front of a
# near-tie sends a token elsewhere once the weights have moved far; and AdamW divides by sqrt(v) + eps, so with the
# defaults a gradient element that is ~0 in one layout and a rounding's worth in another moves its weight by a whole
# learning rate. A missing or doubled reduction is still off by ~lr per element (5e-4 of the weights' scale).
SMOOTH_OPTIMIZER = ["--optimizer.lr=1e-5", "--optimizer.min_lr=1e-6", "--optimizer.eps=1e-6"]


def trains_and_resumes(args, corpus, work):
    """6 steps at the demo's learning rate: the loss falls; resumed at step 3, steps 4-6 are the same bits."""
    whole, part = os.path.join(work, "whole"), os.path.join(work, "part")
    r = train(args.marrow, corpus, whole, 6)
    assert r.returncode == 0, r.stderr
    run = losses(whole)
    falls = run[6] < run[1]
    print(f"6 steps: loss {run[1]:.4f} -> {run[6]:.4f} ({'falls' if falls else 'DOES NOT FALL'})")
    r = train(args.marrow, corpus, part, 6, ["--resume", os.path.join(whole, "step-00000003")])
    assert r.returncode == 0, r.stderr
    resumed = losses(part)
    same = sorted(resumed) == [4, 5, 6] and all(resumed[s] == run[s] for s in (4, 5, 6))
    print(f"resumed at step 3: steps 4-6 the same bits: {same}")
    return falls and same, whole


PROMPTS = ["The Python interpreter", "def main():\n    ", "In this tutorial, we"]


def export_generates(args, whole, work):
    """The export loads in DeepseekV2ForCausalLM with every tensor and no other; its greedy generate (its own
    group-limited routing, its KV cache) continues each prompt with `marrow sample`'s text at temperature 0, and its
    logits over each generated sequence are Marrow's forward's (tests/tools/model_forward) within 1e-4, as
    tests/python/test_checkpoint.py holds Qwen3-MoE's export: a 6-step model's greedy text repeats itself, the logits
    tell every position apart."""
    hf = os.path.join(work, "hf")
    subprocess.run([args.marrow, "export", whole, hf], check=True, capture_output=True)
    model, info = DeepseekV2ForCausalLM.from_pretrained(hf, dtype=torch.float32, output_loading_info=True)
    complete = not any(info[k] for k in ("missing_keys", "unexpected_keys", "mismatched_keys"))
    tokenizer = AutoTokenizer.from_pretrained(hf)
    same, worst = True, 0.0
    for i, prompt in enumerate(PROMPTS):
        ids = tokenizer(prompt, return_tensors="pt").input_ids
        with torch.no_grad():
            generated = model.generate(ids, max_new_tokens=24, do_sample=False, eos_token_id=tokenizer.eos_token_id,
                                       pad_token_id=tokenizer.eos_token_id)
            logits = model(input_ids=generated).logits
        theirs = tokenizer.decode(generated[0], skip_special_tokens=True)
        r = subprocess.run([args.marrow, "sample", whole, "--prompt", prompt, "--tokens=24", "--temperature=0"],
                           capture_output=True, text=True, check=True)
        ours = r.stdout.removesuffix("\n")
        if ours != theirs:
            print(f"  {prompt!r}: marrow sample {ours!r}, transformers {theirs!r}")
        same &= ours == theirs
        tokens, out = os.path.join(work, f"tokens-{i}.txt"), os.path.join(work, f"forward-{i}")
        open(tokens, "w").write(" ".join(map(str, [1, generated.shape[1], *generated[0].tolist()])))
        subprocess.run([os.path.join(args.build_dir, "tests", "model_forward"), whole, tokens, out], check=True, capture_output=True)
        worst = max(worst, relative_error(load_file(os.path.join(out, "marrow_outputs.safetensors"))["logits"], logits))
    print(f"export loads in transformers: every tensor {complete}; greedy generate of {len(PROMPTS)} prompts is marrow sample's: "
          f"{same}; logits within 1e-4 of Marrow's: {worst:.1e}")
    return complete and same and worst <= 1e-4


def layouts(args, corpus, work):
    """Each layout against one process on the same sequences, 4 steps: every step's loss, gradient norm and load balance
    within 1e-6 (the sums meet in another order, so not bit for bit: a missing reduction, or a norm that leaves a
    tensor out, is off by far more; the norm's clipping decides every update), and the step-4 checkpoint's tensors
    (slices assembled) one process's. Then EP = 2 resumes one process's step-2 checkpoint and one process EP = 2's,
    steps 3-4 within 1e-6 of the run each continues."""
    ok = True
    smooth = ["--checkpoint.every=2", *SMOOTH_OPTIMIZER]
    one = os.path.join(work, "one")
    r = train(args.marrow, corpus, one, 4, [*smooth, "--train.micro_batch=16"])
    assert r.returncode == 0, r.stderr
    # DualPipeV needs a chunk each way per rank: four layers, the dense one and three with experts.
    four = os.path.join(work, "four-layers.json")
    json.dump(dict(json.load(open(TINY)), num_hidden_layers=4), open(four, "w"))
    pipeline_one = os.path.join(work, "one-four-layers")
    r = train(args.marrow, corpus, pipeline_one, 4, [*smooth, "--train.micro_batch=4"], four)
    assert r.returncode == 0, r.stderr
    runs = [("EP = 2", one, TINY, 2, ["--parallel.ep=2", "--train.micro_batch=8"]),
            ("DP = 2 (FSDP)", one, TINY, 2, ["--train.micro_batch=8"]),
            ("DP = 2 x EP = 2", one, TINY, 4, ["--parallel.ep=2", "--train.micro_batch=4"]),
            ("CP = 2", one, TINY, 2, ["--parallel.cp=2", "--train.micro_batch=16"]),
            ("PP = 2 (DualPipeV)", pipeline_one, four, 2, ["--parallel.pp=2", "--train.micro_batch=4"])]
    dirs = {}
    for i, (name, reference, model, np, layout) in enumerate(runs):
        dirs[name] = os.path.join(work, f"layout-{i}")
        r = mpi_train(args, corpus, dirs[name], 4, [*smooth, *layout], np, model)
        assert r.returncode == 0, r.stderr
        worst = worst_metric_error(reference, dirs[name], [1, 2, 3, 4])
        same_names, tensors = worst_tensor_error(reference, dirs[name], 4)
        print(f"{name} against one process: metrics within 1e-6 (worst {worst:.1e}); the checkpoint's tensors "
              f"{'are' if same_names else 'ARE NOT'} one process's, within the bounds: {tensors <= 1} ({tensors:.2f} of them)")
        ok &= worst <= 1e-6 and same_names and tensors <= 1
    ep = dirs["EP = 2"]
    for name, from_dir, reference, np, layout in [("EP = 2 from one process", one, ep, 2, ["--parallel.ep=2", "--train.micro_batch=8"]),
                                                  ("one process from EP = 2", ep, one, 0, ["--train.micro_batch=16"])]:
        out = os.path.join(work, f"resumed-{np}")
        extra = ["--checkpoint.every=0", "--resume", os.path.join(from_dir, "step-00000002"), *SMOOTH_OPTIMIZER, *layout]
        r = mpi_train(args, corpus, out, 4, extra, np) if np else train(args.marrow, corpus, out, 4, extra)
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
    r = train(args.marrow, corpus, one, 3, [*extra, "--train.micro_batch=16"], model)
    assert r.returncode == 0, r.stderr
    r = mpi_train(args, corpus, many, 3, [*extra, "--parallel.cp=2", "--train.micro_batch=8"], 4, model)
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
    r = train(args.marrow, corpus, fp8, 6, ["--checkpoint.every=0", "--train.fp8=true"])
    assert r.returncode == 0, r.stderr
    got, plain = losses(fp8), losses(whole)
    finite = all(math.isfinite(v) for v in got.values())
    falls = got[6] < got[1]
    close = max(abs(got[s] - plain[s]) / plain[s] for s in plain) <= 2e-2
    one, ep = os.path.join(work, "fp8-one"), os.path.join(work, "fp8-ep")
    common = ["--checkpoint.every=0", "--train.fp8=true", *SMOOTH_OPTIMIZER]
    r = train(args.marrow, corpus, one, 4, [*common, "--train.micro_batch=16"])
    assert r.returncode == 0, r.stderr
    r = mpi_train(args, corpus, ep, 4, [*common, "--parallel.ep=2", "--train.micro_batch=8"])
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
        ok, whole = trains_and_resumes(args, corpus, work)
        ok &= export_generates(args, whole, work)
        ok &= layouts(args, corpus, work)
        ok &= sequence_aux(args, corpus, work)
        ok &= fp8_experts(args, corpus, whole, work)
    print("PASS" if ok else "FAIL")
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
