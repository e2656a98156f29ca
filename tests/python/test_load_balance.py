"""The load-balance forms (train.load_balance) and DeepSeek-V3's expert bias (train.expert_bias_update) through
`marrow train` on the CPU, against one process (helpers of test_parallel.py).

- Forms: micro_batch, global_batch and sequence on the routed 4-layer tiny model (K = 2 of 8, a load-balance coefficient of 0.5
  so that its gradient counts, lr 1e-5): EP = 2, DP = 2 x EP = 2, CP = 2 and PP = 2 (DualPipeV) against one process
  with the same micro-batches a step, every step's loss, gradient norm and load balance and the step-5 checkpoint
  within 1e-5 (routing near-ties, AGENTS.md). The global form's running sums follow the micro-batch order, so
  DualPipeV on one process equals the sequential order bit for bit; with one micro-batch a step it is the micro-batch
  form bit for bit; train.load_balance = micro_batch is the default's bits; the three forms' load balance differ.
- Expert bias: the bias in the step-4 checkpoint is the rule applied to the loads metrics.jsonl logged, bit for bit;
  DP = 2 x EP = 2 and PP = 2 hold one process's bias; a resume continues bit for bit; a checkpoint without a bias
  resumes with zeros; `marrow export` refuses a non-zero bias.
"""
import argparse
import json
import os
import subprocess
import sys
import tempfile

import numpy as np

import test_parallel as tp
from test_parallel import check, compare_runs, metrics, train, train_runs, same_bits

ROUTED = ["--train.aux_loss_coef=0.5", *tp.SMOOTH_OPTIMIZER, "--checkpoint.every=5"]
LAYOUTS = {
    "one process": (0, ["--train.micro_batch=4"]),
    "one process, micro-batch 2": (0, ["--train.micro_batch=2", "--parallel.schedule=sequential"]),
    "EP=2": (2, ["--parallel.ep=2", "--train.micro_batch=2"]),
    "DP=2 x EP=2": (4, ["--parallel.ep=2", "--train.micro_batch=1"]),
    "CP=2": (2, ["--parallel.cp=2", "--train.micro_batch=4"]),
    "PP=2": (2, ["--parallel.pp=2", "--train.micro_batch=2"]),
    "PP=1 (DualPipeV)": (0, ["--train.micro_batch=2", "--parallel.schedule=dualpipev", "--parallel.pp_layers=1,3"]),
}
# The one-process run with the layout's micro-batches a step (the global form depends on them).
BASE = {"PP=2": "one process, micro-batch 2", "PP=1 (DualPipeV)": "one process, micro-batch 2"}


def routed_config(tmp):
    config = json.load(open("configs/tiny-moe.json"))
    config["num_hidden_layers"] = 4
    path = os.path.join(tmp, "tiny-moe-routed4.json")
    json.dump(config, open(path, "w"))
    return path


def test_forms(tmp):
    common = [f"--model.config={routed_config(tmp)}", *ROUTED]
    balance = {}
    for form in ("micro_batch", "global_batch", "sequence"):
        dirs, _ = train_runs(LAYOUTS, common + [f"--train.load_balance={form}"], f"{form}-", tmp, form)
        for name in ("EP=2", "DP=2 x EP=2", "CP=2", "PP=2"):
            base = BASE.get(name, "one process")
            compare_runs(f"{form}, {name} vs {base}", dirs[base], dirs[name], 5, bound=1e-5, moment_bound=1e-4)
        same_bits(f"{form}, PP=1", dirs["one process, micro-batch 2"], dirs["PP=1 (DualPipeV)"])
        balance[form] = [m["load_balance"] for m in metrics(dirs["one process"])]
    runs = {"default": (0, ["--train.micro_batch=4"]), "micro_batch": (0, ["--train.micro_batch=4", "--train.load_balance=micro_batch"]),
            "global_batch, one micro-batch": (0, ["--train.micro_batch=8", "--train.load_balance=global_batch"]),
            "micro_batch, one micro-batch": (0, ["--train.micro_batch=8"])}
    dirs, _ = train_runs(runs, common, "forms-", tmp, "one process")
    same = lambda a, b: [[m["loss"], m["load_balance"], m["grad_norm"]] for m in metrics(dirs[a])] == \
        [[m["loss"], m["load_balance"], m["grad_norm"]] for m in metrics(dirs[b])]
    check(same("default", "micro_batch"), "train.load_balance = micro_batch gives the default's losses bit for bit")
    check(same("global_batch, one micro-batch", "micro_batch, one micro-batch"),
          "global_batch with one micro-batch a step gives the micro-batch form's losses bit for bit")
    firsts = {form: values[0] for form, values in balance.items()}
    check(len(set(firsts.values())) == 3, f"the three forms give three load balances at step 1: {firsts}")


