"""Checkpoints, resume, preemption, Hugging Face export/import and sampling, end to end on the demo corpus.

- Bit-exact resume: 2N straight steps == N steps, save, resume, N more (every loss, final weights and
  AdamW moments bitwise); a SIGTERM mid-run saves, exits 0 and the same command finishes the run,
  again bitwise equal to the straight run.
- optimizer.moments = bf16: resume bit-exact; the moments saved as bf16; fp32 and bf16 checkpoints each
  resumed by a run with the other kind of moments.
- optimizer.kind = muon: resume bit-exact; a checkpoint holding AdamW's state is refused in one sentence.
- Crash safety: a run SIGKILLed while saving resumes from the previous complete checkpoint; a truncated
  or corrupted shard, a missing file and a checkpoint of another model each stop with one sentence
  naming the file. Only the newest checkpoint.keep checkpoints are kept.
- Export: transformers' AutoModelForCausalLM loads the trained tiny model (sharded fp32, and bf16) and its
  logits match Marrow's forward (max relative error <= 1e-4 in fp32); AutoTokenizer loads its tokenizer
  and encodes as the tokenizer.json does. import of the export and a second export give byte-identical
  tensors; import also reads what transformers' save_pretrained writes.
- Continued pretraining from an import, and marrow sample printing text.
"""
import argparse
import glob
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import types

import torch
from safetensors.torch import load_file

FAILURES = []


def check(condition, what):
    print(("ok      " if condition else "FAILED  ") + what, flush=True)
    if not condition:
        FAILURES.append(what)


def losses(out_dir):
    with open(os.path.join(out_dir, "metrics.jsonl")) as f:
        return [json.loads(line)["loss"] for line in f]


def checkpoint_files(step_dir):
    return sorted(os.path.basename(p) for p in glob.glob(os.path.join(step_dir, "*.safetensors")))


def same_files(dir_a, dir_b, names):
    return all(open(os.path.join(dir_a, n), "rb").read() == open(os.path.join(dir_b, n), "rb").read() for n in names)


def hf_tensors(hf_dir):
    index = json.load(open(os.path.join(hf_dir, "model.safetensors.index.json")))
    out = {}
    for f in sorted(set(index["weight_map"].values())):
        out.update(load_file(os.path.join(hf_dir, f)))
    return out


def same_tensors(a, b):
    return a.keys() == b.keys() and all(a[k].dtype == b[k].dtype and a[k].shape == b[k].shape and
                                        torch.equal(a[k].view(torch.uint8) if a[k].dtype != torch.uint8 else a[k],
                                                    b[k].view(torch.uint8) if b[k].dtype != torch.uint8 else b[k])
                                        for k in a)


class Marrow:
    def __init__(self, binary, repo, base):
        self.binary, self.repo, self.base = binary, repo, base

    def run(self, *args, env=None):
        p = subprocess.run([self.binary] + list(args), cwd=self.repo, capture_output=True, text=True, errors="replace",
                           env=env)
        return p.returncode, p.stdout, p.stderr

    def train(self, out, *extra, env=None):
        return self.run("train", *self.base, f"--output.dir={out}", *extra, env=env)

    def start_train(self, out, *extra, env=None):
        return subprocess.Popen([self.binary, "train"] + self.base + [f"--output.dir={out}"] + list(extra), cwd=self.repo,
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)


def wait_for(condition, timeout=120):
    end = time.time() + timeout
    while time.time() < end:
        if condition():
            return True
        time.sleep(0.02)
    return False


def one_error_line(code, stderr, *expected):
    lines = [l for l in stderr.strip().splitlines() if l and not l.startswith("note:")]
    return code == 1 and len(lines) == 1 and "error:" in lines[0] and all(e in lines[0] for e in expected)


