"""deepspeed.checkpoint.ds_to_universal served by ringzero: a ZeRO checkpoint folder → DeepSpeed's universal one.

    python -m zero_from_scratch.as_deepspeed.ds_to_universal --input_folder ckpt/global_step3 \\
        --output_folder ckpt/global_step3_universal [--inject_missing_state]
    from deepspeed.checkpoint.ds_to_universal import main; main(args)      # under the runner, DeepSpeed's flags

Reads a ZeRO-1/2/3 folder in DeepSpeed 0.19.8's layout (what DeepSpeed writes, and what ringzero writes next
to its own files: checkpoint_ds.py) and writes DeepSpeed's universal layout (checkpoint_universal_layout.py):
every parameter's full fp32 value, Adam moments and (ZeRO-1/2) step, zero/optimizer_state.pt, copies of the
model-states files and `latest_universal` beside the output folder. The files equal, tensor for tensor, those
real DeepSpeed's converter writes (tests/test_checkpoint_universal.py). A DeepSpeed user then resumes at any
world size with "checkpoint": {"load_universal": true} (engine/checkpoint_universal.py).
What differs from DeepSpeed: its converter cuts every rank's partition into per-parameter fragment files under
<output>/tmp in worker processes, then merges them; here the full tensors come from checkpoint_ds.read_full in
this one process (the reader ringzero's load_checkpoint uses), so --num_extract_workers / --num_merge_workers
and --keep_temp_folder have nothing to act on and say so. Refused, one line each: tensor-parallel (AutoTP /
Megatron) slices, pipeline layer files, expert (MoE / AutoEP) files — DeepSpeed would merge them by the
checkpoint's pattern lists; ringzero refuses AutoTP and MoE training, so it writes no such folder.
Cost: every optimizer file is read once (O(Ψ) memory, the whole model's fp32 state), 3 files per parameter
written (4 at ZeRO-1/2).
"""
from __future__ import annotations

import argparse
import glob
import os
import re
import shutil

import torch

from zero_from_scratch.engine.checkpoint_ds import _DS_PICKLE, read_full
from zero_from_scratch.engine.checkpoint_universal_layout import (CAT_DIM, LATEST, PARAM, STATES, TP_PATTERNS, UC_INFO,
                                                                  UC_KEYS, param_file, read_keeping)

__all__ = ["main", "parse_arguments", "dp_index_to_str", "_aggregate_autoep_zero12_metadata",
           "_validate_autotp_conversion_support"]

_SHARDED = ("base_optimizer_state", "param_slice_mappings", "single_partition_of_fp32_groups")
_NOT_SERVED = ("ringzero serves ds_to_universal for data-parallel ZeRO folders only; ringzero refuses AutoTP, "
               "pipeline and MoE training, so it never writes")


def parse_arguments(argv=None):
    """DeepSpeed's flags, names and defaults (ds_to_universal.py parse_arguments)."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--input_folder", type=str, required=True, help="Input DeepSpeed Checkpoint folder")
    ap.add_argument("--output_folder", type=str, required=True, help="Output DeepSpeed checkpoint folder")
    ap.add_argument("--num_extract_workers", default=4, type=int,
                    help="DeepSpeed's extraction processes; ringzero reads in this one process (same files)")
    ap.add_argument("--num_merge_workers", default=2, type=int,
                    help="DeepSpeed's merge processes; ringzero merges in this one process (same files)")
    ap.add_argument("--keep_temp_folder", action="store_true",
                    help="DeepSpeed keeps its per-fragment temp files; ringzero writes none")
    ap.add_argument("--no_strict", dest="strict", action="store_false",
                    help="Do not perform validity checks on converted checkpoint.")
    ap.add_argument("--inject_missing_state", action="store_true",
                    help="Inject missing checkpoint state into the checkpoint if it is absent.")
    args = ap.parse_args(argv)
    print(f"args = {args}")
    return args


def dp_index_to_str(dp_index: int) -> str:
    """DeepSpeed's two-digit rank suffix (its engine imports this name for offload folders)."""
    return f"{dp_index:0>2d}"


