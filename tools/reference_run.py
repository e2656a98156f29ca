#!/usr/bin/env python3
"""An independent trainer for Marrow's Qwen3-MoE and DeepSeek-V2 runs, in PyTorch and transformers (issues #52, #50).

It trains the model of a Marrow run config the way `marrow train` does, from the same weights on the
same batches, so that the two loss curves can be laid side by side over a long run:
  - weights: a Hugging Face initialisation (`init`, transformers' own _init_weights under a seed),
    which `marrow import` turns into Marrow's starting checkpoint;
  - batches: Marrow's sample order (data/dataset.h) computed here from the corpus: windows of
    seq_len + 1 tokens, the held-out windows spread evenly, a seeded Feistel permutation per epoch;
  - loss: the mean cross-entropy over the step's targets plus aux_loss_coef times the load-balance
    loss E * sum_e f_e * P_e of each MoE layer and micro-batch, averaged (ops/router.h). DeepSeek-V2:
    f_e counts the routing's own top-k choice (group-limited under topk_method group_limited_greedy),
    with seq_aux the loss of each sequence, averaged over them (router_statistics_grouped); the
    coefficient is router_aux_loss_coef, else aux_loss_alpha x MoE layers / top-k (models/deepseek_v2.cpp),
    and norm_topk_prob normalises the routing weights as Marrow does (transformers 5 ignores it);
  - update: global-norm clipping, torch.optim.AdamW (decay on matrices only, as ParamKind::matrix),
    the learning rate of engine/lr_schedule.h; optimizer.kind = "muon": Muon (MuonWithAdamW below, written
    from the formulas of ops/muon.h) for the matrices Marrow orthogonalizes, AdamW for the rest;
  - precision: fp32 weights; on the GPU, bf16 autocast (bf16 compute, fp32 master weights, fp32
    gradients), on the CPU plain fp32 (the CI test against marrow train on the CPU). The residual
    stream (the embedding output, residual + attention and residual + MLP in every decoder layer)
    stays fp32 under autocast; --residual-dtype bfloat16 rounds it to bf16 at those points, as Marrow
    holds it (every activation bf16, rounded after each add), and so its gradients there too: issue
    #52's test of whether precision explains Marrow's ~0.6% higher H100 training loss (decoder_layer_forward_bf16).
It writes metrics.jsonl in Marrow's format, so `marrow plot` draws both runs.

  reference_run.py init <run-config> <hf-dir>                 the initial weights and config.json
  reference_run.py train <run-config> <hf-dir> <out-dir> [--section.key=value ...]
        [--device cpu|cuda] [--stop-after-s S] [--checkpoint-every N] [--residual-dtype float32|bfloat16]
        resumes from <out-dir>/reference.pt when present (made with the same --residual-dtype);
        --stop-after-s saves and exits 0 when a step ends past S seconds (one device call's limit), the
        next call goes on
  reference_run.py eval <run-config> <hf-dir> [--device ...]  the mean loss over eval.samples held-out
        sequences of a Hugging Face model (e.g. marrow export of the final checkpoint), printed as JSON
  reference_run.py bench <run-config> <hf-dir> [--warmup N] [--steps M] [--attention A] [--compile C] [--json F]
        [--residual-dtype R]
        the PyTorch peer of `marrow bench`: N warm-up and M measured training steps (the learning rate of
        marrow bench's schedule, which runs M / 4 more steps) on the run's batches; prints one line with
        tokens/s, ms/step, TFLOP/s and MFU from Marrow's FLOP count (6 x active parameters + causal
        attention, flops_per_token below), torch.cuda.max_memory_allocated and the losses; --json writes
        the same as JSON. Speed settings: fused AdamW, one host read a step (the losses and the gradient norm,
        after the last backward; the gradients scaled only when clipped), no KV cache,
        --attention sdpa (torch's pick: DeepSeek's v head dim 128 < q/k's 192 rules out its flash kernel),
        sdpa_padded (v zero-padded to q's head dim, output cropped: flash-eligible, as transformers'
        flash_attention integration does), sdpa_cudnn (SDPA forced onto cuDNN), eager, any other
        attn_implementation, or auto (default on the GPU: each candidate times 1 + 2 steps, the fastest
        is kept, then the initial weights come back and the measured run starts from step 1);
        --compile layers: torch.compile of each decoder layer and of the LM head + loss (default none).
  init's --init-device cuda draws the initial weights on the GPU (seconds for billions of parameters;
  other values than the CPU's under the same seed); the weights are written in shards of --shard-size.
"""
import argparse
import json
import math
import os
import sys
import time
import tomllib

import numpy as np

MASK64 = (1 << 64) - 1


def fail(message):
    print(f"reference_run: error: {message}", file=sys.stderr)
    sys.exit(1)


# The run config: Marrow's keys and defaults (engine/run_config.h) for what this trainer uses.
DEFAULTS = {
    "model.config": None, "data.path": None, "data.validation_fraction": 0.01, "data.max_epochs": 1,
    "train.steps": 200, "train.global_batch": 8, "train.micro_batch": 8, "train.seq_len": 128, "train.seed": 1234,
    "train.aux_loss_coef": -1.0, "optimizer.lr": 3e-3, "optimizer.min_lr": 3e-4, "optimizer.beta1": 0.9,
    "optimizer.beta2": 0.95, "optimizer.eps": 1e-8, "optimizer.weight_decay": 0.1, "optimizer.grad_clip": 1.0,
    "optimizer.kind": "adamw", "optimizer.muon_momentum": 0.95, "optimizer.muon_scale": 0.2, "optimizer.muon_steps": 5,
    "schedule.kind": "cosine", "schedule.warmup_steps": 20, "schedule.decay_fraction": 0.2, "output.log_every": 1,
    "eval.every": 0, "eval.samples": 16,
}