def resume(c):
    """Bit-exact resume."""
    m, path, N = c.m, c.path, c.N
    code, out, err = m.train(path("straight"), f"--checkpoint.every={N}")
    check(code == 0, f"straight run of {2 * N} steps exits 0 {err[-300:]}")
    straight = losses(path("straight"))
    last = path("straight", f"step-{2 * N:08d}")
    check(sorted(os.listdir(path("straight"))) == [".lock", "metrics.jsonl", f"step-{N:08d}", f"step-{2 * N:08d}", "tb"],
          "checkpoints at every N steps and the end, the logs (metrics.jsonl, tb/), the run lock, nothing else left in output.dir")
    files = checkpoint_files(last)
    check(any(f.startswith("weights-") for f in files) and any(f.startswith("exp_avg-") for f in files)
          and any(f.startswith("exp_avg_sq-") for f in files), f"checkpoint holds weights and AdamW moments: {files}")
    meta = json.load(open(os.path.join(last, "meta.json")))
    check(meta["step"] == 2 * N and meta["tokens_seen"] == 2 * N * 8 * 64 and meta["seed"] == 1234 and "mesh" in meta
          and meta["model_config"]["hidden_size"] == 64 and meta["marrow_version"] and meta["data"]["eos_token"],
          "meta.json records step, tokens seen, seed, mesh, model config, version, eos token")

    code, out, err = m.train(path("resumed"), f"--checkpoint.every={N}", "--resume", path("straight", f"step-{N:08d}"))
    check(code == 0 and f"resuming from {path('straight', f'step-{N:08d}')} at step {N}" in out,
          f"a run resumes from --resume <dir> {err[-300:]}")
    resumed = losses(path("resumed"))
    check(resumed == straight[N:], f"resumed losses equal the straight run's bitwise ({len(resumed)} steps)")
    check(same_files(last, path("resumed", f"step-{2 * N:08d}"), files),
          "final weights and AdamW moments are bitwise identical after resume")

    code, out, err = m.train(path("straight"))
    check(code == 0 and "the run is complete" in out and losses(path("straight")) == straight,
          "rerunning a finished run says it is complete and changes nothing")
    c.straight, c.last, c.files, c.meta = straight, last, files, meta


def bf16_moments(c):
    """optimizer.moments = bf16: resume bit-exact, moments saved as bf16, checkpoints read across the two kinds of moments."""
    m, path, N = c.m, c.path, c.N
    bf16 = "--optimizer.moments=bf16"
    code, out, err = m.train(path("bf16-straight"), f"--checkpoint.every={N}", bf16)
    check(code == 0 and "adam exp_avg (bf16)" in out, f"a run with bf16 moments trains, its moments' arenas bf16 {err[-300:]}")
    straight = losses(path("bf16-straight"))
    check(straight[0] == c.straight[0] and straight != c.straight and abs(straight[-1] - c.straight[-1]) < 0.02 * c.straight[-1],
          f"bf16 moments: the first loss is fp32's, later ones differ by little ({straight[-1]:.4f} against {c.straight[-1]:.4f})")
    last = path("bf16-straight", f"step-{2 * N:08d}")
    moments = [t for f in checkpoint_files(last) if f.startswith("exp_avg") for t in load_file(os.path.join(last, f)).values()]
    weights = [t for f in checkpoint_files(last) if f.startswith("weights") for t in load_file(os.path.join(last, f)).values()]
    check(moments and all(t.dtype == torch.bfloat16 for t in moments) and all(t.dtype == torch.float32 for t in weights),
          f"bf16 moments are saved as bf16, the weights as f32 ({len(moments)} moment tensors)")
    code, out, err = m.train(path("fp32-from-bf16"), "--resume", path("bf16-straight", f"step-{N:08d}"))
    resumed = losses(path("fp32-from-bf16")) if code == 0 else []
    check(code == 0 and resumed[:1] == straight[N:N + 1], f"an fp32-moments run resumes a bf16-moments checkpoint {err[-300:]}")
    code, out, err = m.train(path("bf16-resumed"), f"--checkpoint.every={N}", bf16, "--resume",
                             path("bf16-straight", f"step-{N:08d}"))
    check(code == 0 and losses(path("bf16-resumed")) == straight[N:] and
          same_files(last, path("bf16-resumed", f"step-{2 * N:08d}"), checkpoint_files(last)),
          f"bf16 moments: resumed losses, weights and moments bitwise equal to the straight run's {err[-300:]}")
    code, out, err = m.train(path("bf16-from-fp32"), bf16, "--resume", path("straight", f"step-{N:08d}"))
    resumed = losses(path("bf16-from-fp32")) if code == 0 else []
    check(code == 0 and resumed[:1] == c.straight[N:N + 1] and resumed[1:] != c.straight[N + 1:],
          f"a bf16-moments run resumes an fp32 checkpoint (its first loss is the checkpoint's) {err[-300:]}")


