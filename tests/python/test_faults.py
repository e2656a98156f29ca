"""The fault suite (issue #16): bad inputs and faults, each one row of FAULTS.

A row runs one marrow command against a fresh copy of a small trained run (10 steps, checkpoints at
steps 5 and 10) and asserts
- the exit code;
- on failure, that stderr holds exactly one line (warnings and notes aside), `marrow <cmd>: error: ...`,
  containing the row's fragment; on success, that the fragment is in the output;
- that every file which existed under the row's `unchanged` paths before is byte for byte the same
  afterwards (the run lock's file aside, which names its last holder), and that `absent` paths do not exist.

To add a case, add a Fault(...) row. Placeholders in args and paths: {run} (the copy of the trained
run), {corpus} (the demo corpus), {tmp} (a directory of the row's own), plus whatever its setup adds.
A full disk is simulated with RLIMIT_FSIZE (fsize=bytes; SIGXFSZ ignored, so writes past it fail
with EFBIG): it needs no root, no tmpfs and no mount, so it works in an unprivileged container.
"""
import argparse
import hashlib
import json
import os
import resource
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from typing import Callable, Optional

FAILURES = []


def check(condition, what):
    print(("ok      " if condition else "FAILED  ") + what, flush=True)
    if not condition:
        FAILURES.append(what)


# Arguments shared by every training command: the tiny model on the demo corpus, 4 sequences a step.
BASE = ["configs/tiny-moe.toml", "--data.path={corpus}", "--train.global_batch=4", "--train.micro_batch=4", "--eval.every=0",
        "--schedule.warmup_steps=1", "--checkpoint.every=5", "--output.log_every=5"]


def train(*extra, out="{run}", steps=11):
    """Continues the trained run (10 steps) by default: one step more."""
    return ["train", *BASE, f"--output.dir={out}", f"--train.steps={steps}", *extra]


@dataclass
class Fault:
    name: str
    args: list                       # the marrow command line
    code: int                        # expected exit code
    fragment: str                    # in the one error line (code != 0) or anywhere in the output (code 0)
    unchanged: list = field(default_factory=lambda: ["{run}"])  # every file there stays byte for byte the same
    absent: list = field(default_factory=list)                  # paths that must not exist afterwards
    setup: Optional[Callable] = None  # setup(ctx): prepares inputs, may add placeholders to ctx
    after: Optional[Callable] = None  # after(ctx) -> (ok, what): a further check
    fsize: Optional[int] = None       # RLIMIT_FSIZE in bytes: the disk is full beyond it
    env: dict = field(default_factory=dict)


# --- setups -----------------------------------------------------------------------------------------

def sha256(path):
    return hashlib.sha256(open(path, "rb").read()).hexdigest()


def corpus_copy(ctx, name, change):
    """A copy of the demo corpus in {tmp}/name, changed by change(dir, manifest) and made consistent again
    (every sha256 in the manifest recomputed), as a buggy or foreign tool would leave it."""
    out = os.path.join(ctx["tmp"], name)
    shutil.copytree(ctx["corpus"], out)
    manifest = json.load(open(os.path.join(out, "manifest.json")))
    change(out, manifest)
    for shard in manifest["shards"]:
        shard["sha256"] = sha256(os.path.join(out, shard["file"]))
    manifest["tokenizer_sha256"] = sha256(os.path.join(out, "tokenizer.json"))
    json.dump(manifest, open(os.path.join(out, "manifest.json"), "w"))
    ctx[name] = out


def other_tokenizer(ctx):
    def change(out, manifest):
        t = json.load(open(os.path.join(out, "tokenizer.json")))
        vocab = t["model"]["vocab"]
        a, b = sorted(vocab, key=vocab.get)[300:302]  # two ordinary tokens swap their ids
        vocab[a], vocab[b] = vocab[b], vocab[a]
        json.dump(t, open(os.path.join(out, "tokenizer.json"), "w"))
    corpus_copy(ctx, "other_tokenizer", change)


def id_past_vocab(ctx):
    def change(out, manifest):
        with open(os.path.join(out, manifest["shards"][0]["file"]), "r+b") as f:
            f.seek(4 * 100)
            f.write((0xFFFFFF9C).to_bytes(4, "little"))  # -100 as int32: the ignore index
    corpus_copy(ctx, "bad_ids", change)