def run_config(path, overrides):
    """The run config's values that matter here; keys this trainer does not model are accepted and ignored."""
    try:
        with open(path, "rb") as f:
            toml = tomllib.load(f)
    except OSError as e:
        fail(f"cannot open run config {path}: {e.strerror}")
    rc = dict(DEFAULTS)
    for section, keys in toml.items():
        for key, value in keys.items():
            rc[f"{section}.{key}"] = value
    for o in overrides:
        if not o.startswith("--") or "=" not in o:
            fail(f"an override is written --section.key=value, got '{o}'")
        key, value = o[2:].split("=", 1)
        default = rc.get(key)
        rc[key] = type(default)(value) if isinstance(default, (int, float)) and not isinstance(default, bool) else value
    for key in ("model.config", "data.path"):
        if not rc[key]:
            fail(f"the run config {path} has no {key}")
    return rc


def learning_rate(rc, step):
    """engine/lr_schedule.h at the 1-based step."""
    lr, min_lr, warmup, total = rc["optimizer.lr"], rc["optimizer.min_lr"], rc["schedule.warmup_steps"], rc["train.steps"]
    if step <= warmup:
        return lr * step / max(1, warmup)
    if rc["schedule.kind"] == "wsd":
        decay = max(1.0, rc["schedule.decay_fraction"] * total)
        into = step - (total - decay)
        return lr if into <= 0 else lr + (min_lr - lr) * min(1.0, into / decay)
    progress = (step - warmup) / max(1, total - warmup)
    return min_lr + 0.5 * (lr - min_lr) * (1 + math.cos(math.pi * min(1.0, progress)))


def mix(x):
    x = (x + 0x9E3779B97F4A7C15) & MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & MASK64
    return x ^ (x >> 31)


def permute(index, n, key):
    """data/dataset.cpp's bijection of [0, n): a four-round Feistel network with cycle walking."""
    bits = max(2, (n - 1).bit_length())
    bits += bits & 1
    half = bits // 2
    mask = (1 << half) - 1
    while True:
        left, right = index >> half, index & mask
        for r in range(4):
            left, right = right, left ^ (mix(right ^ mix((key + r) & MASK64)) & mask)
        index = (left << half) | right
        if index < n:
            return index