def muon(c):
    """optimizer.kind = muon: resume bit-exact (its momentum in the exp_avg files); an AdamW checkpoint's state is refused."""
    m, path, N = c.m, c.path, c.N
    kind = "--optimizer.kind=muon"
    code, out, err = m.train(path("muon-straight"), f"--checkpoint.every={N}", kind)
    straight = losses(path("muon-straight")) if code == 0 else []
    check(code == 0 and straight[0] == c.straight[0] and straight[-1] != c.straight[-1] and straight[-1] < straight[0],
          f"a Muon run trains: its first loss is AdamW's, then its own, falling ({straight[-1:]} against {c.straight[-1]}) {err[-300:]}")
    last = path("muon-straight", f"step-{2 * N:08d}")
    code, out, err = m.train(path("muon-resumed"), f"--checkpoint.every={N}", kind, "--resume", path("muon-straight", f"step-{N:08d}"))
    check(code == 0 and losses(path("muon-resumed")) == straight[N:] and
          same_files(last, path("muon-resumed", f"step-{2 * N:08d}"), checkpoint_files(last)),
          f"Muon: resumed losses, weights and momentum bitwise equal to the straight run's {err[-300:]}")
    code, out, err = m.train(path("muon-from-adamw"), kind, "--resume", path("straight", f"step-{N:08d}"))
    check(code == 1 and "its optimizer state is adamw's but optimizer.kind is \"muon\"" in err,
          f"Muon does not resume AdamW's moments: one sentence ({err.strip()[-300:]!r})")


def preemption(c):
    """Preemption: SIGTERM saves and exits 0; the same command finishes the run."""
    m, path, N, straight, last, files = c.m, c.path, c.N, c.straight, c.last, c.files
    p = m.start_train(path("preempted"), "--checkpoint.every=1000")
    metrics = path("preempted", "metrics.jsonl")
    wait_for(lambda: os.path.exists(metrics) and len(open(metrics).read().splitlines()) >= 3)
    p.send_signal(signal.SIGTERM)
    out, err = p.communicate(timeout=120)
    stopped = len(losses(path("preempted")))
    where = path("preempted", f"step-{stopped:08d}")
    check(p.returncode == 0 and f"stopped by SIGTERM after step {stopped}: checkpoint in {where}" in out
          and os.path.exists(os.path.join(where, "meta.json")),
          f"SIGTERM: finishes step {stopped}, saves, exits 0 saying where ({p.returncode}, {out.strip().splitlines()[-1:]})")
    code, out, err = m.train(path("preempted"), "--checkpoint.every=1000")
    check(code == 0 and f"resuming from {where}" in out, "the same command resumes automatically from output.dir")
    check(losses(path("preempted")) == straight, "preempted and resumed run: every loss equals the straight run's")
    check(same_files(last, path("preempted", f"step-{2 * N:08d}"), files), "preempted run: final state bitwise equal")


