"""deepspeed.utils.zero_to_fp32's functions, for DeepSpeed's checkpoints and ours (which carry
DeepSpeed's files too, checkpoint_ds.py), without the deepspeed package.

    sd = get_fp32_state_dict_from_zero_checkpoint("ckpt")          # {name: fp32 tensor}, buffers included
    model = load_state_dict_from_zero_checkpoint(model, "ckpt")    # model.cpu() with those weights
    convert_zero_checkpoint_to_fp32_state_dict("ckpt", "out/")     # out/pytorch_model.bin

As DeepSpeed 0.19.8: the fp32 master of every trained parameter, the buffers (floating ones as
fp32), the frozen parameters unless exclude_frozen_parameters, shared parameters under every name.
lazy_mode returns ordinary tensors (DeepSpeed's pseudo tensors are read with .contiguous(), which a
tensor has too). A folder of ours without DeepSpeed's files (model-parallel saves) is read with
checkpoint_read.consolidate. Cost: every rank's files read once (O(Ψ) memory), no processes.
"""
from __future__ import annotations

import glob
import math
import os
import re

import torch

from zero_from_scratch.engine.atomic import atomic_write
from zero_from_scratch.engine.checkpoint_ds import rank_of, load_file, read_full, tag_folder
from zero_from_scratch.engine.checkpoint_read import CheckpointError, consolidate


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
        n = len(optim)
        files = sorted(glob.glob(os.path.join(d, "zero_pp_rank_*_mp_rank_00_model_states.pt")), key=rank_of)
        z3 = int(optim[0]["zero_stage"]) == 3 and len(files) == n
        frags = [load_file(f)["frozen_param_fragments"] for f in files] if z3 else None
        for name, shape in (model.get("frozen_param_shapes") or {}).items():
            t = torch.cat([f[name] for f in frags])[:math.prod(shape)] if z3 else model["frozen_param_fragments"][name]
            sd[name] = t.reshape(shape).float()
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


_UNITS = {"KB": 10 ** 3, "MB": 10 ** 6, "GB": 10 ** 9, "TB": 10 ** 12, "KIB": 2 ** 10, "MIB": 2 ** 20, "GIB": 2 ** 30}


def _bytes(size) -> int:
    if isinstance(size, int):
        return size
    m = re.fullmatch(r"\s*([\d.]+)\s*([KMGT]I?B)\s*", str(size).upper())
    if not m:
        raise ValueError(f"max_shard_size = {size!r} is invalid; allowed: an int of bytes or e.g. '5GB'")
    return int(float(m.group(1)) * _UNITS[m.group(2)])


def convert_zero_checkpoint_to_state_dict(checkpoint_dir, output_dir, dtype=torch.float32, max_shard_size="5GB",
                                          safe_serialization=False, tag=None, exclude_frozen_parameters=False) -> None:
    """One file in output_dir: pytorch_model.bin (model.safetensors with safe_serialization). A state
    dict larger than max_shard_size is refused: DeepSpeed would write shards and an index file."""
    dtype = {"float32": torch.float32, "fp32": torch.float32, "float16": torch.float16, "fp16": torch.float16,
             "bfloat16": torch.bfloat16, "bf16": torch.bfloat16}.get(dtype, dtype) if isinstance(dtype, str) else dtype
    sd = get_fp32_state_dict_from_zero_checkpoint(checkpoint_dir, tag, exclude_frozen_parameters)
    sd = {k: (v.to(dtype) if v.is_floating_point() else v).contiguous() for k, v in sd.items()}
    total = sum(v.numel() * v.element_size() for v in sd.values())
    if max_shard_size is not None and total > _bytes(max_shard_size):
        raise NotImplementedError(f"the state dict has {total} bytes > max_shard_size {max_shard_size!r}: sharded "
                                  "output is not implemented here; DeepSpeed would split it into shards with an index "
                                  "file. Pass max_shard_size=None for one file")
    os.makedirs(output_dir, exist_ok=True)
    if safe_serialization:
        from safetensors.torch import save_file   # optional dependency, as in DeepSpeed
        save_file(sd, os.path.join(output_dir, "model.safetensors"), metadata={"format": "pt"})
    else:
        atomic_write(os.path.join(output_dir, "pytorch_model.bin"), lambda f: torch.save(sd, f))


def convert_zero_checkpoint_to_fp32_state_dict(checkpoint_dir, output_dir, max_shard_size="5GB",
                                               safe_serialization=False, tag=None, exclude_frozen_parameters=False):
    return convert_zero_checkpoint_to_state_dict(checkpoint_dir, output_dir, torch.float32, max_shard_size,
                                                 safe_serialization, tag, exclude_frozen_parameters)


__all__ = ["get_fp32_state_dict_from_zero_checkpoint", "load_state_dict_from_zero_checkpoint",
           "convert_zero_checkpoint_to_state_dict", "convert_zero_checkpoint_to_fp32_state_dict", "CheckpointError"]
