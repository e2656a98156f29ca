"""What the model families' command-line tests share (test_deepseek_v2_train.py, test_qwen3_5_moe_train.py): train a
family's tiny config on the demo corpus on the CPU, in one process or under mpirun, and compare runs; train and resume
bit for bit; export and generate with transformers. A Family names the run config, the model config and the
transformers class."""
import json
import os
import subprocess
from dataclasses import dataclass

import torch
from safetensors.torch import load_file
from transformers import AutoTokenizer

from checkpoint_tensors import checkpoint_tensors, relative_error


@dataclass
class Family:
    toml: str
    config: str
    hf_class: type


def train(marrow, family, corpus, out, steps, extra=(), model=None):
    cmd = [marrow, "train", family.toml, f"--model.config={model or family.config}", f"--data.path={corpus}/corpus",
           f"--train.steps={steps}", "--schedule.warmup_steps=2", "--train.device=cpu", "--checkpoint.every=3", "--eval.every=0",
           f"--output.dir={out}", *extra]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=600)


# mpirun as root, oversubscribed, on a machine without shared-memory single copy, waiting ranks yielding their
# cores (tests/python/test_parallel.py); `timeout` ends a hung job, and a rank that fails ends the others.
MPI_ENV = dict(os.environ, OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1", OMPI_MCA_rmaps_base_oversubscribe="1",
               OMPI_MCA_btl_vader_single_copy_mechanism="none", OMPI_MCA_mpi_yield_when_idle="1")


def mpi_train(marrow, family, corpus, out, steps, extra, np=2, model=None):
    return subprocess.run(["timeout", "300", "mpirun", "--oversubscribe", "--bind-to", "none", "-np", str(np), marrow, "train",
                           family.toml, f"--model.config={model or family.config}", f"--data.path={corpus}/corpus",
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
# layouts: top-k routing is discontinuous, so a rounding's difference in front of a near-tie sends a token elsewhere
# once the weights have moved far; and AdamW divides by sqrt(v) + eps, so with the defaults a gradient element that is
# ~0 in one layout and a rounding's worth in another moves its weight by a whole learning rate. A missing or doubled
# reduction is still off by ~lr per element (5e-4 of the weights' scale).
SMOOTH_OPTIMIZER = ["--optimizer.lr=1e-5", "--optimizer.min_lr=1e-6", "--optimizer.eps=1e-6"]


def trains_and_resumes(marrow, family, corpus, work):
    """6 steps at the demo's learning rate: the loss falls; resumed at step 3, steps 4-6 are the same bits."""
    whole, part = os.path.join(work, "whole"), os.path.join(work, "part")
    r = train(marrow, family, corpus, whole, 6)
    assert r.returncode == 0, r.stderr
    run = losses(whole)
    falls = run[6] < run[1]
    print(f"6 steps: loss {run[1]:.4f} -> {run[6]:.4f} ({'falls' if falls else 'DOES NOT FALL'})")
    r = train(marrow, family, corpus, part, 6, ["--resume", os.path.join(whole, "step-00000003")])
    assert r.returncode == 0, r.stderr
    resumed = losses(part)
    same = sorted(resumed) == [4, 5, 6] and all(resumed[s] == run[s] for s in (4, 5, 6))
    print(f"resumed at step 3: steps 4-6 the same bits: {same}")
    return falls and same, whole


PROMPTS = ["The Python interpreter", "def main():\n    ", "In this tutorial, we"]


def export_generates(marrow, build_dir, family, whole, work):
    """The export loads in the family's transformers class with every tensor and no other; its greedy generate (its
    own routing and caches) continues each prompt with `marrow sample`'s text at temperature 0, and its logits over
    each generated sequence are Marrow's forward's (tests/tools/model_forward) within 1e-4, as
    tests/python/test_checkpoint.py holds Qwen3-MoE's export: a 6-step model's greedy text repeats itself, the logits
    tell every position apart."""
    hf = os.path.join(work, "hf")
    subprocess.run([marrow, "export", whole, hf], check=True, capture_output=True)
    model, info = family.hf_class.from_pretrained(hf, dtype=torch.float32, output_loading_info=True)
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
        r = subprocess.run([marrow, "sample", whole, "--prompt", prompt, "--tokens=24", "--temperature=0"],
                           capture_output=True, text=True, check=True)
        ours = r.stdout.removesuffix("\n")
        if ours != theirs:
            print(f"  {prompt!r}: marrow sample {ours!r}, transformers {theirs!r}")
        same &= ours == theirs
        tokens, out = os.path.join(work, f"tokens-{i}.txt"), os.path.join(work, f"forward-{i}")
        open(tokens, "w").write(" ".join(map(str, [1, generated.shape[1], *generated[0].tolist()])))
        subprocess.run([os.path.join(build_dir, "tests", "model_forward"), whole, tokens, out], check=True, capture_output=True)
        worst = max(worst, relative_error(load_file(os.path.join(out, "marrow_outputs.safetensors"))["logits"], logits))
    print(f"export loads in transformers: every tensor {complete}; greedy generate of {len(PROMPTS)} prompts is marrow sample's: "
          f"{same}; logits within 1e-4 of Marrow's: {worst:.1e}")
    return complete and same and worst <= 1e-4


def layouts_match(marrow, family, corpus, work, runs, smooth):
    """Each (name, reference run, model config, np, layout args) trained 4 steps under mpirun against its reference:
    every step's loss, gradient norm and load balance within 1e-6, the step-4 checkpoint's tensors (slices assembled)
    the reference's within the bounds. Returns whether all match, and the run directories by name."""
    ok, dirs = True, {}
    for i, (name, reference, model, np, layout) in enumerate(runs):
        dirs[name] = os.path.join(work, f"layout-{i}")
        r = mpi_train(marrow, family, corpus, dirs[name], 4, [*smooth, *layout], np, model)
        assert r.returncode == 0, r.stderr
        worst = worst_metric_error(reference, dirs[name], [1, 2, 3, 4])
        same_names, tensors = worst_tensor_error(reference, dirs[name], 4)
        print(f"{name} against one process: metrics within 1e-6 (worst {worst:.1e}); the checkpoint's tensors "
              f"{'are' if same_names else 'ARE NOT'} one process's, within the bounds: {tensors <= 1} ({tensors:.2f} of them)")
        ok &= worst <= 1e-6 and same_names and tensors <= 1
    return ok, dirs