class Corpus:
    """A tokenized corpus read as Marrow's TokenDataset reads it (no hashing: marrow train checks the shards)."""

    def __init__(self, path, seq_len, seed, validation_fraction):
        try:
            with open(os.path.join(path, "manifest.json")) as f:
                manifest = json.load(f)
        except OSError as e:
            fail(f"cannot open the corpus manifest {path}/manifest.json: {e.strerror}")
        self.stream = np.concatenate([np.fromfile(os.path.join(path, s["file"]), dtype="<u4") for s in manifest["shards"]])
        if len(self.stream) != manifest["tokens"]:
            fail(f"corpus {path}: the shards hold {len(self.stream)} tokens, the manifest says {manifest['tokens']}")
        self.seq_len, self.seed = seq_len, seed
        windows = (len(self.stream) - 1) // seq_len
        held_out = 0
        if validation_fraction > 0 and windows >= 2:
            held_out = min(max(int(windows * validation_fraction), 1), windows // 2)
        # Held-out window j is floor((2j + 1) W / 2V): one in the middle of each of V equal parts.
        self.validation = [(2 * j + 1) * windows // (2 * held_out) for j in range(held_out)]
        held = set(self.validation)
        self.train = [w for w in range(windows) if w not in held]

    def window(self, w):
        return self.stream[w * self.seq_len:(w + 1) * self.seq_len + 1].astype(np.int64)

    def train_window_at(self, position):
        n = len(self.train)
        key = mix(self.seed ^ mix((position // n + 0x5EED) & MASK64))
        return self.train[permute(position % n, n, key)]

    def micro_batch(self, step, micro, count, global_batch):
        """Micro-batch `micro` of `count` sequences of the 1-based step (one process: dataset.h's train_batch)."""
        base = (step - 1) * global_batch + micro * count
        return np.stack([self.window(self.train_window_at(base + i)) for i in range(count)])


def experts_forward_bf16(self, hidden_states, top_k_index, top_k_weights):
    """The experts of a Qwen3-MoE or DeepSeek-V2 layer as grouped bf16 GEMMs (torch's grouped_mm, CUTLASS on Hopper).

    transformers' own grouped_mm path casts the input to the weights' dtype, so under autocast with
    fp32 weights it would multiply in fp32; this one casts the weights to bf16 as autocast does for
    every linear layer (the gradient still reaches the fp32 weights in fp32). Every shape is static
    (the counts by scatter_add, not bincount), so torch.compile traces it whole."""
    import torch
    import torch.nn.functional as F
    grouped_mm = getattr(F, "grouped_mm", None) or torch._grouped_mm
    k = top_k_index.shape[-1]
    chosen = top_k_index.reshape(-1)
    order = torch.argsort(chosen, stable=True)
    counts = torch.zeros(self.num_experts, dtype=torch.int64, device=chosen.device).scatter_add_(0, chosen, torch.ones_like(chosen))
    offsets = torch.cumsum(counts, 0, dtype=torch.int32)
    rows = order // k
    x = hidden_states[rows].to(torch.bfloat16)
    gate, up = grouped_mm(x, self.gate_up_proj.to(torch.bfloat16).transpose(-2, -1), offs=offsets).chunk(2, dim=-1)
    y = grouped_mm(F.silu(gate) * up, self.down_proj.to(torch.bfloat16).transpose(-2, -1), offs=offsets)
    y = y * top_k_weights.reshape(-1)[order, None].to(y.dtype)
    return torch.zeros(hidden_states.shape, dtype=y.dtype, device=y.device).index_add_(0, rows, y).to(hidden_states.dtype)


def decoder_layer_forward_bf16(self, hidden_states, **kwargs):
    """Qwen3MoeDecoderLayer.forward and DeepseekV2DecoderLayer.forward (the same code in transformers 5) with the
    residual stream rounded to bf16 (--residual-dtype bfloat16, issue #52): the layer's input, its sum residual +
    attention (post_attention_layernorm's input) and its output residual + MLP. Under autocast these stay fp32
    (the weights' dtype) while Marrow holds them in bf16, rounded after each add; .to(bfloat16) rounds the gradient
    through each point to bf16 as well (a bf16 tensor's gradient is bf16). Rounding the input rounds the embedding
    output at the first layer (a no-op at the next), rather than a hook on embed_tokens, whose bf16 output would
    also turn the model's rotary cos/sin (computed in the embedding's dtype) into bf16. The norms then see bf16
    input and round their normalised value to bf16 before the fp32 weight, as in a bf16 model."""
    import torch
    residual = hidden_states.to(torch.bfloat16)
    hidden_states, _ = self.self_attn(hidden_states=self.input_layernorm(residual), **kwargs)
    residual = (residual + hidden_states).to(torch.bfloat16)
    hidden_states = self.mlp(self.post_attention_layernorm(residual))
    return (residual + hidden_states).to(torch.bfloat16)


DECODER_LAYERS = ("Qwen3MoeDecoderLayer", "DeepseekV2DecoderLayer")  # whose forward decoder_layer_forward_bf16 mirrors


def is_deepseek(config):
    return config.model_type == "deepseek_v2"


def is_qwen3_5(config):
    return config.model_type == "qwen3_5_moe_text"


def moe_layers(model):
    """The decoder layers with routed experts (DeepSeek-V2's first first_k_dense_replace layers have a dense MLP)."""
    return [layer for layer in model.model.layers if hasattr(layer.mlp, "experts")]


def aux_coefficient(rc, config):
    """train.aux_loss_coef, else the model's: router_aux_loss_coef, or DeepSeek's aux_loss_alpha x MoE layers / top-k
    (models/deepseek_v2.cpp: DeepSeek sums alpha x E / K x sum f P over the layers, Marrow averages E x sum f P),
    else Marrow's default 0.001."""
    if rc["train.aux_loss_coef"] >= 0:
        return rc["train.aux_loss_coef"]
    coef = getattr(config, "router_aux_loss_coef", None)
    alpha = getattr(config, "aux_loss_alpha", None)
    if is_deepseek(config) and coef is None and alpha is not None:
        return alpha * (config.num_hidden_layers - (config.first_k_dense_replace or 0)) / config.num_experts_per_tok
    return 0.001 if coef is None else coef


def routed_experts(probs, config):
    """DeepseekV2TopkRouter's top-k choice from the softmax probabilities [T, E]: greedy, or among the topk_group
    groups of highest maximum probability (group_limited_greedy), computed with its operations."""
    import torch
    k, experts = config.num_experts_per_tok, config.num_experts
    if config.topk_method == "group_limited_greedy":
        groups = config.n_group
        group_scores = probs.view(-1, groups, experts // groups).max(dim=-1).values
        group_idx = torch.topk(group_scores, k=config.topk_group, dim=-1, sorted=False)[1]
        group_mask = torch.zeros_like(group_scores).scatter_(1, group_idx, 1)
        score_mask = group_mask.unsqueeze(-1).expand(-1, groups, experts // groups).reshape(-1, experts)
        probs = probs.masked_fill(~score_mask.bool(), 0.0)
    return torch.topk(probs, k=k, dim=-1, sorted=False)[1]


def deepseek_router_normalized(self, hidden_states):
    """DeepseekV2TopkRouter.forward with norm_topk_prob honoured as Marrow (ops/router.h), DeepSeek's code and vLLM
    do: the chosen probabilities divided by their sum, then times routed_scaling_factor (transformers 5 skips the
    division)."""
    import torch
    import torch.nn.functional as F
    hidden_states = hidden_states.view(-1, self.hidden_dim)
    router_logits = F.linear(hidden_states.type(torch.float32), self.weight.type(torch.float32))
    scores = router_logits.softmax(dim=-1, dtype=torch.float32)
    topk_indices = routed_experts(scores, self._marrow_config)
    topk_weights = scores.gather(1, topk_indices)
    topk_weights = topk_weights / topk_weights.sum(dim=-1, keepdim=True)
    return router_logits, topk_weights * self.routed_scaling_factor, topk_indices


def padded_sdpa_attention(module, query, key, value, attention_mask, **kwargs):
    """transformers' SDPA with v zero-padded to q's head dim and the output cropped back (DeepSeek's MLA: q and k 192,
    v 128): equal head dims let torch pick its flash kernel, as transformers' flash_attention integration pads."""
    import torch.nn.functional as F
    from transformers.integrations.sdpa_attention import sdpa_attention_forward
    dv = value.shape[-1]
    if dv != query.shape[-1]:
        value = F.pad(value, [0, query.shape[-1] - dv])
    out, weights = sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)
    return out[..., :dv], weights


def cudnn_sdpa_attention(module, query, key, value, attention_mask, **kwargs):
    """transformers' SDPA held to torch's cuDNN backend (which takes unequal q/k and v head dims on Hopper)."""
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from transformers.integrations.sdpa_attention import sdpa_attention_forward
    with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
        return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)


def register_attention():
    """The attention variants above as attn_implementation names (no mask function: causal, no mask built)."""
    from transformers import AttentionInterface
    AttentionInterface.register("sdpa_padded", padded_sdpa_attention)
    AttentionInterface.register("sdpa_cudnn", cudnn_sdpa_attention)


def load_model(hf_dir, device, attention="sdpa", residual_dtype="float32"):
    """fp32 weights; on the GPU, SDPA attention (or `attention`) and the bf16 grouped experts. DeepSeek-V2 with
    norm_topk_prob: the normalising router. residual_dtype bfloat16: the decoder layers round the residual stream."""
    import types
    import torch
    from transformers import AutoModelForCausalLM
    register_attention()
    model = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32, attn_implementation=attention).to(device)
    if device == "cuda":
        for layer in moe_layers(model):
            if not hasattr(layer.mlp.experts, "gate_up_proj"):
                import transformers
                fail(f"the bf16 grouped experts need transformers 5's fused expert weights (gate_up_proj); this is transformers {transformers.__version__}")
            layer.mlp.experts.forward = types.MethodType(experts_forward_bf16, layer.mlp.experts)
    if is_deepseek(model.config) and model.config.norm_topk_prob:
        for layer in moe_layers(model):
            layer.mlp.gate._marrow_config = model.config
            layer.mlp.gate.forward = types.MethodType(deepseek_router_normalized, layer.mlp.gate)
    if residual_dtype == "bfloat16":
        for layer in model.model.layers:
            if type(layer).__name__ not in DECODER_LAYERS:
                fail(f"--residual-dtype bfloat16 replaces the forward of {' and '.join(DECODER_LAYERS)}; this model has {type(layer).__name__}")
            layer.forward = types.MethodType(decoder_layer_forward_bf16, layer)
    record_router_logits(model)
    return model


def record_router_logits(model):
    """model._router_logits: each MoE layer's router logits of the last forward, taken by a hook on its gate (whose
    output starts with them in every family), since not every transformers 5 release returns them from a
    family's model (5.17's DeepseekV2Model does not)."""
    model._router_logits = []
    for layer in moe_layers(model):
        layer.mlp.gate.register_forward_hook(lambda module, args, output: model._router_logits.append(output[0]))


def head_loss(model, hidden, targets, autocast):
    """The LM head's logits (bf16 under autocast) and their summed cross-entropy in fp32."""
    import torch
    import torch.nn.functional as F
    with torch.autocast("cuda", dtype=torch.bfloat16, enabled=autocast):
        logits = model.lm_head(hidden)
    return F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), targets.reshape(-1), reduction="sum")


HEAD_LOSS = [head_loss]  # bench --compile replaces it with its compiled form


def load_balance_loss(layer_logits, config, sequences):
    """One MoE layer's E * sum_e f_e P_e from its router logits [T, E] (ops/router.h). Qwen3-MoE: the top-k of the
    probabilities over all T tokens. DeepSeek-V2: the router's own choice (routed_experts), and with seq_aux the
    loss of each of the `sequences` rows of T / sequences tokens, averaged (router_statistics_grouped)."""
    import torch
    probs = torch.softmax(layer_logits.float(), dim=-1)
    experts = config.num_experts
    if not is_deepseek(config):
        chosen = torch.topk(probs, config.num_experts_per_tok, dim=-1).indices
        counts = torch.zeros(experts, device=probs.device).scatter_add_(0, chosen.reshape(-1), torch.ones(chosen.numel(), device=probs.device))
        return experts * torch.sum(counts / probs.shape[0] * probs.mean(dim=0))
    groups = sequences if getattr(config, "seq_aux", False) else 1
    chosen = routed_experts(probs, config).reshape(groups, -1)
    probs = probs.reshape(groups, -1, experts)
    counts = torch.zeros(groups, experts, device=probs.device).scatter_add_(1, chosen, torch.ones(chosen.shape, device=probs.device))
    return (experts * torch.sum(counts / probs.shape[1] * probs.mean(dim=1), dim=-1)).mean()


def forward_losses(model, tokens, autocast):
    """Summed cross-entropy over the targets and each MoE layer's load-balance loss E * sum_e f_e P_e."""
    import torch
    inputs, targets = tokens[:, :-1], tokens[:, 1:]
    with torch.autocast("cuda", dtype=torch.bfloat16, enabled=autocast):
        model._router_logits.clear()
        out = model.model(input_ids=inputs, use_cache=False)
    ce = HEAD_LOSS[0](model, out.last_hidden_state, targets, autocast)
    return ce, [load_balance_loss(layer_logits, model.config, tokens.shape[0]) for layer_logits in model._router_logits]


def decayed(name):
    """ParamKind::matrix and table: every 2-D and 3-D weight; norms and Qwen3.5's A_log and dt_bias are not decayed."""
    return not name.endswith(("norm.weight", "A_log", "dt_bias"))


def adamw(params, rc, fused):
    import torch
    groups = [{"params": [p for n, p in params if decayed(n)], "weight_decay": rc["optimizer.weight_decay"]},
              {"params": [p for n, p in params if not decayed(n)], "weight_decay": 0.0}]
    return torch.optim.AdamW(groups, lr=rc["optimizer.lr"], betas=(rc["optimizer.beta1"], rc["optimizer.beta2"]),
                             eps=rc["optimizer.eps"], fused=fused)


def muon_matrices(name, p, split_gate_up):
    """The matrices Marrow's Muon takes of parameter p (TensorSpec::orthogonalized) as a function from a tensor of p's
    shape to views of [rows, cols], or None for AdamW's parameters (embeddings, LM head, router, norms, biases, sinks).
    transformers 5 fuses Qwen3-MoE's and DeepSeek-V2's gate_proj and up_proj per expert ([E, 2I, H], gate first): Marrow
    holds Hugging Face's checkpoint tensors, two matrices an expert; GPT-OSS's interleaved gate_up_proj is one."""
    tables = ("embed_tokens.weight", "lm_head.weight", "mlp.gate.weight", "mlp.router.weight")
    if p.ndim < 2 or name.endswith(tables) or name.endswith("bias"):
        return None
    if p.ndim == 2:
        return lambda t: [t]
    if split_gate_up and name.endswith("gate_up_proj"):
        return lambda t: [half for expert in t for half in expert.chunk(2, dim=0)]
    return lambda t: list(t)


def newton_schulz(u, steps):
    """ops/muon.h's iteration in fp32: X = u / (||u|| + 1e-7), then X = aX + (bA + cAA) X with A = X X^T (tall: transposed)."""
    tall = u.shape[0] > u.shape[1]
    x = u.T if tall else u
    x = x / (x.norm() + 1e-7)
    for _ in range(steps):
        a = x @ x.T
        x = 3.4445 * x + (-4.7750 * a + 2.0315 * (a @ a)) @ x
    return x.T if tall else x


class MuonWithAdamW:
    """optimizer.kind = "muon": per matrix m = beta m + (1 - beta) g, u = (1 - beta) g + beta m, O = newton_schulz(u),
    p = p (1 - lr wd) - lr (scale sqrt(max(rows, cols)) O); AdamW for the other parameters. One lr for both."""

    def __init__(self, model, rc, fused):
        import torch
        split = model.config.model_type != "gpt_oss"
        named = list(model.named_parameters())
        self.muon = [(p, muon_matrices(n, p, split)) for n, p in named if muon_matrices(n, p, split)]
        taken = {id(p) for p, _ in self.muon}
        self.adamw = adamw([(n, p) for n, p in named if id(p) not in taken], rc, fused)
        self.group = {"lr": rc["optimizer.lr"]}
        self.param_groups = self.adamw.param_groups + [self.group]
        self.momentum = [torch.zeros_like(p) for p, _ in self.muon]
        self.beta, self.scale, self.steps = rc["optimizer.muon_momentum"], rc["optimizer.muon_scale"], rc["optimizer.muon_steps"]
        self.weight_decay = rc["optimizer.weight_decay"]

    def step(self):
        import torch
        self.adamw.step()
        lr, beta = self.group["lr"], self.beta
        with torch.no_grad():
            for (p, matrices), m in zip(self.muon, self.momentum):
                m.copy_(beta * m + (1 - beta) * p.grad)
                u = (1 - beta) * p.grad + beta * m
                for pv, uv in zip(matrices(p), matrices(u)):
                    o = newton_schulz(uv, self.steps)
                    pv.copy_(pv * (1 - lr * self.weight_decay) - lr * ((self.scale * max(o.shape) ** 0.5) * o))

    def zero_grad(self, set_to_none=True):
        self.adamw.zero_grad(set_to_none=set_to_none)
        for p, _ in self.muon:
            p.grad = None

    def state_dict(self):
        return {"adamw": self.adamw.state_dict(), "momentum": self.momentum}

    def load_state_dict(self, state):
        self.adamw.load_state_dict(state["adamw"])
        for m, saved in zip(self.momentum, state["momentum"]):
            m.copy_(saved)


def make_optimizer(model, rc, fused):
    if rc["optimizer.kind"] == "muon":
        return MuonWithAdamW(model, rc, fused)
    if rc["optimizer.kind"] != "adamw":
        fail(f"optimizer.kind must be adamw or muon, got {rc['optimizer.kind']}")
    return adamw(list(model.named_parameters()), rc, fused)


def evaluation_loss(model, corpus, rc, device, autocast):
    import torch
    samples, micro = rc["eval.samples"], rc["train.micro_batch"]
    if samples > len(corpus.validation):
        fail(f"the corpus holds {len(corpus.validation)} validation samples but eval.samples is {samples}")
    total = 0.0
    with torch.no_grad():
        for first in range(0, samples, micro):
            windows = corpus.validation[first:min(first + micro, samples)]
            tokens = torch.from_numpy(np.stack([corpus.window(w) for w in windows])).to(device)
            total += forward_losses(model, tokens, autocast)[0].item()
    return total / (samples * rc["train.seq_len"])


def train_step(model, optimizer, corpus, rc, step, device, autocast, aux_coef, fast=False):
    """One optimizer step; returns Marrow's metrics of it (loss without the aux term, load balance, norm, lr).

    The losses are read once, after the last backward. fast (bench): the step's batches go to the GPU
    first, and the gradient norm comes from torch's foreach norms with one host read, the gradients
    scaled only when clipped (clip_grad_norm_ with an infinite bound multiplies them all by 1)."""
    import torch
    G, B, S = rc["train.global_batch"], rc["train.micro_batch"], rc["train.seq_len"]
    micro_batches, layers, k = G // B, len(moe_layers(model)), model.config.num_experts_per_tok
    loss_scale, aux_grad = 1.0 / (G * S), aux_coef / (layers * micro_batches)
    batches = [torch.from_numpy(corpus.micro_batch(step, micro, B, G)) for micro in range(micro_batches)]
    if fast and device == "cuda":
        batches = [b.pin_memory().to(device, non_blocking=True) for b in batches]
    read = []
    for tokens in batches:
        ce, aux = forward_losses(model, tokens.to(device), autocast)
        aux = torch.stack(aux)
        (ce * loss_scale + aux_grad * aux.sum()).backward()
        read.append(torch.cat([ce.detach().reshape(1), aux.detach()]))
    values = torch.stack(read).tolist()
    ce_sum, aux_sum = 0.0, 0.0
    for row in values:
        ce_sum += row[0]
        aux_sum += sum(row[1:])
    clip = rc["optimizer.grad_clip"]
    if fast:
        grads = [p.grad for p in model.parameters() if p.grad is not None]
        grad_norm = torch.linalg.vector_norm(torch.stack(torch._foreach_norm(grads))).item()
        if clip > 0 and grad_norm > clip:
            torch._foreach_mul_(grads, clip / grad_norm)
    else:
        grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), float("inf")).item()
        if clip > 0 and grad_norm > clip:
            for p in model.parameters():
                p.grad.mul_(clip / grad_norm)
    lr = learning_rate(rc, step)
    for group in optimizer.param_groups:
        group["lr"] = lr
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return {"loss": ce_sum * loss_scale, "load_balance": aux_sum / (layers * micro_batches * k), "grad_norm": grad_norm, "lr": lr}


