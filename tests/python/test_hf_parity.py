"""Parity with Hugging Face transformers (DESIGN.md §7, layer 3), for every model family.

For two configs of each family that differ in every size, Marrow initialises a model, writes it under
Hugging Face tensor names and runs its fp32 forward (tests/tools/hf_dump.cpp); transformers loads the
same files and runs the same tokens. Logits and loss must agree to a max relative error of 1e-4.
Weights are drawn ten times larger than Hugging Face's default so that routing is decisive and logits
are far from uniform: small errors cannot hide.

Both families also run the backward (hf_dump --grads): every parameter's gradient of the mean token
loss must agree with transformers' to 1e-4 (against the largest element of that gradient). Marrow
keeps Qwen3-MoE's experts one tensor each, as the Hub's files do; transformers 5 fuses them
(mlp.experts.gate_up_proj [E, 2I, H], gate rows then up rows; down_proj [E, H, I]), so Marrow's are
stacked the same way before the comparison. GptOssForCausalLM (eager attention): sliding and full
layers, sinks, YaRN RoPE, the clamped SwiGLU with biases (hf_dump --random-biases draws every bias
as the weights are), sequences longer than the window. DeepseekV2ForCausalLM (eager attention): multi-head
latent attention with and without q-LoRA, dense first layers, shared experts, greedy and group-limited
routing with a routed scaling factor, YaRN with DeepSeek's mscale (V2-Lite's rope_scaling).
Qwen3_5MoeForCausalLM (transformers' torch paths: chunked gated delta rule, conv1d): Gated DeltaNet and
gated attention layers, key and value heads equal or not, partial RoPE, the shared expert's gate, every
norm weight drawn (hf_dump --random-norms: the zero-centred norms' offset), sequences past one 64-token chunk.
"""
import argparse
import json
import os
import subprocess
import sys
import tempfile

import torch
from safetensors.torch import load_file
from transformers import DeepseekV2ForCausalLM, GptOssForCausalLM, Qwen3_5MoeForCausalLM, Qwen3MoeForCausalLM

QWEN3 = dict(model_type="qwen3_moe", architectures=["Qwen3MoeForCausalLM"], hidden_act="silu", tie_word_embeddings=False,
             max_position_embeddings=512)
GPT_OSS = dict(model_type="gpt_oss", architectures=["GptOssForCausalLM"], tie_word_embeddings=False, attention_bias=True,
               max_position_embeddings=131072)
YARN = {"rope_type": "yarn", "rope_theta": 150000.0, "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0,
        "truncate": False, "original_max_position_embeddings": 4096}
DEEPSEEK = dict(model_type="deepseek_v2", architectures=["DeepseekV2ForCausalLM"], hidden_act="silu", tie_word_embeddings=False,
                max_position_embeddings=512)
# DeepSeek-V2-Lite's rope_scaling (its config.json), with max_position_embeddings 163840.
LITE_YARN = {"type": "yarn", "factor": 40, "beta_fast": 32, "beta_slow": 1, "mscale": 0.707, "mscale_all_dim": 0.707,
             "original_max_position_embeddings": 4096}
QWEN3_5 = dict(model_type="qwen3_5_moe_text", architectures=["Qwen3_5MoeForCausalLM"], hidden_act="silu", tie_word_embeddings=False,
               max_position_embeddings=512, linear_conv_kernel_dim=4)