def smaller_vocab(ctx):
    corpus_copy(ctx, "small_vocab", lambda out, manifest: manifest.update(vocab_size=100))


def imported_model(ctx):
    other_tokenizer(ctx)
    hf, imported = os.path.join(ctx["tmp"], "hf"), os.path.join(ctx["tmp"], "imported")
    for args in (["export", ctx["run"], hf, "--quiet"], ["import", hf, imported, "--quiet"]):
        subprocess.run([ctx["marrow"], *args], cwd=ctx["repo"], check=True, capture_output=True)
    ctx["imported"] = imported


def exported(ctx):
    """{tmp}/hf: an export of the run (model-00001-of-00001.safetensors and its index)."""
    subprocess.run([ctx["marrow"], "export", ctx["run"], os.path.join(ctx["tmp"], "hf"), "--quiet"], cwd=ctx["repo"], check=True,
                   capture_output=True)


def exported_with_stale_index(ctx):
    """{tmp}/hf with a stale model.safetensors.index.json beside its model.safetensors, as save_pretrained leaves
    one when a sharded save is followed by an unsharded one: transformers reads model.safetensors."""
    exported(ctx)
    hf = os.path.join(ctx["tmp"], "hf")
    os.rename(os.path.join(hf, "model-00001-of-00001.safetensors"), os.path.join(hf, "model.safetensors"))
    json.dump({"metadata": {}, "weight_map": {"lm_head.weight": "model-00001-of-00007.safetensors"}},
              open(os.path.join(hf, "model.safetensors.index.json"), "w"))


def export_and_corrupt(ctx):
    """{tmp}/hf: an export of the run; {tmp}/corrupt: a copy of its step-10 checkpoint with one weight byte flipped."""
    subprocess.run([ctx["marrow"], "export", ctx["run"], os.path.join(ctx["tmp"], "hf"), "--quiet"], cwd=ctx["repo"], check=True,
                   capture_output=True)
    corrupt = os.path.join(ctx["tmp"], "corrupt")
    shutil.copytree(os.path.join(ctx["run"], "step-00000010"), corrupt)
    weights = os.path.join(corrupt, sorted(f for f in os.listdir(corrupt) if f.startswith("weights-"))[0])
    with open(weights, "r+b") as f:
        f.seek(os.path.getsize(weights) - 1)
        byte = f.read(1)
        f.seek(os.path.getsize(weights) - 1)
        f.write(bytes([byte[0] ^ 1]))


def padded_vocab(ctx):
    """{tmp}/padded: one step of the tiny model with 4,000 embedding rows past its tokenizer's ids (as Qwen3 pads
    151,669 tokens to 151,936 rows), saved."""
    model = json.load(open(os.path.join(ctx["repo"], "configs", "tiny-moe.json")))
    model["vocab_size"] += 4000
    json.dump(model, open(os.path.join(ctx["tmp"], "padded.json"), "w"))
    subprocess.run([ctx["marrow"], *[a.format(**ctx) for a in train(out="{tmp}/padded", steps=1)], "--model.config={tmp}/padded.json".format(**ctx),
                    "--checkpoint.every=1", "--quiet"], cwd=ctx["repo"], check=True, capture_output=True)


def write(name, text):
    def setup(ctx):
        with open(os.path.join(ctx["tmp"], name), "w") as f:
            f.write(text.format(**ctx))
    return setup


def text_file(ctx):
    write("text.txt", "the quick brown fox jumps over the lazy dog\n" * 50)(ctx)


def small_corpus(ctx):
    """{small}: ~1,100 tokens of the demo tokenizer, ~16 training samples of 65 tokens."""
    write("small.txt", "the quick brown fox jumps over the lazy dog\n" * 60)(ctx)
    out = os.path.join(ctx["tmp"], "small")
    subprocess.run([ctx["marrow"], "tokenize", "--input", os.path.join(ctx["tmp"], "small.txt"), "--tokenizer",
                    os.path.join(ctx["corpus"], "tokenizer.json"), "--out", out], cwd=ctx["repo"], check=True, capture_output=True)
    ctx["small"] = out


def short_positions(ctx):
    model = json.load(open(os.path.join(ctx["repo"], "configs", "tiny-moe.json")))
    model["max_position_embeddings"] = 32
    json.dump(model, open(os.path.join(ctx["tmp"], "short.json"), "w"))