def save(path, model, optimizer, step, residual_dtype):
    import torch
    torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict(), "step": step, "residual_dtype": residual_dtype},
               path + ".tmp")
    os.replace(path + ".tmp", path)


def training_corpus(rc):
    corpus = Corpus(rc["data.path"], rc["train.seq_len"], rc["train.seed"], rc["data.validation_fraction"])
    needed = rc["train.steps"] * rc["train.global_batch"]
    if needed > rc["data.max_epochs"] * len(corpus.train):
        fail(f"the run reads {needed} training samples; the corpus holds {len(corpus.train)} and data.max_epochs is {rc['data.max_epochs']}")
    if rc["train.global_batch"] % rc["train.micro_batch"]:
        fail(f"train.global_batch ({rc['train.global_batch']}) is not a multiple of train.micro_batch ({rc['train.micro_batch']})")
    return corpus


def train(args, rc):
    import torch
    torch.manual_seed(rc["train.seed"])
    device = args.device
    autocast = device == "cuda"
    corpus = training_corpus(rc)
    model = load_model(args.hf_dir, device, residual_dtype=args.residual_dtype)
    optimizer = make_optimizer(model, rc, fused=device == "cuda")
    aux_coef = aux_coefficient(rc, model.config)
    os.makedirs(args.out_dir, exist_ok=True)
    checkpoint, metrics_path = os.path.join(args.out_dir, "reference.pt"), os.path.join(args.out_dir, "metrics.jsonl")
    precision = "bf16 autocast, fp32 master weights" if autocast else "fp32"
    print(f"reference train: {model.config.model_type} on the {device}, {precision}, residual stream {args.residual_dtype}", flush=True)
    first = 1
    if os.path.exists(checkpoint):
        state = torch.load(checkpoint, map_location=device, weights_only=True)
        saved = state.get("residual_dtype", "float32")  # checkpoints from before the option: fp32
        if saved != args.residual_dtype:
            fail(f"{checkpoint} was trained with --residual-dtype {saved}, not {args.residual_dtype}: another <out-dir>, or the same option")
        model.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
        first = state["step"] + 1
        print(f"resumed at step {state['step']} from {checkpoint}", flush=True)
    lines = open(metrics_path).read().splitlines()[:first - 1] if first > 1 else []
    with open(metrics_path, "w") as f:
        f.write("".join(line + "\n" for line in lines))
    tokens_per_step = rc["train.global_batch"] * rc["train.seq_len"]
    start, step = time.time(), first - 1
    for step in range(first, rc["train.steps"] + 1):
        if device == "cuda":
            torch.cuda.synchronize()
        t0 = time.time()
        m = train_step(model, optimizer, corpus, rc, step, device, autocast, aux_coef)
        if device == "cuda":
            torch.cuda.synchronize()
        m.update(step=step, tokens_seen=step * tokens_per_step, tokens_per_s=tokens_per_step / (time.time() - t0))
        if rc["eval.every"] > 0 and (step % rc["eval.every"] == 0 or step == rc["train.steps"]):
            m["val_loss"] = evaluation_loss(model, corpus, rc, device, autocast)
        with open(metrics_path, "a") as f:
            f.write(json.dumps(m) + "\n")
        if step % rc["output.log_every"] == 0 or step == 1 or step == rc["train.steps"]:
            val = f" val {m['val_loss']:.4f}" if "val_loss" in m else ""
            print(f"step {step}/{rc['train.steps']} loss {m['loss']:.4f}{val} lb {m['load_balance']:.3f} "
                  f"norm {m['grad_norm']:.3f} lr {m['lr']:.3g} {m['tokens_per_s']:.0f} tokens/s", flush=True)
        late = args.stop_after_s > 0 and time.time() - start > args.stop_after_s
        if (args.checkpoint_every > 0 and step % args.checkpoint_every == 0) or late:
            save(checkpoint, model, optimizer, step, args.residual_dtype)
        if late:
            print(f"stopped after step {step} ({time.time() - start:.0f} s): run the same command again to go on", flush=True)
            return
    if args.checkpoint_every > 0:
        save(checkpoint, model, optimizer, step, args.residual_dtype)
    if device == "cuda":
        print(f"peak GPU memory {torch.cuda.max_memory_allocated() / 2**30:.2f} GiB", flush=True)


