#!/usr/bin/env python3
"""An independent trainer for Marrow's Qwen3-MoE runs, in PyTorch and transformers (issue #52).

It trains the model of a Marrow run config the way `marrow train` does, from the same weights on the
same batches, so that the two loss curves can be laid side by side over a long run:
  - weights: a Hugging Face initialisation (`init`, transformers' own _init_weights under a seed),
    which `marrow import` turns into Marrow's starting checkpoint;
  - batches: Marrow's sample order (data/dataset.h) computed here from the corpus: windows of
    seq_len + 1 tokens, the held-out windows spread evenly, a seeded Feistel permutation per epoch;
  - loss: the mean cross-entropy over the step's targets plus aux_loss_coef times the load-balance
    loss E * sum_e f_e * P_e of each layer and micro-batch, averaged (ops/router.h);
  - update: global-norm clipping, torch.optim.AdamW (decay on matrices only, as ParamKind::matrix),
    the learning rate of engine/lr_schedule.h;
  - precision: fp32 weights; on the GPU, bf16 autocast (bf16 compute, fp32 master weights, fp32
    gradients), on the CPU plain fp32 (the CI test against marrow train on the CPU).
It writes metrics.jsonl in Marrow's format, so `marrow plot` draws both runs.

  reference_run.py init <run-config> <hf-dir>                 the initial weights and config.json
  reference_run.py train <run-config> <hf-dir> <out-dir> [--section.key=value ...]
        [--device cpu|cuda] [--stop-after-s S] [--checkpoint-every N]
        resumes from <out-dir>/reference.pt when present; --stop-after-s saves and exits 0 when a step
        ends past S seconds (one device call's limit), the next call goes on
  reference_run.py eval <run-config> <hf-dir> [--device ...]  the mean loss over eval.samples held-out
        sequences of a Hugging Face model (e.g. marrow export of the final checkpoint), printed as JSON
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
    """The experts of a Qwen3-MoE layer as grouped bf16 GEMMs (torch's grouped_mm, CUTLASS on Hopper).

    transformers' own grouped_mm path casts the input to the weights' dtype, so under autocast with
    fp32 weights it would multiply in fp32; this one casts the weights to bf16 as autocast does for
    every linear layer (the gradient still reaches the fp32 weights in fp32)."""
    import torch
    import torch.nn.functional as F
    grouped_mm = getattr(F, "grouped_mm", None) or torch._grouped_mm
    k = top_k_index.shape[-1]
    chosen = top_k_index.reshape(-1)
    order = torch.argsort(chosen, stable=True)
    offsets = torch.cumsum(torch.bincount(chosen, minlength=self.num_experts), 0, dtype=torch.int32)
    rows = order // k
    x = hidden_states[rows].to(torch.bfloat16)
    gate, up = grouped_mm(x, self.gate_up_proj.to(torch.bfloat16).transpose(-2, -1), offs=offsets).chunk(2, dim=-1)
    y = grouped_mm(F.silu(gate) * up, self.down_proj.to(torch.bfloat16).transpose(-2, -1), offs=offsets)
    y = y * top_k_weights.reshape(-1)[order, None].to(y.dtype)
    return torch.zeros(hidden_states.shape, dtype=y.dtype, device=y.device).index_add_(0, rows, y).to(hidden_states.dtype)


def load_model(hf_dir, device):
    """fp32 weights; on the GPU, SDPA attention and the bf16 grouped experts."""
    import types
    import torch
    from transformers import AutoModelForCausalLM
    model = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32, attn_implementation="sdpa").to(device)
    if device == "cuda":
        for layer in model.model.layers:
            layer.mlp.experts.forward = types.MethodType(experts_forward_bf16, layer.mlp.experts)
    return model


def forward_losses(model, tokens, autocast):
    """Summed cross-entropy over the targets and each layer's load-balance loss E * sum_e f_e P_e."""
    import torch
    import torch.nn.functional as F
    inputs, targets = tokens[:, :-1], tokens[:, 1:]
    with torch.autocast("cuda", dtype=torch.bfloat16, enabled=autocast):
        out = model.model(input_ids=inputs, output_router_logits=True)
        logits = model.lm_head(out.last_hidden_state)
    ce = F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), targets.reshape(-1), reduction="sum")
    k, experts = model.config.num_experts_per_tok, model.config.num_experts
    aux = []
    for layer_logits in out.router_logits:
        probs = torch.softmax(layer_logits.float(), dim=-1)
        chosen = torch.topk(probs, k, dim=-1).indices
        counts = torch.zeros(experts, device=probs.device).scatter_add_(0, chosen.reshape(-1), torch.ones(chosen.numel(), device=probs.device))
        tokens_count = probs.shape[0]
        aux.append(experts * torch.sum(counts / tokens_count * probs.mean(dim=0)))
    return ce, aux


def decayed(name):
    """ParamKind::matrix: every 2-D and 3-D weight; norms are not decayed."""
    return not name.endswith("norm.weight")


def make_optimizer(model, rc, fused):
    import torch
    params = list(model.named_parameters())
    groups = [{"params": [p for n, p in params if decayed(n)], "weight_decay": rc["optimizer.weight_decay"]},
              {"params": [p for n, p in params if not decayed(n)], "weight_decay": 0.0}]
    return torch.optim.AdamW(groups, lr=rc["optimizer.lr"], betas=(rc["optimizer.beta1"], rc["optimizer.beta2"]),
                             eps=rc["optimizer.eps"], fused=fused)


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