def huge_experts(ctx):
    model = json.load(open(os.path.join(ctx["repo"], "configs", "tiny-moe.json")))
    model["num_experts"] = 10 ** 9
    json.dump(model, open(os.path.join(ctx["tmp"], "huge.json"), "w"))


def full_after_metrics(ctx):
    """The disk fills up at the next metrics line: the limit lies just past metrics.jsonl's size, above
    what the resumed run writes into its new event file before it."""
    ctx["fsize"] = os.path.getsize(os.path.join(ctx["run"], "metrics.jsonl")) + 60


def holder(ctx):
    """Another run holds {run}: it resumes and then stops making progress at step 11 (MARROW_TEST_FAULT=hang)."""
    log = open(os.path.join(ctx["tmp"], "holder.log"), "w")
    args = [a.format(**ctx) for a in train()]
    p = subprocess.Popen([ctx["marrow"], *args], cwd=ctx["repo"], stdout=log, stderr=subprocess.STDOUT,
                         env=dict(os.environ, MARROW_TEST_FAULT="0:11:hang"), start_new_session=True)
    ctx["holder"], ctx["holder_pid"] = p, p.pid
    end = time.time() + 120
    while time.time() < end and "resuming from" not in open(log.name).read():
        time.sleep(0.05)
    time.sleep(0.5)  # past the resume: the holder now waits at step 11 and writes nothing


# --- after-checks ------------------------------------------------------------------------------------

def meta(ctx, step, run="{run}"):
    return json.load(open(os.path.join(run.format(**ctx), f"step-{step:08d}", "meta.json")))


def records_allowed_change(ctx):
    changes = meta(ctx, 11).get("config_changes", [])
    ok = len(changes) == 1 and changes[0]["at_step"] == 10 and changes[0]["allowed"] == ["data"] \
        and "train.seed is 1234 there but 7 now" in changes[0]["changes"][0]
    return ok, f"meta.json records the allowed change: {changes}"


def counts_samples_seen(ctx):
    """10 steps of 4 samples of 64 targets, then one of 8: 48 samples, 3,072 tokens (not 11 x 8)."""
    m = meta(ctx, 11)
    record = [json.loads(line) for line in open(os.path.join(ctx["run"], "metrics.jsonl"))][-1]
    ok = m["samples_seen"] == 48 and m["tokens_seen"] == 48 * 64 and record["step"] == 11 and record["tokens_seen"] == 48 * 64
    return ok, f"samples_seen {m['samples_seen']}, tokens_seen {m['tokens_seen']} in meta.json, {record.get('tokens_seen')} in metrics.jsonl"


def counts_applied_updates(ctx):
    optimizer = meta(ctx, 4, "{tmp}/nan")["optimizer"]
    return optimizer["step"] == 4 and optimizer["updates"] == 3, f"step 3 skipped: 3 AdamW updates in 4 steps {optimizer}"


def no_checkpoint_11(ctx):
    run = ctx["run"]
    return not os.path.exists(os.path.join(run, "step-00000011", "meta.json")), "no step-11 checkpoint that calls itself complete"


def stop_holder(ctx):
    os.killpg(ctx["holder"].pid, signal.SIGKILL)
    ctx["holder"].wait()
    return True, "the holder is ended"