def init(args, rc):
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM
    with open(rc["model.config"]) as f:
        fields = json.load(f)
    config = AutoConfig.for_model(fields.pop("model_type"), **fields)
    torch.manual_seed(rc["train.seed"])
    start = time.time()
    with torch.device(args.init_device):  # the CPU: the default device, as before --init-device
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    drawn = time.time()
    model.save_pretrained(args.hf_dir, max_shard_size=args.shard_size)
    print(f"initial weights ({sum(p.numel() for p in model.parameters()) / 1e6:.1f} M parameters) in {args.hf_dir} "
          f"(drawn on the {args.init_device} in {drawn - start:.1f} s, written in {time.time() - drawn:.1f} s)")


def active_parameters(c):
    """Parameters one token passes through, the LM head included and the embedding not: Marrow's
    num_active_parameters (models/qwen3_moe.cpp, models/deepseek_v2.cpp, models/qwen3_5_moe.cpp)."""
    H, L, V = c.hidden_size, c.num_hidden_layers, c.vocab_size
    if is_deepseek(c):
        Hq, qk = c.num_attention_heads, c.qk_nope_head_dim + c.qk_rope_head_dim
        query = c.q_lora_rank * (H + Hq * qk) if c.q_lora_rank else H * Hq * qk
        attention = (query + H * (c.kv_lora_rank + c.qk_rope_head_dim) + c.kv_lora_rank * Hq * (c.qk_nope_head_dim + c.v_head_dim)
                     + Hq * c.v_head_dim * H)
        moe = c.n_routed_experts * H + 3 * H * (c.num_experts_per_tok * c.moe_intermediate_size + c.moe_intermediate_size * (c.n_shared_experts or 0))
        dense = c.first_k_dense_replace or 0
        return L * attention + dense * 3 * H * c.intermediate_size + (L - dense) * moe + V * H
    if is_qwen3_5(c):
        full = c.layer_types.count("full_attention")
        attention = H * c.head_dim * (3 * c.num_attention_heads + 2 * c.num_key_value_heads)
        kd, vd, hv = c.linear_num_key_heads * c.linear_key_head_dim, c.linear_num_value_heads * c.linear_value_head_dim, c.linear_num_value_heads
        delta = H * (2 * kd + 2 * vd + 2 * hv)
        moe = (c.num_experts + 1) * H + 3 * H * (c.num_experts_per_tok * c.moe_intermediate_size + c.shared_expert_intermediate_size)
        return full * attention + (L - full) * delta + L * moe + V * H
    attention = H * c.head_dim * (2 * c.num_attention_heads + 2 * c.num_key_value_heads)
    return L * (attention + c.num_experts * H + c.num_experts_per_tok * 3 * H * c.moe_intermediate_size) + V * H