def kill_during_save(c):
    """SIGKILL during a save."""
    m, path, straight = c.m, c.path, c.straight
    env = dict(os.environ, MARROW_TEST_SAVE_PAUSE_MS="4000")
    p = m.start_train(path("killed"), "--checkpoint.every=5", env=env)
    partial = path("killed", f"step-{2 * 5:08d}.tmp")
    got = wait_for(lambda: os.path.exists(path("killed", f"step-{5:08d}", "meta.json")) and os.path.isdir(partial)
                   and len(os.listdir(partial)) >= 1)
    p.kill()
    p.communicate()
    check(got and not os.path.exists(path("killed", f"step-{10:08d}")), "SIGKILL lands during the step-10 save")
    code, out, err = m.train(path("killed"), "--checkpoint.every=5")
    check(code == 0 and f"resuming from {path('killed', f'step-{5:08d}')} at step 5" in out,
          "after SIGKILL the run resumes from the previous complete checkpoint")
    check(not os.path.exists(partial), "the half-written checkpoint was swept")
    check(losses(path("killed")) == straight, "killed and resumed run: every loss equals the straight run's")
    check(sorted(d for d in os.listdir(path("killed")) if d.startswith("step-")) == [f"step-{15:08d}", f"step-{20:08d}"],
          "checkpoint.keep = 2 keeps the newest two")


def damaged_checkpoints(c):
    """Damaged checkpoints and another model: one sentence naming the file."""
    m, path, N, last, files = c.m, c.path, c.N, c.last, c.files
    def damaged(name, damage, *expected):
        run_dir = path(name)
        shutil.copytree(last, os.path.join(run_dir, f"step-{2 * N:08d}"))
        target = damage(os.path.join(run_dir, f"step-{2 * N:08d}"))
        code, out, err = m.train(run_dir)
        check(one_error_line(code, err, target, *expected), f"{name}: {err.strip().splitlines()[-1:] }")

    def truncate(d):
        f = os.path.join(d, files[0])
        os.truncate(f, os.path.getsize(f) - 10)
        return f

    def corrupt(d):
        f = os.path.join(d, [x for x in files if x.startswith("exp_avg_sq")][-1])
        data = bytearray(open(f, "rb").read())
        data[-3] ^= 0x10
        open(f, "wb").write(bytes(data))
        return f

    def remove(d):
        f = os.path.join(d, files[-1])
        os.remove(f)
        return f

    damaged("truncated", truncate, "is truncated")
    damaged("corrupt", corrupt, "is corrupt")
    damaged("missing", remove, "is missing")
    model = json.load(open("configs/tiny-moe.json"))
    model["hidden_size"] = 32
    json.dump(model, open(path("wider.json"), "w"))
    code, out, err = m.train(path("other-model"), f"--model.config={path('wider.json')}", f"--checkpoint.resume={last}")
    check(one_error_line(code, err, os.path.join(last, "meta.json"), "another model", "hidden_size is 64 there but 32 here"),
          f"another model: {err.strip().splitlines()[-1:]}")
    code, out, err = m.run("export", path("corrupt"), path("never"))
    check(one_error_line(code, err, "is corrupt"), "export of a corrupt checkpoint names the file")


