"""Parity of GPT-OSS with Hugging Face transformers (DESIGN.md §7, layer 3), forward and backward.

For two GPT-OSS configs that differ in every size (sliding and full layers, sinks, YaRN RoPE, the
clamped SwiGLU with biases, sequences longer than the window), Marrow initialises a model, writes it
under Hugging Face's tensor names and runs its fp32 forward and backward (tests/tools/hf_dump.cpp
--grads); transformers' GptOssForCausalLM (eager attention) loads the same files, runs the same
tokens and backpropagates the same mean token loss. Logits, loss and every parameter's gradient must
agree to a max relative error of 1e-4 (gradients: against the largest element of the tensor's
gradient). Weights, and biases (hf_dump --random-biases), are drawn ten times larger than Hugging
Face's default so that routing is decisive, some SwiGLU inputs pass the clamp, and small errors
cannot hide.
"""
import argparse
import json
import os
import subprocess
import sys
import tempfile

import torch
from safetensors.torch import load_file
from transformers import GptOssForCausalLM

YARN = {"rope_type": "yarn", "rope_theta": 150000.0, "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0,
        "truncate": False, "original_max_position_embeddings": 4096}
CONFIGS = {
    "a": dict(vocab_size=300, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
              head_dim=16, num_local_experts=8, num_experts_per_tok=2, intermediate_size=32, sliding_window=5,
              rope_parameters=YARN, rms_norm_eps=1e-5, initializer_range=0.2, swiglu_limit=7.0),
    "b": dict(vocab_size=257, hidden_size=48, num_hidden_layers=3, num_attention_heads=8, num_key_value_heads=1,
              head_dim=8, num_local_experts=6, num_experts_per_tok=3, intermediate_size=24, sliding_window=4,
              layer_types=["full_attention", "sliding_attention", "sliding_attention"],
              rope_parameters={"rope_type": "default", "rope_theta": 10000.0}, rms_norm_eps=1e-6, initializer_range=0.3,
              swiglu_limit=1.5),
}


def rel_err(a, b):
    return ((a - b).abs().max() / b.abs().max().clamp_min(1e-30)).item()


def check(name, fields, hf_dump, workdir):
    config = dict(model_type="gpt_oss", architectures=["GptOssForCausalLM"], tie_word_embeddings=False,
                  attention_bias=True, max_position_embeddings=131072, **fields)
    out = os.path.join(workdir, name)
    os.makedirs(out)
    config_path = os.path.join(out, "input_config.json")
    with open(config_path, "w") as f:
        json.dump(config, f)
    batch, seq = 2, 13
    g = torch.Generator().manual_seed(7)
    tokens = torch.randint(0, fields["vocab_size"], (batch, seq), generator=g)
    subprocess.run([hf_dump, "--grads", "--random-biases", config_path, out, "1234", str(batch), str(seq)] + [str(t) for t in tokens.flatten().tolist()],
                   check=True)

    model = GptOssForCausalLM.from_pretrained(out, dtype=torch.float32, attn_implementation="eager").train()
    marrow = load_file(os.path.join(out, "marrow_outputs.safetensors"))
    assert torch.equal(marrow["input_ids"].long(), tokens)
    result = model(input_ids=tokens, labels=tokens)
    result.loss.backward()
    logits_err = rel_err(marrow["logits"], result.logits.detach().float())
    marrow_loss = json.load(open(os.path.join(out, "marrow_loss.json")))["loss"]
    loss_err = abs(marrow_loss - result.loss.item()) / abs(result.loss.item())
    grads = load_file(os.path.join(out, "marrow_grads.safetensors"))
    hf_grads = {n: p.grad for n, p in model.named_parameters()}
    assert set(grads) == set(hf_grads), f"tensor names differ: {sorted(set(grads) ^ set(hf_grads))}"
    grad_errs = {n: rel_err(grads[n], hf_grads[n]) for n in grads}
    worst = max(grad_errs, key=grad_errs.get)
    ok = logits_err <= 1e-4 and loss_err <= 1e-4 and grad_errs[worst] <= 1e-4
    print(f"config {name}: logits max rel err {logits_err:.2e}, loss marrow {marrow_loss:.6f} hf {result.loss.item():.6f} "
          f"rel err {loss_err:.2e}, {len(grads)} gradients, worst {worst} {grad_errs[worst]:.2e} -> {'ok' if ok else 'MISMATCH'}")
    if not ok:
        for n, e in sorted(grad_errs.items(), key=lambda x: -x[1])[:8]:
            print(f"  {n}: {e:.2e}")
    return ok


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--marrow", required=True)
    parser.add_argument("--build-dir", required=True)
    args = parser.parse_args()
    hf_dump = os.path.join(args.build_dir, "tests", "hf_dump")
    torch.manual_seed(0)
    with tempfile.TemporaryDirectory() as workdir:
        results = [check(name, fields, hf_dump, workdir) for name, fields in CONFIGS.items()]
    print("PASS" if all(results) else "FAIL")
    sys.exit(0 if all(results) else 1)


if __name__ == "__main__":
    main()