def flops_per_token(c, seq):
    """Marrow bench's FLOP count of a training token: 6 x active parameters plus causal attention's, forward and
    backward (S / 2 keys a query): 6 S Hq D a layer for Qwen3-MoE, 3 S Hq (D_qk + D_v) for DeepSeek-V2's MLA; Qwen3.5's
    as models/qwen3_5_moe.h counts them."""
    if is_deepseek(c):
        attention = 3.0 * seq * c.num_attention_heads * (c.qk_nope_head_dim + c.qk_rope_head_dim + c.v_head_dim) * c.num_hidden_layers
    elif is_qwen3_5(c):  # models/qwen3_5_moe.h: the gated attention layers', and the delta rule's per DeltaNet layer
        full = c.layer_types.count("full_attention")
        dk, dv = c.linear_key_head_dim, c.linear_value_head_dim
        delta = 3.0 * c.linear_num_value_heads * (4 * dk * dv + 128 * (dk + dv))
        attention = 6.0 * seq * c.num_attention_heads * c.head_dim * full + delta * (c.num_hidden_layers - full)
    else:
        attention = 6.0 * seq * c.num_attention_heads * c.head_dim * c.num_hidden_layers
    return 6.0 * active_parameters(c) + attention


def compile_model(model):
    """bench --compile layers: each decoder layer (its norms, attention, MLP or router and experts) and the LM head
    with its loss, compiled by torch.compile for the run's fixed shapes."""
    import torch
    for layer in model.model.layers:
        layer.compile(dynamic=False)
    HEAD_LOSS[0] = torch.compile(head_loss, dynamic=False)


