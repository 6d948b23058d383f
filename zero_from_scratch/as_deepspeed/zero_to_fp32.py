"""deepspeed.utils.zero_to_fp32's functions over ringzero's checkpoints (zero_from_scratch.consolidate).

    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint   (under the runner)
    sd = get_fp32_state_dict_from_zero_checkpoint("ckpt")            # tag from ckpt/latest
    convert_zero_checkpoint_to_fp32_state_dict("ckpt", "out")        # out/pytorch_model.bin
    model = load_state_dict_from_zero_checkpoint(model, "ckpt")      # model.cpu(), loaded, strict=False

As deepspeed/utils/zero_to_fp32.py (0.19.8): the fp32 state_dict of a ZeRO checkpoint (the fp32
master in mixed precision); convert writes it as pytorch_model.bin (model.safetensors with
safe_serialization), split into shards of at most max_shard_size with huggingface_hub's
split_torch_state_dict_into_shards plus an index file, as DeepSpeed does; load puts the model on
the CPU and loads the state_dict non-strictly. The checkpoint read is ringzero's
(engine.save_checkpoint's files); lazy_mode and exclude_frozen_parameters=True are refused.
Cost: every shard file read once, O(Ψ) memory.
"""
from __future__ import annotations

import json
import os
from collections import OrderedDict

import torch

from zero_from_scratch import consolidate
from zero_from_scratch.as_deepspeed.finder import NotServedError, message
from zero_from_scratch.as_deepspeed.utils import logger

__all__ = ["get_fp32_state_dict_from_zero_checkpoint", "convert_zero_checkpoint_to_fp32_state_dict",
           "load_state_dict_from_zero_checkpoint"]


def get_fp32_state_dict_from_zero_checkpoint(checkpoint_dir, tag=None, exclude_frozen_parameters=False,
                                             lazy_mode=False) -> OrderedDict:
    if lazy_mode:
        raise NotServedError(message("get_fp32_state_dict_from_zero_checkpoint(lazy_mode=True)",
                                     "return tensors read from disk on first use", "lazy_mode=False"))
    if exclude_frozen_parameters:
        raise NotServedError(message("get_fp32_state_dict_from_zero_checkpoint(exclude_frozen_parameters=True)",
                                     "leave out parameters with requires_grad=False",
                                     "filter the returned state_dict by the model's requires_grad"))
    return OrderedDict((k, v.float() if v.is_floating_point() else v)
                       for k, v in consolidate(str(checkpoint_dir), tag).items())


def convert_zero_checkpoint_to_fp32_state_dict(checkpoint_dir, output_dir, max_shard_size="5GB",
                                               safe_serialization=False, tag=None, exclude_frozen_parameters=False):
    sd = get_fp32_state_dict_from_zero_checkpoint(checkpoint_dir, tag, exclude_frozen_parameters)
    weights = "model.safetensors" if safe_serialization else "pytorch_model.bin"
    files = {weights: list(sd)}
    split = None
    if max_shard_size is not None:
        from huggingface_hub import split_torch_state_dict_into_shards   # DeepSpeed's own splitter, only here
        pattern = weights.replace(".bin", "{suffix}.bin").replace(".safetensors", "{suffix}.safetensors")
        split = split_torch_state_dict_into_shards(sd, filename_pattern=pattern, max_shard_size=max_shard_size)
        files = split.filename_to_tensors
    os.makedirs(output_dir, exist_ok=True)
    for name, keys in files.items():
        shard = {k: sd[k].contiguous() for k in keys}
        if safe_serialization:
            from safetensors.torch import save_file   # as DeepSpeed: only when asked for safetensors
            save_file(shard, os.path.join(output_dir, name), metadata={"format": "pt"})
        else:
            torch.save(shard, os.path.join(output_dir, name))
    if split is not None and split.is_sharded:
        index = {"metadata": split.metadata, "weight_map": split.tensor_to_filename}
        with open(os.path.join(output_dir, f"{weights}.index.json"), "w", encoding="utf-8") as f:
            f.write(json.dumps(index, indent=2, sort_keys=True) + "\n")


def load_state_dict_from_zero_checkpoint(model, checkpoint_dir, tag=None):
    logger.info("Extracting fp32 weights")
    sd = get_fp32_state_dict_from_zero_checkpoint(checkpoint_dir, tag)
    logger.info("Overwriting model with fp32 weights")
    model = model.cpu()
    model.load_state_dict(sd, strict=False)
    return model