FAULTS = [
    # 1. An export never lands in a checkpoint or run directory.
    Fault("export over the newest checkpoint", ["export", "{run}", "{run}/step-00000010", "--overwrite"], 1,
          "refusing to export into {run}/step-00000010: it is or lies inside the checkpoint or run directory"),
    Fault("export into the run directory", ["export", "{run}/step-00000005", "{run}", "--overwrite"], 1,
          "inside the checkpoint or run directory {run}"),
    Fault("export below a checkpoint", ["export", "{run}", "{run}/step-00000005/hf"], 1, "refusing to export into",
          absent=["{run}/step-00000005/hf"]),
    Fault("export onto a file", ["export", "{run}", "{tmp}/afile"], 1, "{tmp}/afile exists and is not a directory",
          setup=write("afile", "")),
    Fault("import into a path with a trailing slash", ["import", "{tmp}/hf", "{tmp}/slash/", "--quiet"], 0, "import:",
          absent=["{tmp}/slash/.tmp", "{tmp}/slash.tmp"], setup=exported, after=lambda ctx: (
              os.path.exists(os.path.join(ctx["tmp"], "slash", "meta.json")), "the checkpoint is {tmp}/slash itself")),
    Fault("import of a directory with model.safetensors and a stale index", ["import", "{tmp}/hf", "{tmp}/imported", "--quiet"], 0,
          "model.safetensors is read, as transformers does", setup=exported_with_stale_index),
    Fault("export --overwrite from a corrupt checkpoint keeps the old export", ["export", "{tmp}/corrupt", "{tmp}/hf", "--overwrite"], 1,
          "is corrupt", unchanged=["{run}", "{tmp}/hf"], setup=export_and_corrupt),
    # 2. What changes the data order or the meaning of the weights needs checkpoint.allow_changes.
    Fault("resume with another seed", train("--train.seed=7"), 1,
          "train.seed is 1234 there but 7 now, which changes the data order; pass --checkpoint.allow_changes=data"),
    Fault("resume with another validation_fraction", train("--data.validation_fraction=0.05"), 1,
          "data.validation_fraction is 0.01 there but 0.05 now"),
    Fault("resume with another global_batch", train("--train.global_batch=8"), 1, "train.global_batch is 4 there but 8 now"),
    Fault("resume with another seq_len", train("--train.seq_len=32"), 1, "train.seq_len is 64 there but 32 now"),
    Fault("resume on a corpus of another tokenizer", train("--data.path={other_tokenizer}"), 1,
          "was made with another tokenizer", setup=other_tokenizer),
    Fault("continued training from an import on a corpus of another tokenizer",
          ["train", *BASE, "--output.dir={tmp}/continued", "--train.steps=2", "--model.config={imported}/config.json",
           "--checkpoint.resume={imported}", "--data.path={other_tokenizer}"], 1,
          "--checkpoint.allow_changes=tokenizer", unchanged=["{run}", "{imported}"], absent=["{tmp}/continued/metrics.jsonl"],
          setup=imported_model),
    Fault("training into an imported checkpoint", ["train", *BASE, "--output.dir={imported}", "--train.steps=2",
                                                    "--model.config={imported}/config.json", "--checkpoint.resume={imported}"], 1,
          "output.dir {imported} is a checkpoint (it holds meta.json); train into another directory", unchanged=["{run}", "{imported}"],
          setup=imported_model),
    Fault("an allowed change is recorded", train("--train.seed=7", "--checkpoint.allow_changes=data"), 0, "resuming from",
          unchanged=["{run}/step-00000010"], after=records_allowed_change),
    Fault("an allowed batch change counts what each step read", train("--train.global_batch=8", "--checkpoint.allow_changes=data"), 0,
          "resuming from", unchanged=["{run}/step-00000010"], after=counts_samples_seen),
    # 3. An override without a value swallows nothing.
    Fault("override without a value", ["train", "configs/tiny-moe.toml", "--data.path={corpus}", "--output.dir", "--train.steps=10"], 1,
          "--output.dir needs a value (write --output.dir=VALUE)", absent=["--train.steps=10"]),
    Fault("empty string in the file", ["train", "{tmp}/empty.toml", "--data.path={corpus}"], 1,
          "{tmp}/empty.toml:4:7: output.dir has an empty value",
          setup=write("empty.toml", '[model]\nconfig = "configs/tiny-moe.json"\n[output]\ndir = ""\n')),
    # 4. A full disk stops the run with a sentence and loses nothing.
    Fault("full disk at the metrics line", train(), 1,
          "cannot write {run}/metrics.jsonl: File too large (is the disk full?); the file is as it was before this step",
          setup=full_after_metrics, fsize=-1),
    Fault("full disk during a checkpoint save", train(), 1, "(disk full?)", fsize=1 << 20,
          unchanged=["{run}/step-00000005", "{run}/step-00000010"], after=no_checkpoint_11),
    Fault("a checkpoint larger than the free space is refused before training", train(out="{tmp}/small-disk", steps=2), 1,
          "output.dir {tmp}/small-disk has 0.00 GiB free but one checkpoint of this run takes",
          env={"MARROW_TEST_DISK_FREE": "1000"}, absent=["{tmp}/small-disk/metrics.jsonl"]),
    Fault("without checkpoints the free space is not asked", train("--checkpoint.every=0", out="{tmp}/no-checkpoints", steps=1), 0,
          "step 1/1", env={"MARROW_TEST_DISK_FREE": "1000"}),
    # 4b. A run never repeats its corpus unasked: data.max_epochs allows more passes.
    Fault("a run needing more samples than the corpus holds", train("--data.path={small}", out="{tmp}/once", steps=10), 1,
          "but the run needs 40 (steps x global batch); tokenize more text, or lower the steps, the batch or seq_len, or allow "
          "more passes (data.max_epochs)", setup=small_corpus, absent=["{tmp}/once/metrics.jsonl"]),
    Fault("data.max_epochs allows more passes over the corpus", train("--data.path={small}", "--data.max_epochs=3",
                                                                       out="{tmp}/thrice", steps=10), 0,
          "passes over it (data.max_epochs = 3)", setup=small_corpus),
    # 5. One run per output directory.
    Fault("second run on one output.dir", train(), 1, "is in use by another run (process {holder_pid} on ", setup=holder,
          after=stop_holder),
    # 6. Token ids are checked against the manifest's vocabulary.
    Fault("token id past the vocabulary", train("--data.path={bad_ids}", out="{tmp}/fresh", steps=2), 1,
          "holds token id 4294967196 but the manifest's vocab_size is 4096", setup=id_past_vocab, absent=["{tmp}/fresh/metrics.jsonl"]),
    Fault("manifest edited to a smaller vocab_size", train("--data.path={small_vocab}", out="{tmp}/fresh", steps=2), 1,
          "but the manifest's vocab_size is 100", setup=smaller_vocab, absent=["{tmp}/fresh/metrics.jsonl"]),
    # 7. No exception escapes main; bad thread counts are refused before anything is written.
    Fault("output.dir is a file", train(out="{tmp}/file", steps=2), 1, "cannot create output.dir {tmp}/file: ",
          unchanged=["{run}", "{tmp}/file"], setup=write("file", "a file, not a directory\n")),
    Fault("output.dir below a file", train(out="{tmp}/file/run", steps=2), 1, "cannot create output.dir {tmp}/file/run: ",
          unchanged=["{tmp}/file"], setup=write("file", "a file\n")),
    Fault("bench output.dir is a file", ["bench", *BASE, "--output.dir={tmp}/file", "--steps=1", "--warmup=0"], 1,
          "cannot create output.dir {tmp}/file/bench: ", unchanged=["{tmp}/file"], setup=write("file", "a file\n")),
    Fault("tokenize --threads 100000",
          ["tokenize", "--input", "{tmp}/text.txt", "--tokenizer", "{corpus}/tokenizer.json", "--out", "{tmp}/tok", "--threads", "100000"],
          1, "--threads must be between 1 and 1024, got 100000", setup=text_file, absent=["{tmp}/tok", "{tmp}/tok.incomplete"]),
    Fault("train-tokenizer --threads 100000",
          ["train-tokenizer", "--input", "{tmp}/text.txt", "--vocab-size", "300", "--out", "{tmp}/t.json", "--threads", "100000"],
          1, "--threads must be between 1 and 1024", setup=text_file, absent=["{tmp}/t.json", "{tmp}/t.json.incomplete"]),
    # 8. A model that cannot fit is refused before anything is allocated.
    Fault("num_experts = 1e9", train("--model.config={tmp}/huge.json", out="{tmp}/huge", steps=1), 1,
          "the model cannot fit: 2.47e+13 parameters need 3.681e+05 GiB of fp32 training state", setup=huge_experts,
          absent=["{tmp}/huge/metrics.jsonl"]),
    # 9. Lengths beyond the model's positions.
    Fault("sample of a model with rows past its tokenizer", ["sample", "{tmp}/padded", "--prompt", "The", "--tokens", "40",
                                                             "--temperature", "50", "--samples", "3"], 0, "--- sample 3",
          setup=padded_vocab),
    Fault("sample --tokens 1e12", ["sample", "{run}", "--prompt", "The", "--tokens", "1000000000000"], 1,
          "exceed the model's max_position_embeddings (2048): ask for at most"),
    Fault("sample with a prompt past the positions", ["sample", "{run}", "--prompt", "word " * 2100, "--tokens", "1"], 1,
          "more than the model's max_position_embeddings (2048)"),
    Fault("seq_len past max_position_embeddings warns", train("--model.config={tmp}/short.json", out="{tmp}/short", steps=1), 0,
          "warning: train.seq_len = 64 exceeds max_position_embeddings = 32", setup=short_positions),
    # 10. The run config is TOML, with line:column in errors.
    Fault("duplicate key", ["train", "{tmp}/dup.toml", "--data.path={corpus}", "--output.dir={run}"], 1, "{tmp}/dup.toml:5:",
          setup=write("dup.toml", '[model]\nconfig = "configs/tiny-moe.json"\n[train]\nsteps = 12\nsteps = 13\n')),
    Fault("a byte-order mark, single quotes and 1_000 read as TOML", ["train", "{tmp}/ok.toml", *BASE[1:6], "--output.dir={tmp}/ok"], 0,
          "step 2/2",
          setup=write("ok.toml", "\ufeff[model]\nconfig = 'configs/tiny-moe.json'\n[train]\nsteps = 2\n[output]\nlog_every = 1_000\n")),
    Fault("relative paths resolve against the working directory", ["train", "{tmp}/rel.toml", "--data.path={corpus}"], 1,
          "model.config tiny-moe.json does not exist (relative paths in a run config resolve against the working directory",
          setup=write("rel.toml", '[model]\nconfig = "tiny-moe.json"\n')),
    # 11. One sentence that names the problem.
    Fault("train --help", ["train", "--help"], 0, "--checkpoint.allow_changes"),
    Fault("bench --help", ["bench", "--help"], 0, "--warmup=N"),
    Fault("bench --kernels without a GPU", ["bench", "--kernels"], 1, "bench --kernels needs a GPU"),
    Fault("bench --attention-plans without a GPU", ["bench", "--attention-plans"], 1, "bench --attention-plans needs a GPU"),
    Fault("bench on the CPU labels its speed", ["bench", *BASE, "--output.dir={tmp}/bench", "--steps=1", "--warmup=0"], 0,
          "GFLOP/s on the CPU (fp32; MFU needs a GPU)"),
    Fault("bench splits stages in a step after the measured ones", ["bench", *BASE, "--output.dir={tmp}/bench-split", "--steps=4",
          "--warmup=0"], 0, "(1 more step, timed by stage:"),
    Fault("optimizer.lr = inf", train("--optimizer.lr=inf"), 1, "--optimizer.lr: must be positive, got inf"),
    Fault("optimizer.beta1 = 1", train("--optimizer.beta1=1"), 1, "--optimizer.beta1: must be at least 0 and below 1"),
    Fault("train.seed = -1", train("--train.seed=-1"), 1, "--train.seed: must be an integer from 0 to 2^64 - 1, got -1"),
    Fault("1.79e308 is echoed as given", train("--data.validation_fraction=1.79e308"), 1, "must be between 0 and 0.5, got 1.79e308"),
    Fault("train-tokenizer --min-frequency -1",
          ["train-tokenizer", "--input", "{tmp}/text.txt", "--vocab-size", "300", "--out", "{tmp}/t.json", "--min-frequency=-1"], 1,
          "--min-frequency must be at least 1, got -1", setup=text_file, absent=["{tmp}/t.json"]),
    Fault("a directory as model.config", train("--model.config=configs"), 1, "model.config configs is a directory, not a file"),
    Fault("a directory as a JSON file", ["import", "{tmp}/hf", "{tmp}/imported"], 1, "{tmp}/hf/config.json is a directory",
          absent=["{tmp}/imported"], setup=lambda ctx: [os.makedirs(os.path.join(ctx["tmp"], "hf", "config.json")),
                                                      write("hf/model.safetensors", "")(ctx)]),
    Fault("checkpoint.resume next to the run's own checkpoint", train("--checkpoint.resume={run}/step-00000005"), 0,
          "note: checkpoint.resume = {run}/step-00000005 is not used", unchanged=["{run}/step-00000010"]),
    # 12. AdamW counts applied updates.
    Fault("a skipped step is no AdamW update", train(out="{tmp}/nan", steps=4), 0, "SKIPPED (non-finite)",
          env={"MARROW_TEST_FAULT": "0:3:nan"}, after=counts_applied_updates),
]


