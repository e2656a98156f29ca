#!/usr/bin/env bash
# Exports a checkpoint to a Hugging Face directory and checks it in transformers (see SKILL.md).
# usage: check.sh <checkpoint-or-run-dir> [out-dir] [--dtype=bfloat16]
set -uo pipefail
cd "$(dirname "$0")/../../.."
[ $# -ge 1 ] || { echo "usage: $0 <checkpoint-or-run-dir> [out-dir] [--dtype=bfloat16]"; echo FAIL; exit 2; }
checkpoint=$1
out=${2:-$(mktemp -d)/hf}
dtype=${3:---dtype=float32}
marrow=${MARROW:-build/marrow}
build=${MARROW_BUILD:-build}
python=${PYTHON:-.venv/bin/python}
for f in "$marrow" "$build/tests/model_forward" "$python"; do
  [ -x "$f" ] || { echo "$f is missing: build first (cmake --build $build) or set MARROW/MARROW_BUILD/PYTHON"; echo FAIL; exit 1; }
done
rm -rf "$out"
"$marrow" export "$checkpoint" "$out" "$dtype" || { echo FAIL; exit 1; }
"$python" - "$out" "$checkpoint" "$build/tests/model_forward" "$dtype" <<'PY'
import json, os, subprocess, sys, tempfile
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, AutoTokenizer
hf, checkpoint, model_forward, dtype = sys.argv[1:5]
model = AutoModelForCausalLM.from_pretrained(hf, dtype=torch.float32).eval()
print(f"transformers loaded {hf}: {type(model).__name__}, {sum(p.numel() for p in model.parameters()) / 1e6:.2f}M parameters")
vocab = model.config.vocab_size
if os.path.exists(os.path.join(hf, "tokenizer.json")):
    tok = AutoTokenizer.from_pretrained(hf)
    text = "The quick brown fox jumps over the lazy dog. Python is a programming language."
    ids = tok(text)["input_ids"][:32]
    print(f"AutoTokenizer: {type(tok).__name__}, {len(ids)} tokens, eos {tok.eos_token!r}")
else:
    print("no tokenizer in the export: using random tokens")
    ids = torch.randint(0, vocab, (32,), generator=torch.Generator().manual_seed(0)).tolist()
tokens = torch.tensor([ids])
with tempfile.TemporaryDirectory() as tmp:
    with open(os.path.join(tmp, "tokens.txt"), "w") as f:
        f.write(f"1 {len(ids)} " + " ".join(map(str, ids)))
    subprocess.run([model_forward, checkpoint, os.path.join(tmp, "tokens.txt"), tmp], check=True)
    marrow = load_file(os.path.join(tmp, "marrow_outputs.safetensors"))["logits"]
with torch.no_grad():
    logits = model(input_ids=tokens).logits
err = ((marrow - logits).abs().max() / logits.abs().max()).item()
bound = 2e-2 if "bfloat16" in dtype else 1e-4
print(f"logits max relative error vs Marrow: {err:.2e} (bound {bound:g})")
print("PASS" if err <= bound else "FAIL")
PY