def train_step(model, optimizer, corpus, rc, step, device, autocast, aux_coef):
    """One optimizer step; returns Marrow's metrics of it (loss without the aux term, load balance, norm, lr)."""
    import torch
    G, B, S = rc["train.global_batch"], rc["train.micro_batch"], rc["train.seq_len"]
    micro_batches, layers, k = G // B, model.config.num_hidden_layers, model.config.num_experts_per_tok
    loss_scale, aux_grad = 1.0 / (G * S), aux_coef / (layers * micro_batches)
    ce_sum, aux_sum = 0.0, 0.0
    for micro in range(micro_batches):
        tokens = torch.from_numpy(corpus.micro_batch(step, micro, B, G)).to(device)
        ce, aux = forward_losses(model, tokens, autocast)
        (ce * loss_scale + aux_grad * torch.stack(aux).sum()).backward()
        ce_sum += ce.item()
        aux_sum += sum(a.item() for a in aux)
    grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), float("inf")).item()
    clip = rc["optimizer.grad_clip"]
    if clip > 0 and grad_norm > clip:
        for p in model.parameters():
            p.grad.mul_(clip / grad_norm)
    lr = learning_rate(rc, step)
    for group in optimizer.param_groups:
        group["lr"] = lr
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return {"loss": ce_sum * loss_scale, "load_balance": aux_sum / (layers * micro_batches * k), "grad_norm": grad_norm, "lr": lr}


def save(path, model, optimizer, step):
    import torch
    torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict(), "step": step}, path + ".tmp")
    os.replace(path + ".tmp", path)


def train(args, rc):
    import torch
    torch.manual_seed(rc["train.seed"])
    device = args.device
    autocast = device == "cuda"
    corpus = Corpus(rc["data.path"], rc["train.seq_len"], rc["train.seed"], rc["data.validation_fraction"])
    needed = rc["train.steps"] * rc["train.global_batch"]
    if needed > rc["data.max_epochs"] * len(corpus.train):
        fail(f"the run reads {needed} training samples; the corpus holds {len(corpus.train)} and data.max_epochs is {rc['data.max_epochs']}")
    if rc["train.global_batch"] % rc["train.micro_batch"]:
        fail(f"train.global_batch ({rc['train.global_batch']}) is not a multiple of train.micro_batch ({rc['train.micro_batch']})")
    model = load_model(args.hf_dir, device)
    optimizer = make_optimizer(model, rc, fused=device == "cuda")
    aux_coef = rc["train.aux_loss_coef"] if rc["train.aux_loss_coef"] >= 0 else model.config.router_aux_loss_coef
    os.makedirs(args.out_dir, exist_ok=True)
    checkpoint, metrics_path = os.path.join(args.out_dir, "reference.pt"), os.path.join(args.out_dir, "metrics.jsonl")
    first = 1
    if os.path.exists(checkpoint):
        state = torch.load(checkpoint, map_location=device, weights_only=True)
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
            save(checkpoint, model, optimizer, step)
        if late:
            print(f"stopped after step {step} ({time.time() - start:.0f} s): run the same command again to go on", flush=True)
            return
    if args.checkpoint_every > 0:
        save(checkpoint, model, optimizer, step)
    if device == "cuda":
        print(f"peak GPU memory {torch.cuda.max_memory_allocated() / 2**30:.2f} GiB", flush=True)


def init(args, rc):
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM
    with open(rc["model.config"]) as f:
        fields = json.load(f)
    config = AutoConfig.for_model(fields.pop("model_type"), **fields)
    torch.manual_seed(rc["train.seed"])
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.save_pretrained(args.hf_dir)
    print(f"initial weights ({sum(p.numel() for p in model.parameters()) / 1e6:.1f} M parameters) in {args.hf_dir}")


def evaluate(args, rc):
    corpus = Corpus(rc["data.path"], rc["train.seq_len"], rc["train.seed"], rc["data.validation_fraction"])
    model = load_model(args.hf_dir, args.device)
    # The exported weights are bf16 (marrow export --dtype bfloat16): held in fp32 they are the same
    # values, and autocast computes with them in bf16 as Marrow does.
    print(json.dumps({"val_loss": evaluation_loss(model, corpus, rc, args.device, args.device == "cuda"), "samples": rc["eval.samples"]}))


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("command", choices=["init", "train", "eval"])
    parser.add_argument("run_config")
    parser.add_argument("hf_dir")
    parser.add_argument("out_dir", nargs="?")
    parser.add_argument("--device", default="cuda", choices=["cpu", "cuda"])
    parser.add_argument("--stop-after-s", type=float, default=0)
    parser.add_argument("--checkpoint-every", type=int, default=0)
    args, overrides = parser.parse_known_args()
    rc = run_config(args.run_config, overrides)
    if args.command == "train" and not args.out_dir:
        fail("train needs an output directory: reference_run.py train <run-config> <hf-dir> <out-dir>")
    {"init": init, "train": train, "eval": evaluate}[args.command](args, rc)


if __name__ == "__main__":
    main()
