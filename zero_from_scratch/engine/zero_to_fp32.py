"""deepspeed.utils.zero_to_fp32's functions and script, for DeepSpeed's checkpoints and ours (which
carry DeepSpeed's files too, checkpoint_ds.py), without the deepspeed package.

    python -m zero_from_scratch.engine.zero_to_fp32 CKPT_DIR OUT.pt [--tag global_step10]
    sd = get_fp32_state_dict_from_zero_checkpoint("ckpt")          # {name: fp32 tensor}, buffers included
    model = load_state_dict_from_zero_checkpoint(model, "ckpt")    # model.cpu() with those weights
    convert_zero_checkpoint_to_fp32_state_dict("ckpt", "out/")     # out/pytorch_model.bin

As DeepSpeed 0.19.8: every trained parameter's fp32 master, the buffers (floating ones as fp32), the
frozen parameters unless exclude_frozen_parameters, shared parameters under every name; lazy_mode
returns ordinary tensors. A folder of ours without DeepSpeed's files (model-parallel saves) is read
with checkpoint_read.consolidate. Cost: every rank's files read once (O(Ψ) memory), no processes.
"""
from __future__ import annotations

import argparse
import glob
import json
import os
import sys

import torch

from zero_from_scratch.engine.atomic import atomic_write
from zero_from_scratch.engine.checkpoint_ds import frozen_params, read_full
from zero_from_scratch.engine.checkpoint_read import CheckpointError, consolidate, tag_folder


def get_fp32_state_dict_from_zero_checkpoint(checkpoint_dir, tag=None, exclude_frozen_parameters=False,
                                             lazy_mode=False) -> dict:
    d = tag_folder(checkpoint_dir, tag)
    if not glob.glob(os.path.join(d, "*_optim_states.pt")):
        if exclude_frozen_parameters:
            raise NotImplementedError(f"{d} has no DeepSpeed files (a model-parallel save of ours): "
                                      "exclude_frozen_parameters is not implemented for it; DeepSpeed would drop the "
                                      "frozen parameters. Use checkpoint_read.consolidate and drop them yourself")
        return consolidate(checkpoint_dir, tag)
    full, model, optim = read_full(d)
    buffers = set(model.get("buffer_names", []))
    sd = {k: (v.float() if v.is_floating_point() else v) for k, v in model["module"].items() if k in buffers}
    if not exclude_frozen_parameters:
        sd.update({k: v.float() for k, v in frozen_params(d, model, optim).items()})
    for name, v in full.items():
        sd[name] = v["master"].float()
    for alias, canon in (model.get("shared_params") or {}).items():
        if canon in sd:
            sd[alias] = sd[canon]
    return sd


def load_state_dict_from_zero_checkpoint(model: torch.nn.Module, checkpoint_dir, tag=None) -> torch.nn.Module:
    """DeepSpeed's: the model moved to the CPU, with the checkpoint's fp32 weights (strict=False)."""
    sd = get_fp32_state_dict_from_zero_checkpoint(checkpoint_dir, tag)
    model = model.cpu()
    model.load_state_dict(sd, strict=False)
    return model


def convert_zero_checkpoint_to_state_dict(checkpoint_dir, output_dir, dtype=torch.float32, max_shard_size="5GB",
                                          safe_serialization=False, tag=None, exclude_frozen_parameters=False) -> None:
    """output_dir/pytorch_model.bin (model.safetensors with safe_serialization); larger than
    max_shard_size: shards split by huggingface_hub's split_torch_state_dict_into_shards plus an
    index file, as DeepSpeed writes them."""
    dtype = {"float32": torch.float32, "fp32": torch.float32, "float16": torch.float16, "fp16": torch.float16,
             "bfloat16": torch.bfloat16, "bf16": torch.bfloat16}.get(dtype, dtype) if isinstance(dtype, str) else dtype
    sd = get_fp32_state_dict_from_zero_checkpoint(checkpoint_dir, tag, exclude_frozen_parameters)
    # own storage per tensor: views of one flat master would all land in one shard (the splitter groups by storage);
    # a shared parameter's names keep one tensor, as DeepSpeed's: tied in .bin files; with safe_serialization
    # safetensors' save_file refuses it ("Some tensors share memory"), DeepSpeed 0.19.8's outcome too
    copies: dict[int, torch.Tensor] = {}
    out = {}
    for k, v in sd.items():
        if id(v) not in copies:
            copies[id(v)] = v.to(dtype, copy=True) if v.is_floating_point() else v.clone()
        out[k] = copies[id(v)]
    sd = out
    weights = "model.safetensors" if safe_serialization else "pytorch_model.bin"
    files, split = {weights: list(sd)}, None
    if max_shard_size is not None:
        from huggingface_hub import split_torch_state_dict_into_shards   # DeepSpeed's own splitter, only here
        pattern = weights.replace(".bin", "{suffix}.bin").replace(".safetensors", "{suffix}.safetensors")
        split = split_torch_state_dict_into_shards(sd, filename_pattern=pattern, max_shard_size=max_shard_size)
        files = split.filename_to_tensors
    os.makedirs(output_dir, exist_ok=True)
    for name, keys in files.items():
        shard = {k: sd[k] for k in keys}
        if safe_serialization:
            from safetensors.torch import save_file   # optional dependency, as in DeepSpeed
            save_file(shard, os.path.join(output_dir, name), metadata={"format": "pt"})
        else:
            atomic_write(os.path.join(output_dir, name), lambda f, shard=shard: torch.save(shard, f))
    if split is not None and split.is_sharded:
        index = {"metadata": split.metadata, "weight_map": split.tensor_to_filename}
        atomic_write(os.path.join(output_dir, f"{weights}.index.json"),
                     lambda f: f.write((json.dumps(index, indent=2, sort_keys=True) + "\n").encode()))


def convert_zero_checkpoint_to_fp32_state_dict(checkpoint_dir, output_dir, max_shard_size="5GB",
                                               safe_serialization=False, tag=None, exclude_frozen_parameters=False):
    return convert_zero_checkpoint_to_state_dict(checkpoint_dir, output_dir, torch.float32, max_shard_size,
                                                 safe_serialization, tag, exclude_frozen_parameters)


__all__ = ["get_fp32_state_dict_from_zero_checkpoint", "load_state_dict_from_zero_checkpoint",
           "convert_zero_checkpoint_to_state_dict", "convert_zero_checkpoint_to_fp32_state_dict", "CheckpointError"]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description="one full fp32 state_dict from a ZeRO checkpoint (ours or DeepSpeed's)")
    ap.add_argument("checkpoint_dir")
    ap.add_argument("output_file")
    ap.add_argument("--tag", default=None, help="default: the tag in CHECKPOINT_DIR/latest")
    a = ap.parse_args(argv)
    try:
        sd = get_fp32_state_dict_from_zero_checkpoint(a.checkpoint_dir, a.tag)
    except CheckpointError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    atomic_write(a.output_file, lambda f: torch.save(sd, f))
    n = sum(v.numel() for k, v in sd.items() if v.is_floating_point())
    print(f"wrote {a.output_file}: {len(sd)} tensors, {n:,} floating-point elements")
    return 0


if __name__ == "__main__":
    sys.exit(main())