def timed_steps(model, optimizer, corpus, rc, steps, device, aux_coef, first=1, quiet=False):
    """Steps first..first + steps - 1 (fast train_step), each timed between GPU synchronisations: (seconds, metrics)."""
    import torch
    times, metrics = [], []
    for step in range(first, first + steps):
        if device == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        m = train_step(model, optimizer, corpus, rc, step, device, device == "cuda", aux_coef, fast=True)
        if device == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
        metrics.append(m)
        if not quiet:
            print(f"step {step} loss {m['loss']:.4f} lb {m['load_balance']:.3f} norm {m['grad_norm']:.3f} lr {m['lr']:.3g} "
                  f"{times[-1] * 1e3:.1f} ms", flush=True)
    return times, metrics


ATTENTION_CANDIDATES = ["sdpa_padded", "sdpa_cudnn", "sdpa"]


def choose_attention(model, corpus, rc, device, aux_coef):
    """bench --attention auto: 1 + 2 steps with each candidate, the fastest kept; then the initial weights again."""
    import torch
    initial = {name: t.detach().to("cpu", copy=True) for name, t in model.state_dict().items()}
    optimizer = make_optimizer(model, rc, fused=device == "cuda")
    best, timings = None, []
    for name in ATTENTION_CANDIDATES:
        try:
            model.set_attn_implementation(name)
            times, _ = timed_steps(model, optimizer, corpus, rc, 3, device, aux_coef, quiet=True)
            ms = 1e3 * sum(times[1:]) / 2
        except Exception as e:  # a backend that refuses these head dims
            print(f"attention {name}: unavailable ({type(e).__name__}: {str(e).splitlines()[0][:160] if str(e) else ''})", flush=True)
            optimizer.zero_grad(set_to_none=True)
            continue
        timings.append(f"{name} {ms:.1f} ms")
        if best is None or ms < best[1]:
            best = (name, ms)
    if best is None:
        fail("no attention implementation of " + ", ".join(ATTENTION_CANDIDATES) + " ran")
    print(f"attention auto: {'; '.join(timings)} per step (2 steps after 1): {best[0]}", flush=True)
    del optimizer
    model.load_state_dict(initial)
    model.set_attn_implementation(best[0])
    if device == "cuda":
        torch.cuda.empty_cache()
    return best[0]