def export(c):
    """Export loads in transformers; logits match Marrow's forward."""
    m, path, last, meta, model_forward = c.m, c.path, c.last, c.meta, c.model_forward
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from tokenizers import Tokenizer

    hf = path("hf")
    code, out, err = m.run("export", last, hf, "--shard-mib=2")
    names = sorted(os.listdir(hf)) if os.path.isdir(hf) else []
    shards = [n for n in names if n.startswith("model-") and n.endswith(".safetensors")]
    check(code == 0 and {"config.json", "generation_config.json", "model.safetensors.index.json", "tokenizer.json",
                         "tokenizer_config.json"} <= set(names) and len(shards) >= 2
          and all(s.endswith(f"-of-{len(shards):05d}.safetensors") for s in shards),
          f"export writes a sharded Hugging Face directory: {names} {err[-300:]}")
    tok = AutoTokenizer.from_pretrained(hf)
    text = "Python is an easy to learn, powerful programming language. It has efficient high-level data structures"
    ids = tok(text)["input_ids"]
    check(ids == Tokenizer.from_file(os.path.join(hf, "tokenizer.json")).encode(text).ids and tok.decode(ids) == text,
          f"AutoTokenizer loads the exported tokenizer and encodes like tokenizer.json ({len(ids)} tokens)")
    check(tok.eos_token == meta["data"]["eos_token"], f"tokenizer_config names the eos token {tok.eos_token!r}")

    batch = [ids[:24], ids[-24:]]
    with open(path("tokens.txt"), "w") as f:
        f.write(f"2 24 {' '.join(str(t) for row in batch for t in row)}\n")
    tokens = torch.tensor(batch)

    def marrow_forward(source, out_dir):
        subprocess.run([model_forward, source, path("tokens.txt"), out_dir], check=True)
        return load_file(os.path.join(out_dir, "marrow_outputs.safetensors"))["logits"], \
            json.load(open(os.path.join(out_dir, "marrow_loss.json")))["loss"]

    marrow_logits, marrow_loss = marrow_forward(last, path("fwd-ckpt"))
    hf_model = AutoModelForCausalLM.from_pretrained(hf, dtype=torch.float32).eval()
    with torch.no_grad():
        result = hf_model(input_ids=tokens, labels=tokens)
    err_rel = ((marrow_logits - result.logits).abs().max() / result.logits.abs().max()).item()
    loss_rel = abs(marrow_loss - result.loss.item()) / result.loss.item()
    print(f"trained tiny model: logits max rel err {err_rel:.2e}; loss marrow {marrow_loss:.6f} hf {result.loss.item():.6f}")
    check(err_rel <= 1e-4 and loss_rel <= 1e-4, "exported fp32 model: transformers' logits and loss match Marrow's (<= 1e-4)")
    hf_logits, _ = marrow_forward(hf, path("fwd-hf"))
    check(torch.equal(hf_logits, marrow_logits), "Marrow reading the export gives the checkpoint's logits bitwise")

    # bf16 export loads too and stays close.
    code, out, err = m.run("export", last, path("hf-bf16"), "--dtype=bfloat16")
    bf16 = AutoModelForCausalLM.from_pretrained(path("hf-bf16"), dtype=torch.float32).eval()
    with torch.no_grad():
        bf16_loss = bf16(input_ids=tokens, labels=tokens).loss.item()
    check(code == 0 and json.load(open(path("hf-bf16", "config.json")))["torch_dtype"] == "bfloat16"
          and abs(bf16_loss - result.loss.item()) / result.loss.item() < 0.02,
          f"bf16 export loads; loss {bf16_loss:.4f} within 2% of fp32's")
    c.hf, c.hf_model = hf, hf_model


def import_export(c):
    """import: the export's tensors come back byte for byte."""
    m, path, hf, hf_model = c.m, c.path, c.hf, c.hf_model
    for name, source, dtype in [("f32", hf, "float32"), ("bf16", path("hf-bf16"), "bfloat16")]:
        code1, out1, err1 = m.run("import", source, path(f"imported-{name}"))
        code2, out2, err2 = m.run("export", path(f"imported-{name}"), path(f"reexported-{name}"), f"--dtype={dtype}")
        check(code1 == 0 and code2 == 0 and same_tensors(hf_tensors(source), hf_tensors(path(f"reexported-{name}"))),
              f"{name}: import then export gives byte-identical tensors {err1[-200:]} {err2[-200:]}")
    imported = json.load(open(path("imported-f32", "meta.json")))
    check(imported["step"] == 0 and not any(f["group"].startswith("exp_avg") for f in imported["files"]),
          "an import holds weights only (step 0, no optimizer state)")

    # What transformers itself writes (single file or sharded, fused experts or not) imports too.
    hf_model.save_pretrained(path("hf-saved"), max_shard_size="1MB")
    shutil.copy(os.path.join(hf, "tokenizer.json"), path("hf-saved"))
    code1, _, err1 = m.run("import", path("hf-saved"), path("imported-saved"))
    code2, _, err2 = m.run("export", path("imported-saved"), path("reexported-saved"))
    check(code1 == 0 and code2 == 0 and same_tensors(hf_tensors(hf), hf_tensors(path("reexported-saved"))),
          f"import reads transformers' save_pretrained output {err1[-300:]} {err2[-300:]}")
    code, out, err = m.run("import", path("hf-saved"), path("imported-saved"))
    check(one_error_line(code, err, "already exists"), "import refuses to overwrite without --overwrite")