def _aggregate_autoep_zero12_metadata(model_state_metadata):
    """DeepSpeed's check of DeepSpeedCheckpoint.model_state_metadata ([(model file, {param_shapes: {name: shape},
    ds_autoep_layers, ds_config}), ...]) before a ZeRO-1/2 conversion: (per-file param shapes, the AutoEP layer
    entries merged by expert_key_prefix or None, use_data_before_expert_parallelism), DeepSpeed's RuntimeError
    for a malformed entry. ringzero writes no AutoEP layers (it refuses MoE), so its folders give None."""
    shapes, by_prefix, source, ordering = [], {}, {}, {}
    for path, meta in model_state_metadata:
        if not isinstance(meta["param_shapes"], dict):
            raise RuntimeError(f"DeepSpeed checkpoint param_shapes must contain dictionaries in {path}.")
        shapes.append(meta["param_shapes"])
        layers = meta["ds_autoep_layers"]
        if layers is not None and not isinstance(layers, list):
            raise RuntimeError(f"AutoEP metadata must be a list in {path}.")
        for layer in layers or ():
            if not isinstance(layer, dict):
                raise RuntimeError(f"AutoEP layer metadata must contain dictionaries in {path}.")
            prefix = layer.get("expert_key_prefix")
            if not isinstance(prefix, str) or not prefix:
                raise RuntimeError(f"AutoEP expert_key_prefix must be a non-empty string in {path}.")
            if by_prefix.setdefault(prefix, layer) != layer:
                raise RuntimeError(f"Conflicting AutoEP metadata for expert_key_prefix {prefix!r} in "
                                   f"{source[prefix]} and {path}.")
            source.setdefault(prefix, path)
        cfg = meta["ds_config"]
        if not isinstance(cfg, dict):
            raise RuntimeError(f"DeepSpeed checkpoint ds_config must be a dictionary in {path}.")
        ordering[path] = cfg.get("use_data_before_expert_parallelism", False)
        if not isinstance(ordering[path], bool):
            raise RuntimeError(f"DeepSpeed checkpoint use_data_before_expert_parallelism must be a boolean in {path}.")
    if len(set(ordering.values())) != 1:
        raise RuntimeError("DeepSpeed checkpoint use_data_before_expert_parallelism disagrees across model-state "
                           f"files: {ordering}")
    return shapes, list(by_prefix.values()) or None, next(iter(ordering.values()))


def _refuse_unserved(folder: str) -> None:
    names = [os.path.basename(f) for f in glob.glob(os.path.join(folder, "*_model_states.pt"))]
    tp = [n for n in names if re.search(r"mp_rank_(\d+)", n) and int(re.search(r"mp_rank_(\d+)", n).group(1)) > 0]
    if tp:
        raise NotImplementedError(f"ds_to_universal of tensor-parallel slices: DeepSpeed would merge them "
                                  f"(merge_tp_slices); {_NOT_SERVED} tensor-parallel checkpoints ({tp[0]} in {folder})")
    if any(n.startswith("layer_") for n in names) or glob.glob(os.path.join(folder, "layer_*")):
        raise NotImplementedError(f"ds_to_universal of pipeline or expert layer files (layer_*): DeepSpeed would merge "
                                  f"them per stage / expert; {_NOT_SERVED} such a folder ({folder})")


def _validate_autotp_conversion_support(info: dict) -> None:
    """DeepSpeed's ValueError for parameters its AutoTP marked unconvertible (a checkpoint's own record)."""
    bad = info.get(UC_KEYS["AUTOTP_UNSUPPORTED_PARAMETER_PATTERNS"], {})
    if bad:
        details = ", ".join(f"{p}: {why}" for p, why in sorted(bad.items()))
        raise ValueError(f"AutoTP universal checkpoint conversion is not supported for {details}.")


def _check_uc_info(model: dict, args) -> None:
    """ZeRO-1/2: DeepSpeed's _check_for_required_state (after --inject_missing_state), its AutoTP check, and
    pattern lists, which only a tensor-parallel merge reads."""
    info = model.get(UC_INFO)
    if info is None and getattr(args, "inject_missing_state", False):
        info = {UC_KEYS["UNIVERSAL_CHECKPOINT_VERSION_KEY"]: UC_KEYS["UNIVERSAL_CHECKPOINT_VERSION_VALUE"]}
    assert info is not None, (f"Required {UC_INFO} state is missing in checkpoint. Verify that client creates this "
                              "state.")
    _validate_autotp_conversion_support(info)
    used = [k for k in TP_PATTERNS if info.get(k)]
    if used:
        raise NotImplementedError(f"{UC_INFO} sets {used}: DeepSpeed's merge_tp_slices would apply them to each "
                                  "parameter (even at tp 1: a vocabulary parameter cut to its original size, a "
                                  "row-parallel one written with cat_dim 1); ringzero's converter does not read "
                                  f"them: remove them from {UC_INFO} (ringzero writes none), {_NOT_SERVED} "
                                  "tensor-parallel checkpoints")