CONFIGS = {
    "qwen3 a": dict(QWEN3, vocab_size=300, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                    head_dim=16, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32, intermediate_size=256,
                    norm_topk_prob=True, rope_parameters={"rope_theta": 10000.0, "rope_type": "default"}, rms_norm_eps=1e-6,
                    initializer_range=0.2),
    "qwen3 b": dict(QWEN3, vocab_size=257, hidden_size=48, num_hidden_layers=3, num_attention_heads=8, num_key_value_heads=1,
                    head_dim=8, num_experts=6, num_experts_per_tok=3, moe_intermediate_size=24, intermediate_size=192,
                    norm_topk_prob=False, rope_theta=1000000.0, rms_norm_eps=1e-5, initializer_range=0.3),
    "gpt_oss a": dict(GPT_OSS, vocab_size=300, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                      head_dim=16, num_local_experts=8, num_experts_per_tok=2, intermediate_size=32, sliding_window=5,
                      rope_parameters=YARN, rms_norm_eps=1e-5, initializer_range=0.2, swiglu_limit=7.0),
    "gpt_oss b": dict(GPT_OSS, vocab_size=257, hidden_size=48, num_hidden_layers=3, num_attention_heads=8, num_key_value_heads=1,
                      head_dim=8, num_local_experts=6, num_experts_per_tok=3, intermediate_size=24, sliding_window=4,
                      layer_types=["full_attention", "sliding_attention", "sliding_attention"],
                      rope_parameters={"rope_type": "default", "rope_theta": 10000.0}, rms_norm_eps=1e-6, initializer_range=0.3,
                      swiglu_limit=1.5),
    # Every feature: q-LoRA, a dense first layer, shared experts, group-limited routing, routed scaling.
    "deepseek_v2 a": dict(DEEPSEEK, vocab_size=300, hidden_size=64, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=4,
                          q_lora_rank=24, kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=12,
                          intermediate_size=96, moe_intermediate_size=20, n_routed_experts=8, n_shared_experts=2, num_experts_per_tok=3,
                          first_k_dense_replace=1, topk_method="group_limited_greedy", n_group=4, topk_group=2,
                          routed_scaling_factor=2.5, norm_topk_prob=False, rope_theta=10000.0, rms_norm_eps=1e-6, initializer_range=0.2),
    # DeepSeek-V2-Lite's shape cut down: no q-LoRA, greedy routing, one shared pair of experts, its YaRN with mscale.
    "deepseek_v2 lite": dict(DEEPSEEK, vocab_size=257, hidden_size=48, num_hidden_layers=2, num_attention_heads=3, num_key_value_heads=3,
                             q_lora_rank=None, kv_lora_rank=16, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16,
                             intermediate_size=80, moe_intermediate_size=12, n_routed_experts=6, n_shared_experts=2, num_experts_per_tok=2,
                             first_k_dense_replace=1, topk_method="greedy", routed_scaling_factor=1.0, norm_topk_prob=False,
                             rope_scaling=LITE_YARN, rope_theta=10000.0, max_position_embeddings=163840, rms_norm_eps=1e-6,
                             initializer_range=0.3),
    "qwen3_5 a": dict(QWEN3_5, vocab_size=300, hidden_size=64, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
                      head_dim=32, linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16, linear_value_head_dim=8,
                      num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=48,
                      rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.25},
                      rms_norm_eps=1e-6, initializer_range=0.2),
    "qwen3_5 b": dict(QWEN3_5, vocab_size=257, hidden_size=48, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
                      head_dim=16, layer_types=["full_attention", "linear_attention"], linear_num_key_heads=3, linear_num_value_heads=3,
                      linear_key_head_dim=8, linear_value_head_dim=16, num_experts=6, num_experts_per_tok=3, moe_intermediate_size=24,
                      shared_expert_intermediate_size=20, rope_parameters={"rope_type": "default", "rope_theta": 1000000.0,
                      "partial_rotary_factor": 0.5}, rms_norm_eps=1e-5, initializer_range=0.3),
}
SEQ = {"qwen3_5 a": 70, "qwen3_5 b": 130}  # past one and two of the delta rule's 64-token chunks


def rel_err(a, b):
    return ((a - b).abs().max() / b.abs().max().clamp_min(1e-30)).item()


def fused_experts(grads, layers, experts):
    """Per-expert gradients (Qwen3-MoE, DeepSeek-V2) stacked as transformers 5 holds the weights."""
    for layer in layers:
        p = f"model.layers.{layer}.mlp.experts."
        gate_up = [torch.cat([grads.pop(f"{p}{e}.gate_proj.weight"), grads.pop(f"{p}{e}.up_proj.weight")]) for e in range(experts)]
        grads[p + "gate_up_proj"] = torch.stack(gate_up)
        grads[p + "down_proj"] = torch.stack([grads.pop(f"{p}{e}.down_proj.weight") for e in range(experts)])
    return grads