def continued_pretraining(c):
    """Continued pretraining from an import."""
    m, path, straight = c.m, c.path, c.straight
    code, out, err = m.train(path("continued"), "--train.steps=4", f"--model.config={path('imported-f32', 'config.json')}",
                             f"--checkpoint.resume={path('imported-f32')}")
    cont = losses(path("continued")) if code == 0 else []
    check(code == 0 and "at step 0 (no optimizer state in it: AdamW moments start at zero)" in out and len(cont) == 4
          and cont[0] < straight[0] - 1.0,
          f"continued pretraining from an import starts from the trained weights (loss {cont[:1]} vs {straight[0]:.3f})")


def sample(c):
    """sample."""
    m, path, last, hf = c.m, c.path, c.last, c.hf
    prompt = "The Python interpreter"
    code, out, err = m.run("sample", last, "--prompt", prompt, "--tokens=24", "--temperature=0")
    code2, out2, _ = m.run("sample", hf, "--prompt", prompt, "--tokens=24", "--temperature=0")
    print("greedy sample:", out.strip())
    check(code == 0 and out.startswith(prompt) and len(out.strip()) > len(prompt) + 10 and out == out2,
          f"sample continues the prompt, from the checkpoint and the export alike {err[-300:]}")
    code, out, err = m.run("sample", path("straight"), "--prompt", prompt, "--tokens=16", "--temperature=0.8", "--seed=3",
                           "--samples=2")
    code2, out2, _ = m.run("sample", path("straight"), "--prompt", prompt, "--tokens=16", "--temperature=0.8", "--seed=3",
                           "--samples=2")
    print(out.strip())
    check(code == 0 and out.count("--- sample") == 2 and out == out2, "temperature sampling is reproducible with --seed")
    code, out, err = m.run("sample", path("hf-saved"), "--prompt", prompt)
    check(code == 0, f"sample reads a directory transformers wrote {err[-300:]}")
    code, out, err = m.run("sample", path("nowhere"), "--prompt", prompt)
    check(one_error_line(code, err, path("nowhere"), "does not exist"), "sample of a missing directory names it")
    code, out, err = m.run("sample", last, "--prompt", prompt, "--temperature=nan")
    check(code == 2 and "--temperature: must be a finite number, 0 or more, got nan" in err, f"sample refuses a NaN temperature {err}")


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--marrow", required=True)
    parser.add_argument("--build-dir", required=True)
    args = parser.parse_args()
    repo = os.getcwd()
    corpus = os.path.join(os.environ.get("MARROW_DEMO_CORPUS", os.path.join(args.build_dir, "demo-corpus")), "corpus")
    model_forward = os.path.join(args.build_dir, "tests", "model_forward")
    N = 10
    base = ["configs/tiny-moe.toml", f"--data.path={corpus}", f"--train.steps={2 * N}", "--train.global_batch=8",
            "--train.micro_batch=4", "--schedule.warmup_steps=4", "--output.log_every=5"]
    m = Marrow(args.marrow, repo, base)

    with tempfile.TemporaryDirectory() as tmp:
        c = types.SimpleNamespace(m=m, N=N, model_forward=model_forward, path=lambda *p: os.path.join(tmp, *p))
        for section in (resume, bf16_moments, muon, preemption, kill_during_save, damaged_checkpoints, export, import_export, continued_pretraining, sample):
            section(c)

    print("PASS" if not FAILURES else "FAIL")
    sys.exit(1 if FAILURES else 0)


if __name__ == "__main__":
    main()
