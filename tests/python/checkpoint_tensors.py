"""Checkpoints as whole tensors, for the tests that compare layouts (test_parallel, test_gpt_oss_train)."""
import json
import os

import torch
from safetensors.torch import load_file


def checkpoint_tensors(step_dir):
    """Every (group, name) of a checkpoint as a whole tensor, slices assembled by meta.json's offsets;
    each element must be written exactly once."""
    meta = json.load(open(os.path.join(step_dir, "meta.json")))
    tensors, written = {}, {}
    for entry in meta["files"]:
        if not entry["file"].endswith(".safetensors"):
            continue
        slices = entry.get("slices", {})
        for name, t in load_file(os.path.join(step_dir, entry["file"])).items():
            key = (entry["group"], name)
            if name not in slices:
                assert key not in tensors, f"{key} is in two files of {step_dir}"
                tensors[key], written[key] = t, torch.ones(t.numel(), dtype=torch.int32)
                continue
            s = slices[name]
            if key not in tensors:
                tensors[key] = torch.zeros(s["shape"], dtype=t.dtype)
                written[key] = torch.zeros(tensors[key].numel(), dtype=torch.int32)
            tensors[key].view(-1)[s["first"]:s["first"] + s["count"]] = t
            written[key][s["first"]:s["first"] + s["count"]] += 1
    for key, count in written.items():
        assert bool((count == 1).all()), f"{key}: elements written {int(count.min())} to {int(count.max())} times in {step_dir}"
    return tensors


def relative_error(a, b, floor=1e-30):
    """The largest difference relative to the larger tensor's largest element (at least floor)."""
    return (a - b).abs().max().item() / max(a.abs().max().item(), b.abs().max().item(), floor)
