"""Parity with Hugging Face transformers (DESIGN.md §7, layer 3).

For two Qwen3-MoE configs that differ in every size, Marrow initialises a model, writes it under
Hugging Face tensor names and runs its fp32 forward (tests/tools/hf_dump.cpp); transformers'
Qwen3MoeForCausalLM loads the same files and runs the same tokens. Logits and loss must agree to a
max relative error of 1e-4. Weights are drawn ten times larger than Hugging Face's default so that
routing is decisive and logits are far from uniform: small errors cannot hide.
"""
import argparse
import json
import os
import subprocess
import sys
import tempfile

import torch
from safetensors.torch import load_file
from transformers import Qwen3MoeForCausalLM

CONFIGS = {
    "a": dict(vocab_size=300, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
              head_dim=16, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32, norm_topk_prob=True,
              rope_parameters={"rope_theta": 10000.0, "rope_type": "default"}, rms_norm_eps=1e-6,
              initializer_range=0.2),
    "b": dict(vocab_size=257, hidden_size=48, num_hidden_layers=3, num_attention_heads=8, num_key_value_heads=1,
              head_dim=8, num_experts=6, num_experts_per_tok=3, moe_intermediate_size=24, norm_topk_prob=False,
              rope_theta=1000000.0, rms_norm_eps=1e-5, initializer_range=0.3),
}


def check(name, fields, hf_dump, workdir):
    config = dict(model_type="qwen3_moe", architectures=["Qwen3MoeForCausalLM"], hidden_act="silu",
                  tie_word_embeddings=False, intermediate_size=4 * fields["hidden_size"], max_position_embeddings=512,
                  **fields)
    out = os.path.join(workdir, name)
    os.makedirs(out)
    config_path = os.path.join(out, "input_config.json")
    with open(config_path, "w") as f:
        json.dump(config, f)
    batch, seq = 2, 13
    g = torch.Generator().manual_seed(7)
    tokens = torch.randint(0, fields["vocab_size"], (batch, seq), generator=g)
    subprocess.run([hf_dump, config_path, out, "1234", str(batch), str(seq)] + [str(t) for t in tokens.flatten().tolist()],
                   check=True)

    model = Qwen3MoeForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    marrow = load_file(os.path.join(out, "marrow_outputs.safetensors"))
    assert torch.equal(marrow["input_ids"].long(), tokens)
    with torch.no_grad():
        result = model(input_ids=tokens, labels=tokens)
    hf_logits = result.logits.float()
    logits_err = ((marrow["logits"] - hf_logits).abs().max() / hf_logits.abs().max()).item()
    marrow_loss = json.load(open(os.path.join(out, "marrow_loss.json")))["loss"]
    loss_err = abs(marrow_loss - result.loss.item()) / abs(result.loss.item())
    ok = logits_err <= 1e-4 and loss_err <= 1e-4
    print(f"config {name}: logits max rel err {logits_err:.2e}, loss marrow {marrow_loss:.6f} hf {result.loss.item():.6f} "
          f"rel err {loss_err:.2e} -> {'ok' if ok else 'MISMATCH'}")
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
