"""Watching a run, end to end on the demo corpus: TensorBoard event files, marrow plot, progress lines.

- TensorBoard's own reader (tensorboard.backend.event_processing.event_accumulator) finds in
  <output.dir>/tb/ every number of metrics.jsonl under its tag at its step, each step once, and the
  run config as text: across a run that dies after its checkpoint (the steps after it are trained
  again on resume and must not show twice) and an extension of the finished run to more steps.
  A fresh run in the same output.dir starts the files anew, as it does metrics.jsonl.
- The demo's command writes tb/, and marrow plot of two runs writes an SVG that parses as XML and has
  both curves of each run, axis labels and a legend; a directory that is no run gets one sentence.
- export, import and the start-up check of the corpus print progress lines when slow
  (MARROW_TEST_PROGRESS_DELAY_S=0 makes any work slow enough); --quiet silences them, and quick work
  prints none.
"""
import argparse
import glob
import json
import os
import subprocess
import sys
import tempfile
import xml.etree.ElementTree as ET

import numpy as np
from tensorboard.backend.event_processing import event_accumulator
from tensorboard.util import tensor_util

FAILURES = []

# metrics.jsonl key -> (TensorBoard tag, scale), as engine/tensorboard.h lists them.
TAGS = {"loss": ("train/loss", 1), "val_loss": ("val/loss", 1), "lr": ("train/lr", 1), "grad_norm": ("train/grad_norm", 1),
        "load_balance": ("train/load_balance", 1), "tokens_seen": ("train/tokens_seen", 1),
        "tokens_per_s": ("perf/tokens_per_s", 1), "step_ms": ("perf/step_ms", 1),
        "peak_bytes": ("perf/peak_memory_gib", 1 / 2**30)}
SVG = "{http://www.w3.org/2000/svg}"


def check(condition, what):
    print(("ok      " if condition else "FAILED  ") + what, flush=True)
    if not condition:
        FAILURES.append(what)


