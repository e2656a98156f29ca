"""marrow train end to end on the demo corpus (DESIGN.md §7, layer 4), and its bad-input messages.

- The tiny MoE's loss falls steadily over 200 steps of real text, with gradient accumulation.
- Two runs with the same seed print identical losses.
- x_perm kept for the backward or gathered again (train.expert_inputs): the same losses bit for bit.
- train.fp8 (the expert GEMMs in FP8) trains, deterministically, close to full precision.
- Each bad input stops the run with one clear sentence and a non-zero exit code.
- Non-finite steps are skipped with a warning, and several in a row stop the run naming the step.
- Validation loss (eval.every) is reported at the right steps, is the same in two runs, falls with
  training, and leaves the training losses untouched.
"""
import argparse
import json
import os
import re
import subprocess
import sys
import tempfile

FAILURES = []


def check(condition, what):
    print(("ok      " if condition else "FAILED  ") + what)
    if not condition:
        FAILURES.append(what)


def run(marrow, args, cwd):
    p = subprocess.run([marrow, "train"] + args, cwd=cwd, capture_output=True, text=True)
    return p.returncode, p.stdout, p.stderr


def metrics(out_dir):
    with open(os.path.join(out_dir, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f]


def losses(out_dir):
    return [m["loss"] for m in metrics(out_dir)]


def loss_falls(marrow, base, repo, tmp):
    # Loss falls steadily: 200 steps, two micro-batches of 4 per step.
    out = os.path.join(tmp, "long")
    code, stdout, stderr = run(marrow, base + ["--train.steps=200", "--train.global_batch=8", "--train.micro_batch=4",
                                                    f"--output.dir={out}"], repo)
    print(stdout[-2000:], stderr[-2000:])
    check(code == 0, "200-step run exits 0")
    if code == 0:
        l = losses(out)
        windows = [sum(l[i:i + 20]) / 20 for i in range(0, 200, 20)]
        print("mean loss per 20 steps:", " ".join(f"{w:.3f}" for w in windows))
        check(windows[-1] < windows[0] - 1.0, f"loss falls by more than 1.0 nat ({windows[0]:.3f} -> {windows[-1]:.3f})")
        check(all(b < a + 0.05 for a, b in zip(windows, windows[1:])), "every 20-step mean is at most 0.05 above the previous")


def same_seed_same_losses(marrow, base, repo, tmp):
    # Same seed, same losses, bit for bit (the JSON holds the full double).
    runs = []
    for name in ("same1", "same2"):
        out = os.path.join(tmp, name)
        code, _, _ = run(marrow, base + ["--train.steps=15", "--schedule.warmup_steps=5", f"--output.dir={out}"], repo)
        runs.append(losses(out) if code == 0 else None)
    check(runs[0] is not None and runs[0] == runs[1], "two runs with the same seed give identical losses")
    out = os.path.join(tmp, "other-seed")
    code, _, _ = run(marrow, base + ["--train.steps=15", "--schedule.warmup_steps=5", "--train.seed=99", f"--output.dir={out}"], repo)
    check(code == 0 and losses(out) != runs[0], "another seed gives other losses")


def paired_expert_gradients(marrow, base, repo, tmp):
    # Paired expert weight gradients (the default) give the losses of unpaired ones bit for bit:
    # three micro-batches a step, so one pair and one alone.
    paired, said = [], []
    for pair in ("true", "false"):
        out = os.path.join(tmp, f"pair-{pair}")
        code, stdout, _ = run(marrow, base + ["--train.steps=10", "--schedule.warmup_steps=5", "--train.global_batch=12",
                                                   "--train.micro_batch=4", f"--train.pair_expert_grads={pair}", f"--output.dir={out}"], repo)
        paired.append(losses(out) if code == 0 else None)
        said.append("expert weight gradients of micro-batches in pairs" in stdout)
    check(said == [True, False], f"the start-up line says whether micro-batches pair (default, false: {said})")
    check(paired[0] is not None and paired[0] == paired[1], "train.pair_expert_grads=false gives the default's losses bit for bit")


def fp8_experts(marrow, base, repo, tmp):
    # train.fp8: the start-up line says so, two runs give the same losses bit for bit, so does a resumed
    # one (its FP8 weights made again from the loaded weights), and the loss follows the full-precision
    # run's within 2% (E4M3's rounding of the expert GEMMs' operands).
    runs, said = [], []
    for name, fp8 in (("fp8-1", "true"), ("fp8-2", "true"), ("fp8-off", "false")):
        out = os.path.join(tmp, name)
        code, stdout, _ = run(marrow, base + ["--train.steps=30", "--schedule.warmup_steps=5", f"--train.fp8={fp8}", "--checkpoint.every=15",
                                              f"--output.dir={out}"], repo)
        runs.append(losses(out) if code == 0 else None)
        said.append("GEMMs in FP8 (train.fp8)" in stdout)
    check(said == [True, True, False], f"the start-up line says when the expert GEMMs run in FP8 ({said})")
    if None in runs:
        check(False, "the train.fp8 runs exit 0")
        return
    check(runs[0] == runs[1], "two train.fp8 runs give identical losses")
    out = os.path.join(tmp, "fp8-resumed")
    code, _, _ = run(marrow, base + ["--train.steps=30", "--schedule.warmup_steps=5", "--train.fp8=true", "--checkpoint.every=15",
                                     "--resume", os.path.join(tmp, "fp8-1", "step-00000015"), f"--output.dir={out}"], repo)
    check(code == 0 and losses(out) == runs[0][15:], "a train.fp8 run resumed at step 15 gives the straight run's losses bit for bit")
    check(runs[0] != runs[2], "train.fp8 changes the losses")
    first, last, plain = sum(runs[0][:5]) / 5, sum(runs[0][-5:]) / 5, sum(runs[2][-5:]) / 5
    check(last < first - 0.5, f"with train.fp8 the loss falls ({first:.3f} -> {last:.3f})")
    check(abs(last - plain) < 0.02 * plain, f"with train.fp8 the last 5 steps' mean loss is within 2% of full precision's ({last:.4f}, {plain:.4f})")


def validation_loss(marrow, base, repo, tmp):
    # Validation loss: at steps 10, 20 and the last (25), deterministic, falling, and training untouched.
    evals = []
    for name in ("eval1", "eval2"):
        out = os.path.join(tmp, name)
        code, stdout, _ = run(marrow, base + ["--train.steps=25", "--schedule.warmup_steps=5", "--eval.every=10",
                                                   "--eval.samples=6", f"--output.dir={out}"], repo)
        evals.append(metrics(out) if code == 0 else None)
    if evals[0] is not None and evals[1] is not None:
        steps = [m["step"] for m in evals[0] if "val_loss" in m]
        check(steps == [10, 20, 25], f"validation loss at steps 10, 20, 25 (got {steps})")
        val = [m["val_loss"] for m in evals[0] if "val_loss" in m]
        check(val == [m["val_loss"] for m in evals[1] if "val_loss" in m], "two runs give identical validation losses")
        check(val[-1] < val[0], f"validation loss falls ({val[0]:.4f} -> {val[-1]:.4f})")
        out = os.path.join(tmp, "no-eval")
        code, _, _ = run(marrow, base + ["--train.steps=25", "--schedule.warmup_steps=5", f"--output.dir={out}"], repo)
        check(code == 0 and [m["loss"] for m in evals[0]] == losses(out), "evaluating leaves the training losses unchanged")
    else:
        check(False, "runs with eval.every=10 exit 0")


def non_finite_steps(marrow, base, repo, tmp):
    # Non-finite steps: an absurd learning rate blows the weights up after the first update.
    out = os.path.join(tmp, "nan")
    code, stdout, stderr = run(marrow, base + ["--train.steps=20", "--optimizer.lr=1e30", "--optimizer.min_lr=0",
                                                    "--schedule.warmup_steps=0", "--optimizer.grad_clip=0",
                                                    "--train.max_bad_steps=3", f"--output.dir={out}"], repo)
    check(code != 0 and "the update is skipped" in stderr and re.search(r"stopping at step \d+: 3 steps in a row", stderr),
          "non-finite steps are skipped, then the run stops naming the step")


def expert_inputs(marrow, base, repo, tmp):
    # train.expert_inputs: x_perm gathered again for the backward gives the losses of keeping it, bit for
    # bit, and the start-up line says it is gathered (the CPU knows no memory limit: auto keeps).
    runs, said = [], []
    for inputs in ("auto", "keep", "gather"):
        out = os.path.join(tmp, f"inputs-{inputs}")
        code, stdout, _ = run(marrow, base + ["--train.steps=6", "--schedule.warmup_steps=2", f"--train.expert_inputs={inputs}",
                                                   f"--output.dir={out}"], repo)
        runs.append(losses(out) if code == 0 else None)
        said.append("experts' inputs (x_perm): gathered again for each layer's backward (train.expert_inputs = gather)" in stdout)
    check(said == [False, False, True], f"the start-up line says when x_perm is gathered again (auto, keep, gather: {said})")
    check(runs[0] is not None and runs[0] == runs[1] == runs[2], "train.expert_inputs=keep and =gather give the default's losses bit for bit")
    # The same through DualPipeV's order (parallel/dualpipev.h, one pipeline rank), whose micro-batches the pipeline sets up.
    piped = []
    for inputs in ("keep", "gather"):
        out = os.path.join(tmp, f"inputs-dualpipev-{inputs}")
        code, _, _ = run(marrow, base + ["--train.steps=4", "--schedule.warmup_steps=2", "--parallel.schedule=dualpipev",
                                              f"--train.expert_inputs={inputs}", f"--output.dir={out}"], repo)
        piped.append(losses(out) if code == 0 else None)
    check(piped[0] is not None and piped[0] == piped[1], "under DualPipeV's order too, keep and gather give the same losses bit for bit")


def bad_inputs(marrow, base, repo, tmp):
    # Bad inputs: one sentence each, non-zero exit.
    model = json.load(open("configs/tiny-moe.json"))
    cases = []
    cases.append(([os.path.join(tmp, "missing.toml")], "cannot open run config"))
    cases.append((base + ["--model.config=/nonexistent/config.json"], "model.config /nonexistent/config.json does not exist"))
    for edit, expected in [({"model_type": "llama"}, "unknown model_type 'llama'"),
                           ({"hidden_size": None}, "required key 'hidden_size' is missing"),
                           ({"num_experts": -8}, "key 'num_experts' must be a positive integer, got -8")]:
        m = dict(model)
        for k, v in edit.items():
            if v is None:
                m.pop(k)
            else:
                m[k] = v
        path = os.path.join(tmp, f"model-{len(cases)}.json")
        json.dump(m, open(path, "w"))
        cases.append((base + [f"--model.config={path}"], expected))
    cases.append((base + ["--train.stepz=3"], "unknown run-config key --train.stepz"))
    cases.append((base + ["--train.global_batch=8", "--train.micro_batch=3"],
                  "train.micro_batch (3) does not divide train.global_batch (8)"))
    cases.append((base + ["--train.seq_len=-5"], "--train.seq_len: must be a positive integer, got -5"))
    cases.append((base + ["--train.expert_inputs=drop"], "--train.expert_inputs"))
    cases.append((base + ["--data.path=/nonexistent/corpus"], "/nonexistent/corpus"))
    cases.append((base + ["--train.steps=100000000"], "but the run needs"))
    cases.append((base + ["--eval.every=5", "--eval.samples=100000"], "validation samples of 65 tokens but eval.samples is 100000"))
    cases.append((base + ["--output.dir", "--train.steps=3"], "--output.dir needs a value (write --output.dir=VALUE)"))
    cases.append((base + ["--output.dir="], "--output.dir has an empty value"))
    for argv, expected in cases:
        code, stdout, stderr = run(marrow, argv + [f"--output.dir={os.path.join(tmp, 'bad')}"], repo)
        lines = [l for l in stderr.strip().splitlines() if l]
        check(code == 1 and len(lines) == 1 and expected in lines[0] and "error:" in lines[0],
              f"bad input {argv[-1]!r}: {lines[-1] if lines else '(no message)'}")


def output_dir_below_a_file(marrow, base, repo, tmp):
    # An output.dir that cannot be created: one sentence naming it (tests/python/test_faults.py has more).
    a_file = os.path.join(tmp, "a-file")
    open(a_file, "w").close()
    code, stdout, stderr = run(marrow, base + [f"--output.dir={a_file}/run"], repo)
    lines = [l for l in stderr.strip().splitlines() if l]
    check(code == 1 and len(lines) == 1 and "error:" in lines[0] and f"cannot create output.dir {a_file}/run: " in lines[0],
          f"output.dir below a file: {lines[-1] if lines else '(no message)'}")

def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--marrow", required=True)
    parser.add_argument("--build-dir", required=True)
    args = parser.parse_args()
    repo = os.getcwd()
    corpus = os.path.join(os.environ.get("MARROW_DEMO_CORPUS", os.path.join(args.build_dir, "demo-corpus")), "corpus")
    base = ["configs/tiny-moe.toml", f"--data.path={corpus}", "--output.log_every=50", "--eval.every=0"]

    with tempfile.TemporaryDirectory() as tmp:
        for part in (loss_falls, same_seed_same_losses, paired_expert_gradients, expert_inputs, fp8_experts, validation_loss, non_finite_steps,
                     bad_inputs, output_dir_below_a_file):
            part(args.marrow, base, repo, tmp)

    print("PASS" if not FAILURES else "FAIL")
    sys.exit(1 if FAILURES else 0)


if __name__ == "__main__":
    main()