def gradient_errors(out, model, config):
    """Each parameter's gradient against transformers' (after its backward), by name; the worst."""
    grads = load_file(os.path.join(out, "marrow_grads.safetensors"))
    if config["model_type"] in ("qwen3_moe", "qwen3_5_moe_text"):
        grads = fused_experts(grads, range(config["num_hidden_layers"]), config["num_experts"])
    if config["model_type"] == "deepseek_v2":
        grads = fused_experts(grads, range(config["first_k_dense_replace"], config["num_hidden_layers"]), config["n_routed_experts"])
    hf_grads = {n: p.grad for n, p in model.named_parameters()}
    assert set(grads) == set(hf_grads), f"tensor names differ: {sorted(set(grads) ^ set(hf_grads))}"
    errs = {n: rel_err(grads[n], hf_grads[n]) for n in grads}
    return errs, max(errs, key=errs.get)


def check(name, config, hf_dump, workdir):
    gpt_oss = config["model_type"] == "gpt_oss"
    out = os.path.join(workdir, name.replace(" ", "-"))
    os.makedirs(out)
    config_path = os.path.join(out, "input_config.json")
    with open(config_path, "w") as f:
        json.dump(config, f)
    batch, seq = 2, SEQ.get(name, 13)
    g = torch.Generator().manual_seed(7)
    tokens = torch.randint(0, config["vocab_size"], (batch, seq), generator=g)
    flags = ["--grads", "--random-biases"] if gpt_oss else ["--grads", "--random-norms"] if config["model_type"] == "qwen3_5_moe_text" else ["--grads"]
    subprocess.run([hf_dump, *flags, config_path, out, "1234", str(batch), str(seq)] + [str(t) for t in tokens.flatten().tolist()],
                   check=True)

    if gpt_oss:
        model = GptOssForCausalLM.from_pretrained(out, dtype=torch.float32, attn_implementation="eager").train()
    elif config["model_type"] == "deepseek_v2":
        model = DeepseekV2ForCausalLM.from_pretrained(out, dtype=torch.float32, attn_implementation="eager").train()
    elif config["model_type"] == "qwen3_5_moe_text":
        model = Qwen3_5MoeForCausalLM.from_pretrained(out, dtype=torch.float32, attn_implementation="eager").train()
    else:
        model = Qwen3MoeForCausalLM.from_pretrained(out, dtype=torch.float32).train()
    marrow = load_file(os.path.join(out, "marrow_outputs.safetensors"))
    assert torch.equal(marrow["input_ids"].long(), tokens)
    result = model(input_ids=tokens, labels=tokens)
    logits_err = rel_err(marrow["logits"], result.logits.detach().float())
    marrow_loss = json.load(open(os.path.join(out, "marrow_loss.json")))["loss"]
    loss_err = abs(marrow_loss - result.loss.item()) / abs(result.loss.item())
    result.loss.backward()
    errs, worst = gradient_errors(out, model, config)
    ok = logits_err <= 1e-4 and loss_err <= 1e-4 and errs[worst] <= 1e-4
    print(f"config {name}: logits max rel err {logits_err:.2e}, loss marrow {marrow_loss:.6f} hf {result.loss.item():.6f} "
          f"rel err {loss_err:.2e}, {len(errs)} gradients, worst {worst} {errs[worst]:.2e} -> {'ok' if ok else 'MISMATCH'}")
    return ok


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--marrow", required=True)
    parser.add_argument("--build-dir", required=True)
    args = parser.parse_args()
    hf_dump = os.path.join(args.build_dir, "tests", "hf_dump")
    torch.manual_seed(0)
    with tempfile.TemporaryDirectory() as workdir:
        results = [check(name, config, hf_dump, workdir) for name, config in CONFIGS.items()]
    print("PASS" if all(results) else "FAIL")
    sys.exit(0 if all(results) else 1)


if __name__ == "__main__":
    main()
