#!/usr/bin/env bash
# The built-in demo: set up, build, prepare the demo corpus (real English text from a Debian
# package, a tokenizer trained on it, the tokenized corpus), then train a tiny MoE on it, plot its
# loss and sample from it.
# Extra arguments go to marrow train, e.g. tools/demo.sh --train.steps=50
set -euo pipefail
cd "$(dirname "$0")/.."
tools/build.sh marrow
tools/make_demo_corpus.sh build/marrow build/demo-corpus
build/marrow train configs/tiny-moe.toml "$@"
out=runs/tiny-moe
for arg in "$@"; do case $arg in --output.dir=*) out=${arg#--output.dir=} ;; esac; done
# Training and validation loss against tokens seen, as a picture (docs/images/tiny-moe-loss.svg is
# one); `tensorboard --logdir $out/tb` shows every number of the step lines.
build/marrow plot "$out" --out "$out/loss.svg"
# The model's own words: continuations of a prompt from the newest checkpoint (marrow sample).
build/marrow sample "$out" --prompt "The Python interpreter" --tokens 48 --samples 2