def bench(args, rc):
    import torch
    import transformers
    cuda = args.device == "cuda"
    # marrow bench's run: warm-up + measured + measured / 4 steps timed by stage, the schedule over all of them.
    rc["train.steps"] = args.warmup + args.steps + max(1, args.steps // 4)
    rc["schedule.warmup_steps"] = min(rc["schedule.warmup_steps"], rc["train.steps"])
    torch.manual_seed(rc["train.seed"])
    corpus = training_corpus(rc)
    attention = args.attention or ("auto" if cuda else "sdpa")
    start = time.time()
    model = load_model(args.hf_dir, args.device, "sdpa" if attention == "auto" else attention, args.residual_dtype)
    loaded = time.time() - start
    aux_coef = aux_coefficient(rc, model.config)
    if attention == "auto":
        attention = choose_attention(model, corpus, rc, args.device, aux_coef)
    if args.compile == "layers":
        compile_model(model)
    optimizer = make_optimizer(model, rc, fused=cuda)
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    times, metrics = timed_steps(model, optimizer, corpus, rc, args.warmup + args.steps, args.device, aux_coef)
    ms = 1e3 * sum(times[args.warmup:]) / args.steps
    tokens = rc["train.global_batch"] * rc["train.seq_len"]
    fpt = flops_per_token(model.config, rc["train.seq_len"])
    tflops = fpt * tokens / (ms * 1e-3) / 1e12
    peak = torch.cuda.max_memory_allocated() / 2**30 if cuda else 0.0
    losses = [m["loss"] for m in metrics]
    card = torch.cuda.get_device_name() if cuda else "cpu"
    result = {"tokens_per_s": tokens / (ms * 1e-3), "ms_per_step": ms, "tflops": tflops, "mfu": tflops / args.peak_tflops,
              "peak_gib": peak, "flops_per_token": fpt, "active_parameters": active_parameters(model.config),
              "parameters": sum(p.numel() for p in model.parameters()), "losses": losses,
              "load_balance": [m["load_balance"] for m in metrics], "grad_norms": [m["grad_norm"] for m in metrics],
              "warmup": args.warmup, "steps": args.steps, "attention": attention, "compile": args.compile, "card": card,
              "torch": torch.__version__, "transformers": transformers.__version__, "load_s": loaded, "aux_loss_coef": aux_coef,
              "residual_dtype": args.residual_dtype}
    print(f"torch bench: {args.steps} measured steps after {args.warmup} warm-up | {result['tokens_per_s']:.0f} tokens/s | "
          f"{ms:.1f} ms/step | {tflops:.1f} TFLOP/s | MFU {100 * result['mfu']:.1f}% | peak {peak:.2f} GiB | "
          f"attention {attention}, compile {args.compile}, residual {args.residual_dtype}, torch {torch.__version__}, "
          f"transformers {transformers.__version__}, {card} | losses "
          + json.dumps([round(x, 5) for x in losses]), flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)


def evaluate(args, rc):
    corpus = Corpus(rc["data.path"], rc["train.seq_len"], rc["train.seed"], rc["data.validation_fraction"])
    model = load_model(args.hf_dir, args.device, residual_dtype=args.residual_dtype)
    # The exported weights are bf16 (marrow export --dtype bfloat16): held in fp32 they are the same
    # values, and autocast computes with them in bf16 as Marrow does.
    print(json.dumps({"val_loss": evaluation_loss(model, corpus, rc, args.device, args.device == "cuda"), "samples": rc["eval.samples"]}))


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("command", choices=["init", "train", "eval", "bench"])
    parser.add_argument("run_config")
    parser.add_argument("hf_dir")
    parser.add_argument("out_dir", nargs="?")
    parser.add_argument("--device", default="cuda", choices=["cpu", "cuda"])
    parser.add_argument("--stop-after-s", type=float, default=0)
    parser.add_argument("--checkpoint-every", type=int, default=0)
    parser.add_argument("--init-device", default="cpu", choices=["cpu", "cuda"], help="init: where the weights are drawn")
    parser.add_argument("--shard-size", default="50GB", help="init: save_pretrained's max_shard_size (its default 50GB)")
    parser.add_argument("--warmup", type=int, default=3, help="bench: warm-up steps")
    parser.add_argument("--steps", type=int, default=10, help="bench: measured steps")
    parser.add_argument("--attention", help="bench: auto (the GPU's default), sdpa (the CPU's), sdpa_padded, sdpa_cudnn, eager, ...")
    parser.add_argument("--compile", default="none", choices=["none", "layers"], help="bench: torch.compile")
    parser.add_argument("--peak-tflops", type=float, default=989.0, help="bench: the card's dense bf16 peak for the MFU (H100 SXM, H200)")
    parser.add_argument("--json", help="bench: write the figures and losses here")
    parser.add_argument("--residual-dtype", default="float32", choices=["float32", "bfloat16"],
                        help="train, bench, eval: the residual stream's dtype (the embedding output and each decoder layer's two "
                             "residual sums, their gradients too): float32 (default: autocast's, the weights' dtype) or bfloat16 "
                             "(rounded there as Marrow holds it: issue #52's test of whether precision explains Marrow's higher loss)")
    args, overrides = parser.parse_known_args()
    rc = run_config(args.run_config, overrides)
    if args.command == "train" and not args.out_dir:
        fail("train needs an output directory: reference_run.py train <run-config> <hf-dir> <out-dir>")
    if args.command == "bench" and (args.warmup < 0 or args.steps < 1):
        fail(f"bench needs --warmup >= 0 and --steps >= 1, got {args.warmup} and {args.steps}")
    {"init": init, "train": train, "eval": evaluate, "bench": bench}[args.command](args, rc)


if __name__ == "__main__":
    main()
