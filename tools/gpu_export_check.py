"""Export check on the GPU machine (tools/gpu_export_check.sh): the bench-shaped model that Marrow
trained for 20 steps and exported loads in transformers, and its loss on a batch of the corpus
matches Marrow's own forward within bf16 tolerance.

  gpu_export_check.py --model-forward BIN --checkpoint RUN_DIR --hf HF_DIR --corpus CORPUS --out DIR

Marrow's forward (tests/tools/model_forward, bf16 compute from the fp32 checkpoint, as training runs)
is compared with transformers' forward of the bf16 export in bf16, and of the same export in fp32.
Prints a table and PASS or FAIL.
"""
import argparse
import json
import os
import subprocess
import sys
import time

import numpy as np
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer


def hf_loss(hf_dir, dtype, tokens, device):
    start = time.time()
    # Loaded on the host, then moved: device_map would need accelerate, which the GPU image lacks.
    model = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=dtype).to(device).eval()
    loaded = time.time() - start
    with torch.no_grad():
        loss = model(input_ids=tokens, labels=tokens).loss.float().item()
    del model
    if device == "cuda":
        torch.cuda.empty_cache()
    return loss, loaded


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--model-forward", required=True)
    p.add_argument("--checkpoint", required=True)
    p.add_argument("--hf", required=True)
    p.add_argument("--corpus", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--seq", type=int, default=4096)
    p.add_argument("--tolerance", type=float, default=0.02)
    p.add_argument("--device", default="cuda", help="cpu for a dry run of this script on a small model")
    a = p.parse_args()
    os.makedirs(a.out, exist_ok=True)

    manifest = json.load(open(os.path.join(a.corpus, "manifest.json")))
    stream = np.fromfile(os.path.join(a.corpus, manifest["shards"][0]["file"]), dtype="<u4")
    ids = stream[: a.seq].astype(np.int64)
    tokens_file = os.path.join(a.out, "tokens.txt")
    with open(tokens_file, "w") as f:
        f.write(f"1 {a.seq} " + " ".join(str(t) for t in ids) + "\n")

    start = time.time()
    subprocess.run([a.model_forward, a.checkpoint, tokens_file, os.path.join(a.out, "marrow-forward"), a.device, "--no-logits"],
                   check=True)
    marrow = json.load(open(os.path.join(a.out, "marrow-forward", "marrow_loss.json")))["loss"]
    marrow_s = time.time() - start

    tokenizer_ok = True
    if os.path.exists(os.path.join(a.hf, "tokenizer.json")):
        tok = AutoTokenizer.from_pretrained(a.hf)
        text = "The State of the Union is strong."
        tokenizer_ok = tok.decode(tok(text)["input_ids"]) == text
        print(f"AutoTokenizer: {type(tok).__name__}, vocab {len(tok)}, round trip {'ok' if tokenizer_ok else 'WRONG'}")

    tokens = torch.tensor(ids).unsqueeze(0).to(a.device)
    hf_bf16, load_bf16 = hf_loss(a.hf, torch.bfloat16, tokens, a.device)
    hf_fp32, load_fp32 = hf_loss(a.hf, torch.float32, tokens, a.device)
    rel_bf16 = abs(marrow - hf_bf16) / abs(hf_bf16)
    rel_fp32 = abs(marrow - hf_fp32) / abs(hf_fp32)
    print(f"batch: 1 x {a.seq} tokens of {a.corpus}")
    print(f"{'forward':<40} {'loss':>10} {'rel diff':>9}")
    print(f"{'marrow (' + ('bf16' if a.device == 'cuda' else 'fp32') + ' compute, fp32 checkpoint)':<40} {marrow:>10.5f} {'':>9}   ({marrow_s:.0f} s incl. load)")
    print(f"{'transformers, bf16 export in bf16':<40} {hf_bf16:>10.5f} {rel_bf16:>9.2e}   (load {load_bf16:.0f} s)")
    print(f"{'transformers, bf16 export in fp32':<40} {hf_fp32:>10.5f} {rel_fp32:>9.2e}   (load {load_fp32:.0f} s)")
    ok = rel_bf16 <= a.tolerance and rel_fp32 <= a.tolerance and tokenizer_ok
    print("PASS" if ok else "FAIL")
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
