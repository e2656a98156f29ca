"""Several processes on the CPU path (mpirun --oversubscribe): expert parallelism, fully sharded data
parallelism, context parallelism and the pipeline against one process.

- Layouts: EP = 2, EP = 4, DP = 2 (FSDP; with weights kept; with weights and whole gradients kept;
  replicated), DP = 2 x EP = 2, HSDP 2 x 2 (dp_shard = 2 of dp = 4) and DP = 4 train the tiny model 5 steps on
  the demo corpus; every step's loss, gradient norm and load balance, and every parameter and AdamW moment
  after the last step (sharded checkpoints assembled from their slices, each element written once), equal
  one process's (relative error <= 1e-6; the order of additions differs, so not bit for bit) and each
  other's. Two things make f32 runs of different layouts part further, so the strict comparison
  uses the tiny model with every expert active (K = E, as the GPU-vs-CPU checks do) at lr = 1e-5 and
  AdamW eps = 1e-6: routing to K < E experts is discontinuous (a rounding difference in front of a
  near-tie sends a token to another expert: one step's loss moves ~1e-5, that expert's gradient
  entirely), and AdamW divides by sqrt(v) + eps, so a gradient element that cancels to ~1e-10 moves its
  weight by ~lr * 1e-11 / eps (at the demo's lr = 3e-3, eps = 1e-8 the layouts drift ~1e-4 apart in a
  few steps), while a missing or doubled reduction (~lr per element, 1e-4 relative) still stands out.
  The AdamW moments are held to 1e-5: a norm weight's gradient sums ~10^3 terms that cancel, so its f32
  rounding alone reaches ~5e-7. The routed demo model (K = 2 of 8, tokens that skip ranks) is compared
  too, at its own lr, by the per-step losses (within 1e-4).
  tests/tools/parallel_check (ctest parallel.check_np*) checks the dispatch and combine
  of routed tokens exactly, in f64, and the collectives (in-place all_gather, accumulating reduce_scatter).
- Context parallelism (zigzag ring attention): CP = 2 and CP = 2 x EP = 2 (test_context_parallel), PP = 2 x CP = 2
  (test_pipeline) against one process as strictly as the layouts above, the validation loss too; a CP = 2
  checkpoint resumes on one process.
- Muon (optimizer.kind = "muon", test_muon_layouts): EP = 2, DP = 2, DP = 2 x EP = 2, HSDP 2 x 2 and PP = 2 against
  one process as strictly as the layouts above (the momentum in exp_avg); which tensors take Muon and which AdamW.
- Packed documents (data.document_mask, test_document_mask): on a corpus of short documents EP = 2, DP = 2, CP = 2,
  CP = 2 x EP = 2 and PP = 2 against one process as strictly as the layouts above, GPT-OSS and DeepSeek-V2 at CP = 2;
  with a loss mask (prompts tokenized with --loss-mask), DP = 2 and CP = 2 against one process.
- Initial weights: one step at a denormal lr leaves them as initialised; every mesh's equal one process's bit
  for bit (a shard draws the slice of the whole tensor's random numbers).
- Checkpoints: a checkpoint written by DP = 2 x EP = 2 (each rank its own slices) resumes on one process, on
  EP = 4, DP = 4 and DP = 2 with the losses of the straight run for the next 5 steps, and `marrow export`
  assembles it bit for bit.
- One 8-GPU node's layouts (issue #15): PP = 2 x EP = 4 and EP = 8 on 8 processes against one process; a
  PP = 2 x EP = 4 checkpoint resumes on 8 processes bit for bit and exports.
- Fail fast: one rank raising, exiting or hanging (MARROW_TEST_FAULT), or killed with SIGKILL, ends every
  rank within 30 s with a non-zero exit and the failing rank named; resuming afterwards continues
  bit for bit like a run that never failed.
- Impossible layouts are one sentence each.
Every mpirun gets a timeout, after which its whole process group is killed (the test then fails).
"""
import argparse
import glob
import json
import os
import signal
import subprocess
import sys
import tempfile
import time

import torch
from safetensors.torch import load_file

from checkpoint_tensors import checkpoint_tensors, relative_error

FAILURES = []
RUN_TIMEOUT_S = 120


def check(condition, what):
    print(("ok      " if condition else "FAILED  ") + what, flush=True)
    if not condition:
        FAILURES.append(what)


def environment():
    env = dict(os.environ)
    # Open MPI refuses root unless told; CI containers run as root and often forbid the cross-process
    # memory reads of its single-copy transport. ctest runs tests side by side, so a waiting rank yields its core
    # (Open MPI polls otherwise unless the job alone oversubscribes the machine).
    env.update(OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1", OMPI_MCA_rmaps_base_oversubscribe="1",
               OMPI_MCA_btl_vader_single_copy_mechanism="none", OMPI_MCA_mpi_yield_when_idle="1")
    env.pop("MARROW_TEST_FAULT", None)
    return env


def launch(args, np, out_dir, extra_env=None):
    """Starts `marrow train` on np processes (np = 0: without mpirun); returns the Popen."""
    command = [ARGS.marrow, "train", *COMMON, f"--output.dir={out_dir}", *args]
    if np > 0:
        command = ["mpirun", "--oversubscribe", "--bind-to", "none", "-np", str(np), *command]
    env = environment()
    env.update(extra_env or {})
    return subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, start_new_session=True)


def finish(proc, timeout=RUN_TIMEOUT_S):
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        err += f"\n[test: killed after {timeout} s]"
        return 124, out, err
    return proc.returncode, out, err


def train(args, np, out_dir, extra_env=None):
    code, out, err = finish(launch(args, np, out_dir, extra_env))
    if code != 0:
        print(out[-3000:], err[-3000:], sep="\n")
    return code, out, err