# --- the runner -------------------------------------------------------------------------------------

def snapshot(paths):
    """Every file under the paths, with its bytes' sha256; the run lock's file names its holder and is left out."""
    files = {}
    for root in paths:
        walk = [(os.path.dirname(root), [], [os.path.basename(root)])] if os.path.isfile(root) else os.walk(root)
        for d, _, names in walk:
            for n in names:
                if n != ".lock":
                    files[os.path.join(d, n)] = sha256(os.path.join(d, n))
    return files


def limit_file_size(size):
    def preexec():
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (size, resource.RLIM_INFINITY))
    return preexec


def run_fault(f, ctx):
    for key in ("holder", "holder_pid", "fsize"):
        ctx.pop(key, None)
    if f.setup:
        f.setup(ctx)
    fill = lambda s: s.format(**ctx)
    args = [fill(a) for a in f.args]
    before = snapshot([fill(p) for p in f.unchanged])
    fsize = ctx.get("fsize") if f.fsize == -1 else f.fsize
    try:
        p = subprocess.run([ctx["marrow"], *args], cwd=ctx["repo"], capture_output=True, text=True, errors="replace", timeout=120,
                           env=dict(os.environ, **f.env), preexec_fn=limit_file_size(fsize) if fsize else None)
    except subprocess.TimeoutExpired as e:  # a command with no bound fails its row, not the suite
        p = subprocess.CompletedProcess(e.cmd, None, "", f"still running after {e.timeout} s")
    fragment = fill(f.fragment)
    if f.code == 0:
        ok = p.returncode == 0 and fragment in p.stdout + p.stderr
        shown = (p.stdout + p.stderr)[-400:]
    else:
        lines = [l for l in p.stderr.splitlines() if l.strip() and not l.startswith(("warning:", "note:"))]
        ok = p.returncode == f.code and len(lines) == 1 and lines[0].startswith(f"marrow {args[0]}: error: ") and fragment in lines[0]
        shown = p.stderr.strip()[-600:]
    check(ok, f"{f.name}: exit {p.returncode}, {shown!r}")
    after = snapshot([fill(p) for p in f.unchanged])
    changed = sorted(k for k in before if after.get(k) != before[k])
    check(before and not changed, f"{f.name}: {len(before)} files unchanged byte for byte {changed}")
    present = [fill(a) for a in f.absent if os.path.exists(os.path.join(ctx["repo"], fill(a)))]
    check(not present, f"{f.name}: nothing written at {[fill(a) for a in f.absent]} {present}")
    if f.after:
        try:
            check(*f.after(ctx))
        except (OSError, KeyError, ValueError, IndexError) as e:
            check(False, f"{f.name}: the further check fails: {e!r}")


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--marrow", required=True)
    parser.add_argument("--build-dir", required=True)
    parser.add_argument("--only", default="", help="run the rows whose name contains this")
    args = parser.parse_args()
    repo = os.getcwd()
    corpus = os.path.join(os.environ.get("MARROW_DEMO_CORPUS", os.path.join(args.build_dir, "demo-corpus")), "corpus")
    with tempfile.TemporaryDirectory() as tmp:
        trained = os.path.join(tmp, "trained")
        ctx = {"marrow": os.path.abspath(args.marrow), "repo": repo, "corpus": corpus}
        p = subprocess.run([ctx["marrow"], *[a.format(run=trained, **ctx) for a in train(steps=10)]], cwd=repo,
                           capture_output=True, text=True)
        check(p.returncode == 0 and os.path.exists(os.path.join(trained, "step-00000010", "meta.json")),
              f"the run the rows start from trains 10 steps {p.stderr[-300:]}")
        for i, f in enumerate(x for x in FAULTS if args.only in x.name):
            row = os.path.join(tmp, f"row{i:02d}")
            os.makedirs(row)
            ctx.update(run=os.path.join(row, "run"), tmp=row)
            shutil.copytree(trained, ctx["run"], symlinks=True)
            try:
                run_fault(f, ctx)
            finally:
                if "holder" in ctx and ctx["holder"].poll() is None:
                    os.killpg(ctx["holder"].pid, signal.SIGKILL)
            shutil.rmtree(row)
    print("PASS" if not FAILURES else "FAIL")
    sys.exit(1 if FAILURES else 0)


if __name__ == "__main__":
    main()