def expected_bias(loads_by_step, rate):
    """The rule in float32: bias += rate where the load is below the layer's mean, -= where above."""
    bias = np.zeros(np.array(loads_by_step[0]).shape, dtype=np.float32)
    step = np.float32(rate)
    for loads in loads_by_step:
        loads = np.array(loads, dtype=np.float64)
        mean = loads.sum(axis=1, keepdims=True) / loads.shape[1]
        bias = np.where(loads < mean, bias + step, np.where(loads > mean, bias - step, bias)).astype(np.float32)
    return bias


def saved_bias(out_dir, step):
    meta = json.load(open(os.path.join(out_dir, f"step-{step:08d}", "meta.json")))
    return np.array(meta.get("expert_bias", []), dtype=np.float32)


def test_expert_bias(tmp):
    rate = 1e-3
    common = [f"--model.config={routed_config(tmp)}", *ROUTED, "--train.steps=4", "--checkpoint.every=2", f"--train.expert_bias_update={rate}"]
    runs = {name: LAYOUTS[name] for name in ("one process", "one process, micro-batch 2", "DP=2 x EP=2", "PP=2")}
    dirs, _ = train_runs(runs, common, "bias-", tmp, "expert bias")
    logged = [m["expert_load"] for m in metrics(dirs["one process"])]
    check(len(logged) == 4 and all(sum(layer) == 8 * 32 * 2 for loads in logged for layer in loads),
          "metrics.jsonl logs each step's loads: every layer's sum is the step's 512 routed copies")
    want = expected_bias(logged, rate)
    got = saved_bias(dirs["one process"], 4).reshape(want.shape)
    check(np.array_equal(got, want) and np.abs(want).max() > 0, f"the step-4 bias is the rule applied to the logged loads (largest {np.abs(want).max():g})")
    for name in ("DP=2 x EP=2", "PP=2"):
        base = BASE.get(name, "one process")
        check(np.array_equal(saved_bias(dirs[name], 4), saved_bias(dirs[base], 4)), f"{name} holds the bias of {base}, bit for bit")
        ma, mb = metrics(dirs[base]), metrics(dirs[name])
        worst = max(abs(a["loss"] - b["loss"]) / abs(a["loss"]) for a, b in zip(ma, mb))
        check(len(ma) == len(mb) == 4 and worst <= 1e-5, f"{name} with the expert bias: losses within 1e-5 of {base} ({worst:.2e})")
    resumed = os.path.join(tmp, "bias-resumed")
    step2 = os.path.join(dirs["one process"], "step-00000002")
    code, _, _ = train(common + ["--train.micro_batch=4", f"--checkpoint.resume={step2}"], 0, resumed)
    straight = [[m["loss"], m["grad_norm"], m["expert_load"]] for m in metrics(dirs["one process"])][2:]
    check(code == 0 and [[m["loss"], m["grad_norm"], m["expert_load"]] for m in metrics(resumed)] == straight and
          np.array_equal(saved_bias(resumed, 4), got.reshape(-1)), "resumed at step 2: steps 3-4 and the bias equal the straight run's bit for bit")
    plain = os.path.join(tmp, "bias-none")
    off = [a for a in common if not a.startswith("--train.expert_bias_update")] + ["--train.micro_batch=4"]
    code = train(off, 0, plain)[0]
    with_zeros = os.path.join(tmp, "bias-from-none")
    code2 = train(off + [f"--train.expert_bias_update={rate}", f"--checkpoint.resume={plain}/step-00000002"], 0, with_zeros)[0]
    check(code == code2 == 0 and metrics(with_zeros)[0]["loss"] == metrics(plain)[2]["loss"],
          "a checkpoint without a bias resumes with zeros: step 3 is the bias-free run's bit for bit")
    export = subprocess.run([tp.ARGS.marrow, "export", os.path.join(dirs["one process"], "step-00000004"), os.path.join(tmp, "bias-export")],
                            capture_output=True, text=True)
    check(export.returncode == 1 and "non-zero expert bias" in export.stderr, f"marrow export refuses a non-zero bias: {export.stderr.strip()}")


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--marrow", required=True)
    parser.add_argument("--build-dir", required=True)
    parser.add_argument("--only", help="run the tests whose name contains this")
    tp.ARGS = parser.parse_args()
    corpus = os.environ.get("MARROW_DEMO_CORPUS", os.path.join(tp.ARGS.build_dir, "demo-corpus"))
    tp.COMMON = ["configs/tiny-moe.toml", f"--data.path={corpus}/corpus", "--train.steps=5", "--train.global_batch=8",
                 "--train.seq_len=32", "--schedule.warmup_steps=1", "--eval.every=0", "--train.device=cpu"]
    with tempfile.TemporaryDirectory() as tmp:
        for test in (test_forms, test_expert_bias):
            if not tp.ARGS.only or tp.ARGS.only in test.__name__:
                test(tmp)
    if tp.FAILURES:
        print(f"FAIL: {len(tp.FAILURES)} checks failed", flush=True)
        sys.exit(1)
    print("PASS", flush=True)


if __name__ == "__main__":
    main()