def metrics(out_dir):
    with open(os.path.join(out_dir, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f]


def read_tensorboard(out_dir):
    acc = event_accumulator.EventAccumulator(os.path.join(out_dir, "tb"),
                                             size_guidance={event_accumulator.SCALARS: 0, event_accumulator.TENSORS: 0})
    acc.Reload()
    return acc


def compare_with_metrics(out_dir, what):
    """Every tag's (step, value) list equals metrics.jsonl's, in float32 (TensorBoard's simple_value)."""
    acc = read_tensorboard(out_dir)
    lines = metrics(out_dir)
    tags = acc.Tags()["scalars"]
    check(sorted(tags) == sorted(tag for tag, _ in TAGS.values()), f"{what}: the tags are {sorted(tags)}")
    for key, (tag, scale) in TAGS.items():
        want = [(m["step"], float(np.float32(m[key] * scale))) for m in lines if key in m]
        got = [(e.step, e.value) for e in acc.Scalars(tag)] if tag in tags else []
        check(got == want, f"{what}: {tag} has the {len(want)} (step, value) pairs of metrics.jsonl's {key}"
              + ("" if got == want else f"\n  got  {got[:12]}\n  want {want[:12]}"))
    return acc


def run_config_texts(acc):
    return [(e.step, tensor_util.make_ndarray(e.tensor_proto).item().decode()) for e in acc.Tensors("run_config")]


def progress_lines(stderr, marker):
    return [line for line in stderr.replace("\r", "\n").splitlines() if marker in line]


def crash_resume_extend(marrow, base, corpus, tmp):
    """A run dies after its checkpoint at 4 (steps 5 and 6 logged), resumes, then goes on to 10."""
    run = os.path.join(tmp, "resumed")
    code, out, err = marrow("train", *base, f"--output.dir={run}", "--train.steps=8", "--checkpoint.every=4",
                            env_extra={"MARROW_TEST_FAULT": "0:7:exit"})
    steps = [m["step"] for m in metrics(run)] if os.path.exists(os.path.join(run, "metrics.jsonl")) else []
    check(code == 3 and steps == list(range(1, 7)), f"the first run dies at step 7 after logging steps 1..6 ({code}, {steps})")
    acc = read_tensorboard(run)
    check([e.step for e in acc.Scalars("train/loss")] == list(range(1, 7)), "its event file holds steps 1..6 as it dies")
    code, out, err = marrow("train", *base, f"--output.dir={run}", "--train.steps=8", "--checkpoint.every=4")
    check(code == 0 and "at step 4" in out, f"the same command resumes from step 4 {err[-300:]}")
    code, out, err = marrow("train", *base, f"--output.dir={run}", "--train.steps=10", "--checkpoint.every=4")
    check(code == 0 and "at step 8" in out, f"--train.steps=10 goes on from step 8 {err[-300:]}")
    check([m["step"] for m in metrics(run)] == list(range(1, 11)), "metrics.jsonl holds steps 1..10 once each")
    files = sorted(glob.glob(os.path.join(run, "tb", "events.out.tfevents.*")))
    check(len(files) == 3, f"one event file per start of the run: {[os.path.basename(f) for f in files]}")
    acc = compare_with_metrics(run, "after a crash, a resume and an extension")
    texts = run_config_texts(acc)
    check([step for step, _ in texts] == [0, 4, 8] and texts[0][1].startswith("    configs/tiny-moe.toml --data.path=")
          and "--train.steps=10" in texts[-1][1] and "[optimizer]" in texts[-1][1],
          f"the run config is text at each start's step (0, 4, 8), with its command line and file: {[s for s, _ in texts]}")


def fresh_run_over_an_old_one(marrow, base, corpus, tmp):
    """A fresh run in the same directory starts the event files anew and keeps the earlier run's records aside."""
    fresh = os.path.join(tmp, "fresh")
    for steps in (3, 2):
        code, out, err = marrow("train", *base, f"--output.dir={fresh}", f"--train.steps={steps}", "--checkpoint.every=0")
    check(code == 0 and len(glob.glob(os.path.join(fresh, "tb", "events.out.tfevents.*"))) == 1,
          "a fresh run in a used output.dir (no checkpoint) leaves one event file")
    compare_with_metrics(fresh, "a fresh run over an earlier one")
    earlier = os.path.join(fresh, "earlier-runs", "1")
    check(f"they are kept in {earlier}" in out and len(metrics(earlier)) == 3 and len(metrics(fresh)) == 2
          and len(glob.glob(os.path.join(earlier, "tb", "events.out.tfevents.*"))) == 1,
          f"the earlier run's metrics.jsonl (3 steps) and event file kept in earlier-runs/1, with a note: {out[-300:]}")


def start_elsewhere_keeps_records(marrow, base, corpus, tmp):
    """A run started from another directory's checkpoint (checkpoint.resume) in an output.dir holding an earlier run's
    records (no checkpoint) moves them aside as a fresh run does: its own records start at its first step, not after
    the earlier run's first steps. Event files alone (metrics.jsonl gone) are kept too."""
    source, used = os.path.join(tmp, "elsewhere-source"), os.path.join(tmp, "elsewhere-used")
    code, _, _ = marrow("train", *base, f"--output.dir={source}", "--train.steps=2", "--checkpoint.every=2")
    code2, _, _ = marrow("train", *base, f"--output.dir={used}", "--train.steps=3", "--checkpoint.every=0")
    code3, out, err = marrow("train", *base, f"--output.dir={used}", "--train.steps=4", "--checkpoint.every=0",
                             f"--checkpoint.resume={source}/step-00000002")
    earlier = os.path.join(used, "earlier-runs", "1")
    steps = [m["step"] for m in metrics(used)]
    check(code == code2 == code3 == 0 and steps == [3, 4] and [m["step"] for m in metrics(earlier)] == [1, 2, 3]
          and f"kept in {earlier}" in out, f"a start from another checkpoint keeps the earlier records aside: {steps} {err[-300:]}")
    compare_with_metrics(used, "a start from another directory's checkpoint")
    os.remove(os.path.join(used, "metrics.jsonl"))
    code, out, err = marrow("train", *base, f"--output.dir={used}", "--train.steps=2", "--checkpoint.every=0")
    kept = glob.glob(os.path.join(used, "earlier-runs", "2", "tb", "events.out.tfevents.*"))
    check(code == 0 and len(kept) == 1 and not os.path.exists(os.path.join(used, "earlier-runs", "2", "metrics.jsonl")),
          f"event files without a metrics.jsonl are kept in earlier-runs/2: {kept} {err[-300:]}")


def demo_and_plot(marrow, base, corpus, tmp):
    """The demo's command, and marrow plot."""
    run = os.path.join(tmp, "resumed")
    demo = os.path.join(tmp, "tiny-moe")
    code, out, err = marrow("train", "configs/tiny-moe.toml", f"--data.path={corpus}", "--train.steps=20",
                            f"--output.dir={demo}")
    check(code == 0 and os.path.isdir(os.path.join(demo, "tb")), f"the demo's command writes tb/ {err[-300:]}")
    compare_with_metrics(demo, "the demo's run")
    svg_path = os.path.join(tmp, "plot.svg")
    code, out, err = marrow("plot", demo, run, "--out", svg_path)
    check(code == 0 and f"-> {svg_path}" in out, f"marrow plot of two runs exits 0 {out} {err}")
    root = ET.parse(svg_path).getroot() if os.path.exists(svg_path) else ET.Element("none")
    check(root.tag == SVG + "svg", "the picture parses as XML with an svg root")
    lines = {(p.get("class"), p.get("data-run")): p.get("points", "").split() for p in root.iter(SVG + "polyline")}
    for name, out_dir in (("tiny-moe", demo), ("resumed", run)):
        m = metrics(out_dir)
        check(len(lines.get(("train", name), [])) == len(m), f"{name}: a training curve with a point per step")
        check(len(lines.get(("validation", name), [])) == sum("val_loss" in x for x in m),
              f"{name}: a validation curve with a point per evaluation")
    labels = sorted(t.text for t in root.iter(SVG + "text") if t.get("class") == "axis-label")
    check(labels == ["loss", "tokens seen"], f"axis labels: {labels}")
    legend = [g for g in root.iter(SVG + "g") if g.get("class") == "legend"]
    legend_text = [t.text for t in legend[0].iter(SVG + "text")] if legend else []
    check(legend_text == ["tiny-moe training", "tiny-moe validation", "resumed training", "resumed validation"],
          f"the legend names each run's curves: {legend_text}")
    ticks = [t for t in root.iter(SVG + "text") if t.get("class") == "tick"]
    check(len(ticks) >= 6, f"the axes have ticks ({len(ticks)})")
    code, out, err = marrow("plot", tmp, "--out", os.path.join(tmp, "x.svg"))
    check(code == 1 and err.strip().count("\n") == 0 and "has no metrics.jsonl" in err, f"a directory that is no run: {err.strip()}")
    metrics_path = os.path.join(run, "metrics.jsonl")
    before = open(metrics_path, "rb").read()
    code, out, err = marrow("plot", run, "--out", metrics_path)
    check(code == 1 and "must name an .svg file" in err and open(metrics_path, "rb").read() == before,
          f"--out onto the run's metrics.jsonl is refused and the file kept: {err.strip()}")


def progress_and_quiet(marrow, base, corpus, tmp):
    """Progress lines."""
    run, demo = os.path.join(tmp, "resumed"), os.path.join(tmp, "tiny-moe")
    slow = {"MARROW_TEST_PROGRESS_DELAY_S": "0"}
    hf = os.path.join(tmp, "hf")
    for quiet in ([], ["--quiet"]):
        code, out, err = marrow("export", demo, hf, "--overwrite", *quiet, env_extra=slow)
        lines = progress_lines(err, f"writing {hf}:")
        check(code == 0 and (len(lines) >= 2 if not quiet else not lines),
              f"export {' '.join(quiet)}: {'no progress' if quiet else 'progress and a closing line'}: {lines}")
        code, out, err = marrow("import", hf, os.path.join(tmp, "imported"), "--overwrite", *quiet, env_extra=slow)
        lines = progress_lines(err, f"reading {hf}:")
        check(code == 0 and (len(lines) >= 2 if not quiet else not lines),
              f"import {' '.join(quiet)}: {'no progress' if quiet else 'progress and a closing line'}: {lines}")
        code, out, err = marrow("train", *base, f"--output.dir={run}", "--train.steps=10", *quiet, env_extra=slow)
        lines = progress_lines(err, "dataset: checking sha256 of")
        check(code == 0 and (len(lines) >= 2 if not quiet else not lines),
              f"train {' '.join(quiet)}: the corpus check {'is silent' if quiet else 'shows progress'}: {lines}")
        for what in ("checkpoint: verifying the sha256 of", "checkpoint: reading weights of"):
            lines = progress_lines(err, what)
            check(code == 0 and (len(lines) >= 2 if not quiet else not lines),
                  f"train {' '.join(quiet)}: resuming, '{what}' {'is silent' if quiet else 'shows progress'}: {lines}")
    code, out, err = marrow("export", demo, hf, "--overwrite")
    check(code == 0 and not progress_lines(err, "writing"), "quick work prints no progress line")

def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--marrow", required=True)
    parser.add_argument("--build-dir", required=True)
    args = parser.parse_args()
    repo = os.getcwd()
    corpus = os.path.join(os.environ.get("MARROW_DEMO_CORPUS", os.path.join(args.build_dir, "demo-corpus")), "corpus")
    base = ["configs/tiny-moe.toml", f"--data.path={corpus}", "--train.global_batch=8", "--train.micro_batch=8",
            "--schedule.warmup_steps=2", "--output.log_every=1", "--eval.every=2", "--eval.samples=4"]

    def marrow(*argv, env_extra=None):
        env = dict(os.environ, **(env_extra or {}))
        p = subprocess.run([args.marrow] + list(argv), cwd=repo, capture_output=True, text=True, errors="replace", env=env,
                           timeout=600)
        return p.returncode, p.stdout, p.stderr

    with tempfile.TemporaryDirectory() as tmp:
        for part in (crash_resume_extend, fresh_run_over_an_old_one, start_elsewhere_keeps_records, demo_and_plot, progress_and_quiet):
            part(marrow, base, corpus, tmp)

    print("PASS" if not FAILURES else "FAIL")
    sys.exit(1 if FAILURES else 0)


if __name__ == "__main__":
    main()