def _save(path: str, obj) -> None:
    os.makedirs(os.path.dirname(path), exist_ok=True)
    torch.save(obj, path, pickle_module=_DS_PICKLE)       # DeepSpeed's pickled classes keep their names


def _optimizer_state(optim_file: str, stage: int) -> dict:
    """zero/optimizer_state.pt: rank 0's optimizer dict less its per-rank tensors, plus param_groups. ZeRO-1/2
    as DeepSpeedCheckpoint hands it over (group_paddings zeroed, partition_count the same N); ZeRO-3 whole."""
    osd = read_keeping(optim_file)["optimizer_state_dict"]
    if stage == 3:
        return {**osd, "param_groups": osd["optimizer_state_dict"]["param_groups"]}
    out = {k: v for k, v in osd.items() if k not in _SHARDED}
    if out.get("group_paddings"):
        out["group_paddings"] = [0] * len(out["group_paddings"])
    if out.get("partition_count"):
        out["partition_count"] = [out["partition_count"][0]] * len(out["partition_count"])
    return {**out, "param_groups": osd["base_optimizer_state"]["param_groups"]}


def main(args) -> None:
    src, dst = args.input_folder, args.output_folder
    print("Convert DeepSpeed Checkpoint to Universal Checkpoint")
    print(f"Converting DeepSpeed checkpoint in {src} to Universal checkpoint in {dst}")
    optim_files = sorted(glob.glob(os.path.join(src, "*_optim_states.pt")))
    if not optim_files:
        raise FileNotFoundError(f"can't find *_optim_states.pt files in directory '{src}'")
    _refuse_unserved(src)
    for flag, dflt in (("num_extract_workers", 4), ("num_merge_workers", 2), ("keep_temp_folder", False)):
        if getattr(args, flag, dflt) not in (dflt, 1, False):
            print(f"note: --{flag}: DeepSpeed parallelises / keeps its fragment files; ringzero converts in this "
                  "process with no temp files (the same output)")
    full, model, optim = read_full(src)
    stage = int(optim[0].get("zero_stage", 1))
    if stage <= 2:
        _check_uc_info(model, args)
    print("*** 1-2. Reading every rank's partitions and writing each parameter's full states")
    steps = {}
    if stage <= 2:
        groups = optim[0]["base_optimizer_state"]["state"]
        steps = {name: groups[g]["step"] for g, shapes in enumerate(model["param_shapes"]) for name in shapes
                 if "step" in groups.get(g, {})}
    for name, states in full.items():
        for state in STATES:
            t = states["master" if state == "fp32" else state]
            if stage == 3:
                _save(param_file(dst, name, state), t.reshape(-1).clone())     # DeepSpeed's DP-only merge: flat
            else:
                _save(param_file(dst, name, state), {CAT_DIM: 0, PARAM: t.clone()})
        if name in steps:
            _save(param_file(dst, name, "step"), steps[name])
    if stage <= 2:   # parameters without optimizer state (frozen) and buffers: their module value, in fp32
        for name, t in model["module"].items():
            if not os.path.isfile(param_file(dst, name, "fp32")):
                _save(param_file(dst, name, "fp32"), {PARAM: t.float()})
    print("*** 3. Saving common optimizer states")
    _save(os.path.join(dst, "zero", "optimizer_state.pt"), _optimizer_state(optim_files[0], stage))
    pattern = "mp_rank_*_model_states.pt" if stage <= 2 else "*model_states.pt"
    for f in sorted(glob.glob(os.path.join(src, pattern))):
        shutil.copy2(f, dst)
    root, step_folder = os.path.split(dst)
    with open(os.path.join(root, LATEST), "w") as f:
        f.write(step_folder)
    print("*** Done!")


if __name__ == "__main__":
    main(parse_arguments())