def metrics(out_dir):
    with open(os.path.join(out_dir, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f]


def compare_runs(name, dir_a, dir_b, step, bound=1e-6, moment_bound=1e-5):
    ma, mb = metrics(dir_a), metrics(dir_b)
    check(len(ma) == len(mb) == step, f"{name}: {len(mb)} steps logged, as {len(ma)}")
    worst = 0.0
    for a, b in zip(ma, mb):
        for key in ("loss", "grad_norm", "load_balance"):
            worst = max(worst, abs(a[key] - b[key]) / max(abs(a[key]), 1e-30))
    check(worst <= bound, f"{name}: losses, gradient norms and load balance within {bound:g} (worst relative error {worst:.2e})")
    ta = checkpoint_tensors(os.path.join(dir_a, f"step-{step:08d}"))
    tb = checkpoint_tensors(os.path.join(dir_b, f"step-{step:08d}"))
    check(ta.keys() == tb.keys(), f"{name}: the checkpoints hold the same {len(ta)} tensors")
    for group, limit in (("weights", bound), ("exp_avg", moment_bound), ("exp_avg_sq", moment_bound)):
        keys = [k for k in ta.keys() & tb.keys() if k[0] == group]
        worst_tensor = max(((relative_error(ta[k].float(), tb[k].float()), k[1]) for k in keys), default=(0.0, None))
        check(worst_tensor[0] <= limit, f"{name}: every tensor of {group} within {limit:g} (worst {worst_tensor[0]:.2e} in {worst_tensor[1]})")


SMOOTH_OPTIMIZER = ["--optimizer.lr=1e-5", "--optimizer.min_lr=1e-6", "--optimizer.eps=1e-6"]
LAYOUTS = {
    "one process": (0, ["--train.micro_batch=4"]),
    "EP=2": (2, ["--parallel.ep=2", "--train.micro_batch=2"]),
    "EP=4": (4, ["--parallel.ep=4", "--train.micro_batch=1"]),
    "DP=2 (FSDP)": (2, ["--train.micro_batch=2"]),
    "DP=2 (FSDP, kept whole)": (2, ["--train.micro_batch=2", "--parallel.keep_gathered=true", "--parallel.keep_whole_grads=true"]),
    "DP=2 (FSDP, weights kept)": (2, ["--train.micro_batch=2", "--parallel.keep_gathered=true"]),
    "DP=2 (replicated)": (2, ["--train.micro_batch=2", "--parallel.dp_shard=1"]),
    "DP=2 x EP=2": (4, ["--parallel.ep=2", "--train.micro_batch=1"]),
    "HSDP 2 x 2": (4, ["--parallel.dp_shard=2", "--train.micro_batch=1"]),
    "DP=4": (4, ["--train.micro_batch=1"]),
}


def dir_name(prefix, layout):
    return prefix + "".join(c for c in layout if c.isalnum())


def all_experts_config(tmp, layers=None):
    """The tiny model with num_experts_per_tok = num_experts: routing without discontinuities."""
    config = json.load(open("configs/tiny-moe.json"))
    config["num_experts_per_tok"] = config["num_experts"]
    if layers:
        config["num_hidden_layers"] = layers
    path = os.path.join(tmp, f"tiny-moe-all-experts{layers or ''}.json")
    json.dump(config, open(path, "w"))
    return path


def train_runs(runs, common, prefix, tmp, what):
    """Trains each run name: (np, args) with the common args in its own directory; returns the directories and stdouts."""
    dirs, outs = {}, {}
    for name, (np, args) in runs.items():
        dirs[name] = os.path.join(tmp, dir_name(prefix, name))
        code, outs[name], _ = train(args + common, np, dirs[name])
        check(code == 0, f"{name}, {what}: trains")
    return dirs, outs


def test_layouts(tmp):
    strict = [f"--model.config={all_experts_config(tmp)}", *SMOOTH_OPTIMIZER, "--checkpoint.every=5"]
    dirs, outs = train_runs(LAYOUTS, strict, "strict-", tmp, "all experts active")
    for name, (np, _) in LAYOUTS.items():
        if np > 0:
            check("mesh: " in outs[name], f"{name}: rank 0 prints the mesh")
    for name in LAYOUTS:
        if name != "one process":
            compare_runs(f"{name} vs one process", dirs["one process"], dirs[name], 5)
    compare_runs("EP=4 vs EP=2", dirs["EP=2"], dirs["EP=4"], 5)
    compare_runs("DP=2 x EP=2 vs EP=4", dirs["EP=4"], dirs["DP=2 x EP=2"], 5)
    for name in ("EP=2", "DP=2 (FSDP)", "HSDP 2 x 2"):
        files = sorted(os.path.basename(p) for p in glob.glob(os.path.join(dirs[name], "step-00000005", "*.safetensors")))
        check(any("rank00001" in f for f in files) and any("rank00000" in f for f in files),
              f"{name}: ranks 0 and 1 wrote their own checkpoint files ({len(files)} files)")
    files = glob.glob(os.path.join(dirs["HSDP 2 x 2"], "step-00000005", "*rank0000[23]*"))
    check(not files, "HSDP 2 x 2: the second replica writes nothing (ranks 2 and 3 hold the same shards as 0 and 1)")
    sliced = [e for e in json.load(open(os.path.join(dirs["DP=2 (FSDP)"], "step-00000005", "meta.json")))["files"] if "slices" in e]
    check(len(sliced) > 0, f"DP=2 (FSDP): meta.json records the slice offsets ({len(sliced)} files hold slices)")

    routed = {}
    for name in ("one process", "EP=2", "EP=4", "DP=2 x EP=2"):
        np, args = LAYOUTS[name]
        routed[name] = os.path.join(tmp, dir_name("routed-", name))
        check(train(args + ["--checkpoint.every=0"], np, routed[name])[0] == 0, f"{name}, routed demo model: trains 5 steps")
    want = [m["loss"] for m in metrics(routed["one process"])]
    for name in ("EP=2", "EP=4", "DP=2 x EP=2"):
        got = [m["loss"] for m in metrics(routed[name])]
        worst = max(abs(a - b) / abs(a) for a, b in zip(want, got)) if len(got) == len(want) == 5 else 1.0
        check(worst <= 1e-4, f"{name} vs one process, routed demo model: every loss within 1e-4 (worst {worst:.2e})")


def test_initial_weights(tmp):
    """lr = 1e-40 (a denormal: every update rounds away) and no weight decay: the step-1 checkpoint holds the
    initial weights, on every mesh bit for bit."""
    frozen = ["--optimizer.lr=1e-40", "--optimizer.min_lr=1e-40", "--optimizer.weight_decay=0", "--train.steps=1",
              "--checkpoint.every=1"]
    initial = {}
    for name in ("one process", "EP=2", "DP=2 (FSDP)", "DP=2 x EP=2", "HSDP 2 x 2", "DP=4"):
        np, args = LAYOUTS[name]
        out_dir = os.path.join(tmp, dir_name("initial-", name))
        check(train(args + frozen, np, out_dir)[0] == 0, f"{name}: one step at lr = 0")
        initial[name] = {k: t for k, t in checkpoint_tensors(os.path.join(out_dir, "step-00000001")).items() if k[0] == "weights"}
    one = initial["one process"]
    check(all(torch.equal(t, torch.ones_like(t)) for (_, n), t in one.items() if "norm" in n) and
          any(t.abs().max() > 0 for (_, n), t in one.items() if "proj" in n), "one process: step 1 left the initial weights (norms 1)")
    for name, tensors in initial.items():
        same = tensors.keys() == initial["one process"].keys() and all(torch.equal(t, initial["one process"][k]) for k, t in tensors.items())
        check(same, f"{name}: initial weights equal one process's bit for bit ({len(tensors)} tensors)")


def test_resume_on_other_layouts(tmp):
    # All experts active and a small lr, as in test_layouts, so that the layouts agree within 1e-6.
    smooth = [f"--model.config={all_experts_config(tmp)}", *SMOOTH_OPTIMIZER, "--train.steps=10"]
    straight = os.path.join(tmp, "straight10")
    check(train(smooth + ["--checkpoint.every=5", "--train.micro_batch=4"], 0, straight)[0] == 0, "one process: 10 steps")
    saved = os.path.join(tmp, "dp2ep2-10")
    check(train(smooth + ["--checkpoint.every=5", "--parallel.ep=2", "--train.micro_batch=1"], 4, saved)[0] == 0,
          "DP=2 x EP=2 (FSDP): 10 steps with a checkpoint at step 5")
    step5 = os.path.join(saved, "step-00000005")
    for name, np, args in [("one process", 0, ["--train.micro_batch=4"]), ("EP=4", 4, ["--parallel.ep=4", "--train.micro_batch=1"]),
                           ("DP=4", 4, ["--train.micro_batch=1"]), ("DP=2 (FSDP)", 2, ["--train.micro_batch=2"])]:
        out_dir = os.path.join(tmp, dir_name("resumed-", name))
        code, out, _ = train(smooth + ["--checkpoint.every=0", f"--checkpoint.resume={step5}", *args], np, out_dir)
        check(code == 0 and "resuming from" in out, f"the DP=2 x EP=2 checkpoint resumes on {name}")
        if code == 0:
            got = [m["loss"] for m in metrics(out_dir)]
            want = [m["loss"] for m in metrics(straight)][5:]
            worst = max(abs(a - b) / abs(a) for a, b in zip(want, got)) if len(got) == len(want) else 1.0
            check(len(got) == 5 and worst <= 1e-6, f"resumed on {name}: steps 6-10 match the straight run (worst {worst:.2e})")
    export = os.path.join(tmp, "export-dp2ep2")
    code = subprocess.run([ARGS.marrow, "export", step5, export], capture_output=True, text=True).returncode
    names = set()
    for path in glob.glob(os.path.join(export, "*.safetensors")):
        names |= set(load_file(path).keys())
    straight_names = {name for (group, name) in checkpoint_tensors(os.path.join(straight, "step-00000005")) if group == "weights"}
    check(code == 0 and names == straight_names, f"marrow export reads the sharded DP=2 x EP=2 checkpoint ({len(names)} tensors)")
    exported = {}
    for path in glob.glob(os.path.join(export, "*.safetensors")):
        exported.update(load_file(path))
    saved_weights = {name: t for (group, name), t in checkpoint_tensors(step5).items() if group == "weights"}
    check(all(torch.equal(exported[n], saved_weights[n]) for n in names & saved_weights.keys()),
          "the export's tensors are the checkpoint's slices assembled, bit for bit")


def schedule_lines(text):
    return [line[len("schedule: "):] for line in text.splitlines() if line.startswith("schedule: pipeline rank")]


def same_bits(label, plain_dir, overlapped_dir, norm_within=0.0):
    """The DualPipeV order's run against the sequential order's: losses, load balance and step 5's checkpoint bit for bit,
    gradient norms within norm_within relative."""
    plain, overlapped = metrics(plain_dir), metrics(overlapped_dir)
    check([[m["loss"], m["load_balance"]] for m in plain] == [[m["loss"], m["load_balance"]] for m in overlapped],
          f"{label}: the DualPipeV order's losses and load balance equal the sequential order's bit for bit")
    worst = max(abs(a["grad_norm"] - b["grad_norm"]) / abs(a["grad_norm"]) for a, b in zip(plain, overlapped))
    check(len(plain) == len(overlapped) and worst <= norm_within,
          f"{label}: the gradient norms agree within {norm_within:g} relative (worst {worst:.2e})")
    ta = checkpoint_tensors(os.path.join(plain_dir, "step-00000005"))
    tb = checkpoint_tensors(os.path.join(overlapped_dir, "step-00000005"))
    check(ta.keys() == tb.keys() and all(torch.equal(ta[k], tb[k]) for k in ta),
          f"{label}: after 5 steps every weight and AdamW moment of the DualPipeV order equals the sequential order's bit for bit")


def test_pipeline(tmp):
    """DualPipeV on the 4-layer tiny model (all experts active, small lr), 4 micro-batches per pipeline and step: PP = 2,
    PP = 2 x EP = 2 and PP = 2 x CP = 2 against one process; PP = 1's overlapped schedule against the plain one, bit for bit on
    one process and with EP = 2 (the gradient norm there within 1e-13); the
    trainer's printed order against `marrow estimate`'s simulated one; a PP = 2 checkpoint resumed on one process."""
    strict = [f"--model.config={all_experts_config(tmp, 4)}", *SMOOTH_OPTIMIZER, "--checkpoint.every=5"]
    runs = {
        "one process": (0, ["--train.micro_batch=4"]),
        "one process, sequential": (0, ["--train.micro_batch=2", "--parallel.schedule=sequential"]),
        "PP=1 (DualPipeV)": (0, ["--train.micro_batch=2", "--parallel.schedule=dualpipev", "--parallel.pp_layers=1,3"]),
        "PP=2": (2, ["--parallel.pp=2", "--train.micro_batch=2", "--parallel.print_schedule=true"]),
        "PP=2 x EP=2": (4, ["--parallel.pp=2", "--parallel.ep=2", "--train.micro_batch=1"]),
        "PP=2 x CP=2": (4, ["--parallel.pp=2", "--parallel.cp=2", "--train.micro_batch=2"]),
        "EP=2, sequential": (2, ["--parallel.ep=2", "--train.micro_batch=2", "--parallel.schedule=sequential",
                                 "--parallel.keep_gathered=true", "--parallel.keep_whole_grads=true"]),
        "EP=2 (DualPipeV)": (2, ["--parallel.ep=2", "--train.micro_batch=2", "--parallel.schedule=dualpipev"]),
    }
    dirs, outs = train_runs(runs, strict, "pipe-", tmp, "4 layers")
    for name in ("PP=2", "PP=2 x EP=2", "PP=2 x CP=2"):
        compare_runs(f"{name} vs one process", dirs["one process"], dirs[name], 5)
    # Uneven chunks across two pipeline ranks (4 layers allow only 1,1,1,1): a 6-layer model cut 2,1,2,1.
    six_layers = [f"--model.config={all_experts_config(tmp, 6)}", *SMOOTH_OPTIMIZER, "--checkpoint.every=5"]
    uneven = {"one process": (0, ["--train.micro_batch=4"]),
              "PP=2, layers 2,1,2,1": (2, ["--parallel.pp=2", "--train.micro_batch=2", "--parallel.pp_layers=2,1,2,1"])}
    six_dirs, six_outs = train_runs(uneven, six_layers, "pipe6-", tmp, "6 layers")
    compare_runs("PP=2 with layers 2,1,2,1 vs one process", six_dirs["one process"], six_dirs["PP=2, layers 2,1,2,1"], 5)
    check("decoder layers per chunk 2 1 2 1" in six_outs["PP=2, layers 2,1,2,1"], "the trainer prints the chunks it was given")
    same_bits("PP=1", dirs["one process, sequential"], dirs["PP=1 (DualPipeV)"])
    # With EP = 2 the overlapped pairs also move each dispatch plan behind the other micro-batch's stage. The weights
    # and moments stay bit for bit; the reported gradient norm differs in its last bits (~1e-15): the norms form one
    # FSDP unit per pipeline chunk, so the DualPipeV run's sharded gradient arena holds them in another order and the
    # norm's sum of squares runs in that order.
    same_bits("PP=1 x EP=2", dirs["EP=2, sequential"], dirs["EP=2 (DualPipeV)"], norm_within=1e-13)
    printed = schedule_lines(outs["PP=2"])
    estimate = subprocess.run([ARGS.marrow, "estimate", *COMMON, *strict, "--parallel.pp=2", "--train.micro_batch=2", "--world=2"],
                              capture_output=True, text=True)
    simulated = schedule_lines(estimate.stdout)
    check(len(printed) == 2 and printed == simulated,
          f"PP=2: the trainer's order of step 1 equals marrow estimate's simulated order ({len(printed)} and {len(simulated)} ranks)")
    check("bubble" in estimate.stdout, "marrow estimate prints the simulated bubble of PP=2")
    check("layers per chunk: 1 1 1 1 (parallel.pp_layers = auto)" in estimate.stdout and
          "decoder layers per chunk 1 1 1 1 (parallel.pp_layers = auto)" in outs["PP=2"],
          "marrow estimate and the trainer print the same chunks")
    six = ["--train.micro_batch=4", "--train.steps=6", "--checkpoint.every=0"]
    code, _, _ = train(strict + six, 0, dirs["one process"])
    resumed = os.path.join(tmp, "pipe-resumed")
    step5 = os.path.join(dirs["PP=2"], "step-00000005")
    code2, out, _ = train(strict + six + [f"--checkpoint.resume={step5}"], 0, resumed)
    check(code == 0 and code2 == 0 and "resuming from" in out, "the PP=2 checkpoint resumes on one process")
    if code == code2 == 0:
        want, got = metrics(dirs["one process"])[-1]["loss"], metrics(resumed)[-1]["loss"]
        check(abs(want - got) <= 1e-6 * abs(want), f"resumed from PP=2: step 6's loss is one process's ({got} vs {want})")


def test_context_parallel(tmp):
    """Context parallelism (zigzag ring attention) on the tiny model with all experts active and a small lr: CP = 2 and
    CP = 2 x EP = 2 against one process (losses, gradient norms, load balance, the validation loss, every weight and AdamW
    moment); a CP = 2 checkpoint resumed on one process."""
    strict = [f"--model.config={all_experts_config(tmp)}", *SMOOTH_OPTIMIZER, "--checkpoint.every=5", "--eval.every=5",
              "--eval.samples=4"]
    runs = {
        "one process": (0, ["--train.micro_batch=4"]),
        "CP=2": (2, ["--parallel.cp=2", "--train.micro_batch=4"]),
        "CP=2 x EP=2": (4, ["--parallel.cp=2", "--parallel.ep=2", "--train.micro_batch=2"]),
    }
    dirs, outs = train_runs(runs, strict, "cp-", tmp, "all experts active")
    for name, (np, _) in runs.items():
        if np > 0:
            check(f"cp 2 x ep {np // 2}" in outs[name], f"{name}: rank 0 prints the mesh with cp 2")
    for name in ("CP=2", "CP=2 x EP=2"):
        compare_runs(f"{name} vs one process", dirs["one process"], dirs[name], 5)
        want, got = metrics(dirs["one process"])[-1].get("val_loss"), metrics(dirs[name])[-1].get("val_loss")
        check(want is not None and got is not None and abs(want - got) <= 1e-6 * abs(want),
              f"{name}: the validation loss is one process's ({got} vs {want})")
    six = ["--train.micro_batch=4", "--train.steps=6", "--checkpoint.every=0", "--eval.every=0"]
    # Both resume a step-5 checkpoint of a 5-step run for a sixth step (the lr schedule spans the run).
    straight, resumed = dirs["one process"], os.path.join(tmp, "cp-resumed")
    code, _, _ = train(strict + six, 0, straight)
    step5 = os.path.join(dirs["CP=2"], "step-00000005")
    code2, out, _ = train(strict + six + [f"--checkpoint.resume={step5}"], 0, resumed)
    check(code == 0 and code2 == 0 and "resuming from" in out, "the CP=2 checkpoint resumes on one process")
    if code == code2 == 0:
        want, got = metrics(straight)[-1]["loss"], metrics(resumed)[-1]["loss"]
        check(abs(want - got) <= 1e-6 * abs(want), f"resumed from CP=2: step 6's loss is one process's ({got} vs {want})")


def ranks_of(mpirun_pid):
    out = subprocess.run(["pgrep", "-P", str(mpirun_pid)], capture_output=True, text=True).stdout
    return [int(p) for p in out.split()]


def test_fail_fast(tmp):
    base = ["--parallel.ep=2", "--train.micro_batch=2", "--train.steps=6", "--checkpoint.every=2"]
    straight = os.path.join(tmp, "faultless")
    check(train(base, 2, straight)[0] == 0, "EP=2: 6 steps without a fault")
    for kind in ("raise", "exit", "hang"):
        out_dir = os.path.join(tmp, "fault-" + kind)
        start = time.time()
        code, out, err = train(base + ["--parallel.timeout_s=3"], 2, out_dir, {"MARROW_TEST_FAULT": f"1:4:{kind}"})
        seconds = time.time() - start
        named = {"raise": "error on rank 1 of 2", "exit": "rank 1", "hang": "no progress for"}[kind]
        check(code != 0 and seconds < 30 and named in err,
              f"rank 1 {kind}s at step 4: the job ends in {seconds:.1f} s with exit {code}, naming '{named}'")
        code, out, _ = train(base, 2, out_dir)
        check(code == 0 and "resuming from" in out, f"after the {kind}: the same command resumes")
        if code == 0:
            same = [m["loss"] for m in metrics(out_dir)] == [m["loss"] for m in metrics(straight)]
            check(same, f"after the {kind}: every loss equals the faultless run's bit for bit")
    out_dir = os.path.join(tmp, "fault-kill")
    proc = launch(base + ["--train.steps=400", "--checkpoint.every=0"], 2, out_dir)
    deadline = time.time() + 60
    while time.time() < deadline and not (os.path.exists(os.path.join(out_dir, "metrics.jsonl")) and
                                          os.path.getsize(os.path.join(out_dir, "metrics.jsonl")) > 0):
        time.sleep(0.2)
    ranks = ranks_of(proc.pid)
    check(len(ranks) == 2, f"mpirun started 2 ranks ({ranks})")
    if ranks:
        os.kill(ranks[-1], signal.SIGKILL)
    start = time.time()
    code, _, err = finish(proc, timeout=60)
    seconds = time.time() - start
    # mpirun names the rank: "mpirun noticed that process rank 1 with PID ... exited on signal 9".
    check(code != 0 and seconds < 30 and "rank" in err,
          f"one rank killed with SIGKILL: the job ends in {seconds:.1f} s with exit {code}, naming the rank")


def test_full_node(tmp):
    """Issue #15's two layouts of one 8-GPU node, PP = 2 x EP = 4 and EP = 8, on 8 processes: the 4-layer tiny model with all
    experts active, 4 micro-batches per pipeline, 4 steps against one process; the PP = 2 x EP = 4 checkpoint of step 2
    resumed on 8 processes continues bit for bit (losses, every weight and moment of step 4); `marrow export` assembles it."""
    strict = [f"--model.config={all_experts_config(tmp, 4)}", *SMOOTH_OPTIMIZER, "--train.steps=4", "--train.global_batch=16",
              "--checkpoint.every=2"]
    runs = {
        "one process": (0, ["--train.micro_batch=4"]),
        "PP=2 x EP=4": (8, ["--parallel.pp=2", "--parallel.ep=4", "--train.micro_batch=1"]),
        "EP=8": (8, ["--parallel.ep=8", "--train.micro_batch=1"]),
    }
    dirs, outs = train_runs(runs, strict, "node-", tmp, "8 processes")
    check("pp 2 x dp 1 x cp 1 x ep 4" in outs["PP=2 x EP=4"], "PP=2 x EP=4: rank 0 prints the mesh of 8 processes")
    for name in ("PP=2 x EP=4", "EP=8"):
        compare_runs(f"{name} vs one process", dirs["one process"], dirs[name], 4)
    step2 = os.path.join(dirs["PP=2 x EP=4"], "step-00000002")
    resumed = os.path.join(tmp, "node-resumed")
    code, out, _ = train(strict + runs["PP=2 x EP=4"][1] + [f"--checkpoint.resume={step2}"], 8, resumed)
    check(code == 0 and "resuming from" in out, "the PP=2 x EP=4 checkpoint of step 2 resumes on 8 processes")
    if code == 0:
        want = [m["loss"] for m in metrics(dirs["PP=2 x EP=4"])][2:]
        check([m["loss"] for m in metrics(resumed)] == want, "resumed on PP=2 x EP=4: the losses of steps 3-4 equal the straight run's bit for bit")
        ta = checkpoint_tensors(os.path.join(dirs["PP=2 x EP=4"], "step-00000004"))
        tb = checkpoint_tensors(os.path.join(resumed, "step-00000004"))
        check(ta.keys() == tb.keys() and all(torch.equal(ta[k], tb[k]) for k in ta),
              f"resumed on PP=2 x EP=4: step 4's {len(ta)} weights and moments equal the straight run's bit for bit")
    export = os.path.join(tmp, "export-pp2ep4")
    code = subprocess.run([ARGS.marrow, "export", step2, export], capture_output=True, text=True).returncode
    exported = {}
    for path in glob.glob(os.path.join(export, "*.safetensors")):
        exported.update(load_file(path))
    saved = {name: t for (group, name), t in checkpoint_tensors(step2).items() if group == "weights"}
    check(code == 0 and exported.keys() == saved.keys() and all(torch.equal(exported[n], saved[n]) for n in saved),
          f"marrow export assembles the PP=2 x EP=4 checkpoint bit for bit ({len(exported)} tensors)")


def test_bad_layouts(tmp):
    cases = [
        (2, ["--parallel.pp=2", "--train.micro_batch=2"], "cuts the model into 4 pipeline chunks but it has only 2 decoder layers"),
        (2, ["--parallel.pp=2", "--train.micro_batch=4"], "DualPipeV needs at least 2 x parallel.pp = 4 micro-batches per step"),
        (2, ["--parallel.ep=4"], "does not divide"),
        (4, ["--parallel.dp_shard=3", "--train.micro_batch=1"], "parallel.dp_shard (3) does not divide the 4 data-parallel ranks"),
        (3, ["--parallel.ep=3", "--train.micro_batch=1", "--train.global_batch=6"], "is not a multiple of parallel.ep"),
        (4, ["--parallel.ep=2", "--train.micro_batch=1", "--train.global_batch=6"], "is not a multiple of the 4 data-parallel processes"),
        (2, ["--parallel.cp=2", "--train.seq_len=30"], "train.seq_len (30) is not a multiple of 2 x parallel.cp = 4"),
        (0, ["--parallel.pp_layers=even"], "parallel.pp_layers = even splits DualPipeV's chunks, but this run has none"),
        (0, ["--parallel.schedule=dualpipev", "--train.micro_batch=2", "--parallel.pp_layers=1,2"],
         "parallel.pp_layers = '1,2' gives 2 chunks of 3 layers in all; parallel.pp = 1 needs 2 chunks and the model has 2 decoder layers"),
    ]
    for np, args, sentence in cases:
        start = time.time()
        code, _, err = train(args, np, os.path.join(tmp, "bad"))
        check(code != 0 and sentence in err and time.time() - start < 30, f"{' '.join(args)} on {np} processes: '{sentence}'")


def test_fp8_layouts(tmp):
    # train.fp8 under expert and data parallelism: a layer's FP8 weights are made from the process's
    # own experts, rows are quantized one by one, so the layouts follow one process. Not bit for bit:
    # the layouts' different summation orders leave ~1e-7 differences in the weights, which can move
    # a value across an E4M3 rounding boundary (a step of 1/16 of it): on the tiny model losses stay
    # within ~1e-4 and weights within ~4e-4, while the AdamW moments of the small norm gradients move
    # by a few percent. Two layouts with the same summation order (EP=2, DP=2 x EP=2) stay closer.
    runs = {name: LAYOUTS[name] for name in ("one process", "EP=2", "DP=2 x EP=2")}
    strict = [f"--model.config={all_experts_config(tmp)}", *SMOOTH_OPTIMIZER, "--checkpoint.every=5", "--train.fp8=true"]
    dirs, _ = train_runs(runs, strict, "fp8-", tmp, "train.fp8")
    for name in ("EP=2", "DP=2 x EP=2"):
        compare_runs(f"train.fp8, {name} vs one process", dirs["one process"], dirs[name], 5, bound=1e-3, moment_bound=0.1)
    compare_runs("train.fp8, DP=2 x EP=2 vs EP=2", dirs["EP=2"], dirs["DP=2 x EP=2"], 5, bound=1e-5, moment_bound=1e-2)


def test_bf16_moments_layouts(tmp):
    # optimizer.moments = "bf16" under FSDP and EP: the shards of the moments are bf16 arenas, saved
    # as bf16 slices. The layouts' ~1e-7 differences can move a moment across a bf16 rounding step
    # (1/256 of it), so moments agree within a few bf16 steps of the tensor's largest and weights within 1e-5;
    # a shard placed or saved at a wrong offset would miss by orders of magnitude.
    runs = {name: LAYOUTS[name] for name in ("one process", "DP=2 (FSDP)", "DP=2 x EP=2")}
    strict = [f"--model.config={all_experts_config(tmp)}", *SMOOTH_OPTIMIZER, "--checkpoint.every=5", "--optimizer.moments=bf16"]
    dirs, outs = train_runs(runs, strict, "bf16-moments-", tmp, "optimizer.moments = bf16")
    check(all("adam exp_avg (bf16)" in out for out in outs.values()), "every layout prints its moments' arenas as bf16")
    for name in ("DP=2 (FSDP)", "DP=2 x EP=2"):
        compare_runs(f"bf16 moments, {name} vs one process", dirs["one process"], dirs[name], 5, bound=1e-5, moment_bound=2e-2)
    moments = [t for k, t in checkpoint_tensors(os.path.join(dirs["DP=2 (FSDP)"], "step-00000005")).items() if k[0] != "weights"]
    check(moments and all(t.dtype == torch.bfloat16 for t in moments),
          f"bf16 moments, DP=2 (FSDP): every saved moment slice is bf16 ({len(moments)} tensors)")


def test_muon_layouts(tmp):
    # optimizer.kind = "muon": a sharded matrix is gathered, orthogonalized by its owner and scattered back
    # (ShardedParameters::muon_unit), so every layout takes one process's update; the momentum is exp_avg.
    # Newton-Schulz amplifies the layouts' ~1e-7 differences of the small singular directions (the quintic's
    # slope near 0 is 3.4 a step), so the momentum is held to 1e-5 and the weights to 1e-6 at the small lr.
    runs = {name: LAYOUTS[name] for name in ("one process", "EP=2", "DP=2 (FSDP)", "DP=2 x EP=2", "HSDP 2 x 2")}
    strict = [f"--model.config={all_experts_config(tmp)}", *SMOOTH_OPTIMIZER, "--checkpoint.every=5", "--optimizer.kind=muon"]
    dirs, _ = train_runs(runs, strict, "muon-", tmp, "optimizer.kind = muon")
    for name in runs:
        if name != "one process":
            compare_runs(f"Muon, {name} vs one process", dirs["one process"], dirs[name], 5)
    four = [f"--model.config={all_experts_config(tmp, 4)}", *SMOOTH_OPTIMIZER, "--checkpoint.every=5", "--optimizer.kind=muon"]
    pipe = {"one process": (0, ["--train.micro_batch=4"]), "PP=2": (2, ["--parallel.pp=2", "--train.micro_batch=2"])}
    pipe_dirs, _ = train_runs(pipe, four, "muon-pipe-", tmp, "optimizer.kind = muon, 4 layers")
    compare_runs("Muon, PP=2 vs one process", pipe_dirs["one process"], pipe_dirs["PP=2"], 5)
    # Muon's matrices keep their momentum in exp_avg and never touch exp_avg_sq; AdamW's tensors fill both.
    tensors = checkpoint_tensors(os.path.join(dirs["one process"], "step-00000005"))
    muon = sorted(k[1] for k, t in tensors.items() if k[0] == "exp_avg_sq" and not t.any())
    adamw = ("embed_tokens.weight", "lm_head.weight", "mlp.gate.weight", "norm.weight")
    check(any("experts.0.down_proj" in n for n in muon) and any("o_proj" in n for n in muon)
          and not any(n.endswith(adamw) for n in muon)
          and all(tensors[("exp_avg", n)].any() for n in muon),
          f"Muon takes the experts' and attention matrices, AdamW the embeddings, LM head, router and norms ({len(muon)} Muon tensors)")


def short_documents_corpus(tmp, loss_mask=False):
    """A corpus of 3000 documents of 1 to 24 words (3 to ~60 tokens), so every 32-token window of the
    tests holds document boundaries, inside zigzag chunks (CP = 2: chunks of 8) and across them; with
    loss_mask each document follows a prompt of 1 to 5 words that carries no loss (--loss-mask prompt)."""
    words = ["alpha", "beta", "gamma", "delta", "list", "tuple", "return", "value", "class", "import", "the", "of", "and"]
    name = "short-docs-masked" if loss_mask else "short-docs"
    path, out = os.path.join(tmp, name + ".jsonl"), os.path.join(tmp, name)
    with open(path, "w") as f:
        for i in range(3000):
            text = " ".join(words[(i * 7 + j * j) % len(words)] for j in range(1 + (i * 5) % 24))
            f.write(json.dumps({"text": text, "prompt": " ".join(words[(i + j) % len(words)] for j in range(1 + i % 5))}) + "\n")
    tokenizer = os.path.join(os.path.dirname(COMMON[1].split("=", 1)[1]), "tokenizer.json")
    mask = ["--loss-mask", "prompt"] if loss_mask else []
    subprocess.run([ARGS.marrow, "tokenize", "--quiet", "--input", path, "--tokenizer", tokenizer, "--out", out, *mask], check=True)
    return out


def test_document_mask(tmp):
    """data.document_mask (packed documents) on a corpus of short documents: EP = 2, DP = 2 (FSDP), CP = 2, CP = 2 x EP = 2
    and PP = 2 against one process as strictly as the layouts above; GPT-OSS (sinks, a sliding window) and DeepSeek-V2 (MLA,
    packed K/V under CP; routed, so at the small lr) at CP = 2 against one process; the mask changes the losses (the corpus
    does hold boundaries); with a loss mask, DP = 2 and CP = 2 against one process and the loss moves."""
    packed = [f"--data.path={short_documents_corpus(tmp)}", "--data.document_mask=true"]
    strict = [f"--model.config={all_experts_config(tmp)}", *SMOOTH_OPTIMIZER, "--checkpoint.every=5", *packed]
    runs = {name: LAYOUTS[name] for name in ("one process", "EP=2", "DP=2 (FSDP)")}
    runs["CP=2"] = (2, ["--parallel.cp=2", "--train.micro_batch=4"])
    runs["CP=2 x EP=2"] = (4, ["--parallel.cp=2", "--parallel.ep=2", "--train.micro_batch=2"])
    dirs, _ = train_runs(runs, strict, "docs-", tmp, "document_mask")
    for name in runs:
        if name != "one process":
            compare_runs(f"document_mask, {name} vs one process", dirs["one process"], dirs[name], 5)
    unmasked = os.path.join(tmp, "docs-unmasked")
    train(LAYOUTS["one process"][1] + strict + ["--data.document_mask=false"], 0, unmasked)
    a, b = metrics(dirs["one process"]), metrics(unmasked)
    check(len(a) == len(b) == 5 and a[0]["loss"] != b[0]["loss"], "document_mask changes the loss of a corpus of short documents")
    four = [f"--model.config={all_experts_config(tmp, 4)}", *SMOOTH_OPTIMIZER, "--checkpoint.every=5", *packed]
    pipe = {"one process": (0, ["--train.micro_batch=4"]), "PP=2": (2, ["--parallel.pp=2", "--train.micro_batch=2"])}
    pipe_dirs, _ = train_runs(pipe, four, "docs-pipe-", tmp, "document_mask, 4 layers")
    compare_runs("document_mask, PP=2 vs one process", pipe_dirs["one process"], pipe_dirs["PP=2"], 5)
    for family in ("configs/tiny-gpt-oss.json", "configs/tiny-deepseek-v2.json"):
        family_runs = {"one process": (0, ["--train.micro_batch=4"]), "CP=2": (2, ["--parallel.cp=2", "--train.micro_batch=4"])}
        family_dirs, _ = train_runs(family_runs, [f"--model.config={family}", *SMOOTH_OPTIMIZER, "--checkpoint.every=0", *packed], "docs-" + os.path.basename(family)[:-5], tmp,
                                    f"document_mask, {family}")
        want, got = metrics(family_dirs["one process"]), metrics(family_dirs["CP=2"])
        worst = max((abs(x[k] - y[k]) / abs(x[k]) for x, y in zip(want, got) for k in ("loss", "grad_norm")), default=1.0)
        check(len(want) == len(got) == 5 and worst <= 1e-6, f"document_mask, {family}: CP=2 vs one process within 1e-6 (worst {worst:.2e})")
    # data.loss_mask: the loss is the mean over the targets the prompts leave, counted over the whole step on every rank.
    masked = [f"--data.path={short_documents_corpus(tmp, True)}", "--data.document_mask=true", "--data.loss_mask=true"]
    strict_masked = [f"--model.config={all_experts_config(tmp)}", *SMOOTH_OPTIMIZER, "--checkpoint.every=5", *masked]
    mask_runs = {name: runs[name] for name in ("one process", "DP=2 (FSDP)", "CP=2")}
    mask_dirs, _ = train_runs(mask_runs, strict_masked, "loss-mask-", tmp, "loss_mask")
    for name in ("DP=2 (FSDP)", "CP=2"):
        compare_runs(f"loss_mask, {name} vs one process", mask_dirs["one process"], mask_dirs[name], 5)
    unmasked = os.path.join(tmp, "loss-mask-off")
    train(LAYOUTS["one process"][1] + strict_masked + ["--data.loss_mask=false"], 0, unmasked)
    a, b = metrics(mask_dirs["one process"]), metrics(unmasked)
    check(len(a) == len(b) == 5 and a[0]["loss"] != b[0]["loss"], "loss_mask changes the loss (the prompts' targets are left out)")


def main():
    global ARGS, COMMON
    parser = argparse.ArgumentParser()
    parser.add_argument("--marrow", required=True)
    parser.add_argument("--build-dir", required=True)
    parser.add_argument("--only", help="run the tests whose name contains this (e.g. context_parallel)")
    ARGS = parser.parse_args()
    corpus = os.environ.get("MARROW_DEMO_CORPUS", os.path.join(ARGS.build_dir, "demo-corpus"))
    COMMON = ["configs/tiny-moe.toml", f"--data.path={corpus}/corpus", "--train.steps=5", "--train.global_batch=8",
              "--train.seq_len=32", "--schedule.warmup_steps=1", "--eval.every=0", "--train.device=cpu"]
    torch.set_printoptions(precision=10)
    tests = [test_pipeline, test_context_parallel, test_document_mask, test_layouts, test_fp8_layouts, test_bf16_moments_layouts, test_muon_layouts, test_initial_weights, test_resume_on_other_layouts,
             test_full_node, test_fail_fast, test_bad_layouts]
    with tempfile.TemporaryDirectory() as tmp:
        for test in tests:
            if not ARGS.only or ARGS.only in test.__name__:
                test(tmp)
    if FAILURES:
        print(f"FAIL: {len(FAILURES)} checks failed", flush=True)
        sys.exit(1)
    print("PASS", flush=True)


if __name__ == "__main__":
    main()
