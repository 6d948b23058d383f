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
and --keep_temp_folder have nothing to act on and say so. It reads the optimizer files DeepSpeed extracts:
ZeRO-3 the list main got from _get_optim_files / _filter_zero3_optim_files (its tp/dp degrees checked against
the model files', DeepSpeed's RuntimeError), ZeRO-1/2 DeepSpeedCheckpoint's zero files. main takes DeepSpeed's steps in its order and by its
module-level names (_get_optim_files, _get_zero_stage, DeepSpeedCheckpoint, _inject_missing_state, ...), looked
up where a script would replace one: the served module under the runner (_ds). Refused, one line each:
tensor-parallel (AutoTP / Megatron) slices, pipeline layer files, expert (MoE / AutoEP) files — DeepSpeed would
merge them by the checkpoint's pattern lists. ringzero writes no tensor-parallel or expert files (it refuses AutoTP
training and MoE checkpoints); its pipeline engine's layer files are refused here as DeepSpeed's are.
Cost: every optimizer file is read once (O(Ψ) memory, the whole model's fp32 state), 3 files per parameter
written (4 at ZeRO-1/2).
"""
from __future__ import annotations

import argparse
import glob
import os
import re
import shutil
import sys

import torch

from zero_from_scratch.as_deepspeed.checkpoint_3d_reader import DeepSpeedCheckpoint
from zero_from_scratch.as_deepspeed.ds_to_universal_checks import _validate_autotp_conversion_support
from zero_from_scratch.as_deepspeed.finder import ServedModule
from zero_from_scratch.engine.checkpoint_ds import read_full
from zero_from_scratch.engine.checkpoint_universal_layout import (CAT_DIM, LATEST, PARAM, STATES, TP_PATTERNS, UC_INFO,
                                                                  UC_KEYS, param_file)
from zero_from_scratch.engine.ds_pickle import DS_PICKLE, load_file

__all__ = ["main", "parse_arguments", "dp_index_to_str", "atoi", "natural_keys", "DeepSpeedCheckpoint",
           "_get_checkpoint_files", "_get_optim_files", "_filter_zero3_optim_files", "_get_model_state_files",
           "_is_expert_model_state_file", "_get_zero3_model_state_files", "_get_zero_stage", "_inject_missing_state",
           "_check_for_required_state", "_save_optimizer_state", "_save_optimizer_state_stage3"]

_SHARDED = ("base_optimizer_state", "param_slice_mappings", "single_partition_of_fp32_groups")
_NOT_SERVED = ("ringzero serves ds_to_universal for data-parallel ZeRO folders only; ringzero refuses AutoTP "
               "training and MoE checkpoints, so it never writes")


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


def _refuse_unserved(folder: str) -> None:
    names = [os.path.basename(f) for f in glob.glob(os.path.join(folder, "*_model_states.pt"))]
    tp = [n for n in names if re.search(r"mp_rank_(\d+)", n) and int(re.search(r"mp_rank_(\d+)", n).group(1)) > 0]
    if tp:
        raise NotImplementedError(f"ds_to_universal of tensor-parallel slices: DeepSpeed would merge them "
                                  f"(merge_tp_slices); {_NOT_SERVED} tensor-parallel checkpoints ({tp[0]} in {folder})")
    if any(n.startswith("layer_") for n in names) or glob.glob(os.path.join(folder, "layer_*")):
        raise NotImplementedError(f"ds_to_universal of pipeline or expert layer files (layer_*): DeepSpeed would merge "
                                  f"them per stage / expert; {_NOT_SERVED} such a folder ({folder})")


def _ds():
    """Where main looks up each step: under the runner the served deepspeed.checkpoint.ds_to_universal, whose names
    resolve to this module's functions unless a script replaced one there (as DeepSpeed's own tests monkeypatch
    _get_optim_files, DeepSpeedCheckpoint, ...); run directly, this module."""
    served = sys.modules.get("deepspeed.checkpoint.ds_to_universal")
    return served if isinstance(served, ServedModule) else sys.modules[__name__]


def atoi(text):
    return int(text) if text.isdigit() else text


def natural_keys(text):      # DeepSpeed's file order: zero_pp_rank_2 before zero_pp_rank_10
    return [atoi(c) for c in re.split(r"(\d+)", text)]


def _get_checkpoint_files(checkpoint_dir, glob_pattern):
    files = sorted(glob.glob(os.path.join(checkpoint_dir, glob_pattern)), key=natural_keys)
    if not files:
        raise FileNotFoundError(f"can't find {glob_pattern} files in directory '{checkpoint_dir}'")
    return files


def _get_optim_files(checkpoint_dir):
    return _ds()._get_checkpoint_files(checkpoint_dir, "*_optim_states.pt")


def _filter_zero3_optim_files(optim_files):
    """The files a ZeRO-3 save names by rank (bf16_ or not), which the stage is read from first."""
    return [f for f in optim_files if re.match(r"(?:bf16_)?zero_pp_rank_", os.path.basename(f))]


def _get_model_state_files(checkpoint_dir):
    return _ds()._get_checkpoint_files(checkpoint_dir, "*_model_states.pt")


def _is_expert_model_state_file(checkpoint_file):
    name = os.path.basename(checkpoint_file)
    return name.startswith("layer_") and "_expert_" in name


def _get_zero3_model_state_files(checkpoint_dir):
    files = [f for f in _ds()._get_model_state_files(checkpoint_dir) if not _is_expert_model_state_file(f)]
    if not files:
        raise FileNotFoundError(f"can't find ZeRO Stage 3 model state files in directory '{checkpoint_dir}'")
    return files


def _get_zero_stage(optim_files):
    return load_file(optim_files[0])["optimizer_state_dict"].get("zero_stage", 1)


def _inject_missing_state(ds_checkpoint):
    """--inject_missing_state: a folder saved without universal_checkpoint_info gets DeepSpeed's minimal one."""
    if ds_checkpoint.get_checkpoint_info(UC_INFO) is None:
        ds_checkpoint.global_state[UC_INFO] = {UC_KEYS["UNIVERSAL_CHECKPOINT_VERSION_KEY"]:
                                               UC_KEYS["UNIVERSAL_CHECKPOINT_VERSION_VALUE"]}


def _check_for_required_state(ds_checkpoint):
    info = ds_checkpoint.get_checkpoint_info(UC_INFO)
    assert info is not None, (f"Required {UC_INFO} state is missing in checkpoint. Verify that client creates this "
                              "state.")
    _ds()._validate_autotp_conversion_support(info)


def _refuse_tp_merge(info: dict) -> None:
    """Pattern lists in universal_checkpoint_info are read only by DeepSpeed's tensor-parallel merge."""
    used = [k for k in TP_PATTERNS if info.get(k)]
    if used:
        raise NotImplementedError(f"{UC_INFO} sets {used}: DeepSpeed's merge_tp_slices would apply them to each "
                                  "parameter (even at tp 1: a vocabulary parameter cut to its original size, a "
                                  "row-parallel one written with cat_dim 1); ringzero's converter does not read "
                                  f"them: remove them from {UC_INFO} (ringzero writes none), {_NOT_SERVED} "
                                  "tensor-parallel checkpoints")


def _save(path: str, obj) -> None:
    os.makedirs(os.path.dirname(path), exist_ok=True)
    torch.save(obj, path, pickle_module=DS_PICKLE)       # DeepSpeed's pickled classes keep their names


def _common_optimizer_state(osd: dict, stage: int) -> dict:
    """zero/optimizer_state.pt: rank 0's optimizer dict less its per-rank tensors, plus param_groups. ZeRO-1/2
    as DeepSpeedCheckpoint hands it over (group_paddings zeroed, partition_count the same N); ZeRO-3 whole."""
    if stage == 3:
        return {**osd, "param_groups": osd["optimizer_state_dict"]["param_groups"]}
    out = {k: v for k, v in osd.items() if k not in _SHARDED}
    if out.get("group_paddings"):
        out["group_paddings"] = [0] * len(out["group_paddings"])
    if out.get("partition_count"):
        out["partition_count"] = [out["partition_count"][0]] * len(out["partition_count"])
    return {**out, "param_groups": osd["base_optimizer_state"]["param_groups"]}


def _save_optimizer_state(args, ds_checkpoint):
    """ZeRO-1/2: dp rank 0's file, read keeping DeepSpeed's pickled classes (its loss scaler) by name."""
    osd = load_file(ds_checkpoint.get_zero_files(pp_index=0, tp_index=0, dp_index=0)[0])["optimizer_state_dict"]
    _save(os.path.join(args.output_folder, "zero", "optimizer_state.pt"), _common_optimizer_state(osd, 2))


def _save_optimizer_state_stage3(args, optim_files):   # ZeRO-3: rank 0's file, whole
    osd = load_file(optim_files[0])["optimizer_state_dict"]
    _save(os.path.join(args.output_folder, "zero", "optimizer_state.pt"), _common_optimizer_state(osd, 3))


def _write_full_states(args, zero_stage: int, optim_files: list) -> None:
    """DeepSpeed's steps 1-2 (extract every rank's fragments, merge them per parameter), from full tensors
    read from `optim_files`, the list DeepSpeed's steps handed main."""
    full, model, optim = read_full(args.input_folder, optim_files)
    steps = {}
    if zero_stage <= 2:
        groups = optim[0]["base_optimizer_state"]["state"]
        steps = {name: groups[g]["step"] for g, shapes in enumerate(model["param_shapes"]) for name in shapes
                 if "step" in groups.get(g, {})}
    dst = args.output_folder
    for name, states in full.items():
        for state in STATES:
            t = states["master" if state == "fp32" else state]
            if zero_stage == 3:
                _save(param_file(dst, name, state), t.reshape(-1).clone())     # DeepSpeed's DP-only merge: flat
            else:
                _save(param_file(dst, name, state), {CAT_DIM: 0, PARAM: t.clone()})
        if name in steps:
            _save(param_file(dst, name, "step"), steps[name])


def _zero3_degrees(files: list) -> tuple[int, int]:
    """(tp, dp) degrees of ZeRO-3 files from their names, every (tp, dp) file present (DeepSpeed's
    _build_zero3_rank_grid, its error text)."""
    grid = {tuple(map(int, re.search(r"zero_pp_rank_(\d+)_mp_rank_(\d+)", os.path.basename(f)).groups()[::-1]))
            for f in files}
    tp, dp = max(t for t, _ in grid) + 1, max(d for _, d in grid) + 1
    missing = [(t, d) for t in range(tp) for d in range(dp) if (t, d) not in grid]
    if missing:
        raise RuntimeError(f"Missing ZeRO-3 checkpoint file for tp_rank={missing[0][0]}, dp_rank={missing[0][1]}")
    return tp, dp


def _write_model_values(args, ds_checkpoint) -> None:
    """ZeRO-1/2: parameters without optimizer state (frozen) and buffers get their module value, in fp32."""
    for model_file in ds_checkpoint.mp_rank_files:
        for name, t in (load_file(model_file).get("module") or {}).items():
            if not os.path.isfile(param_file(args.output_folder, name, "fp32")):
                _save(param_file(args.output_folder, name, "fp32"), {PARAM: t.float()})


def main(args) -> None:
    """DeepSpeed's main, step for step and by the same module-level names (a script may replace any of them)."""
    ds = _ds()
    print("Convert DeepSpeed Checkpoint to Universal Checkpoint")
    print(f"Converting DeepSpeed checkpoint in {args.input_folder} to Universal checkpoint in {args.output_folder}")
    optim_files = ds._get_optim_files(args.input_folder)
    zero3_optim_files = ds._filter_zero3_optim_files(optim_files)
    zero_stage = ds._get_zero_stage(zero3_optim_files or optim_files)
    if zero_stage > 2 and zero3_optim_files:
        optim_files = zero3_optim_files
    _refuse_unserved(args.input_folder)
    for flag, dflt in (("num_extract_workers", 4), ("num_merge_workers", 2), ("keep_temp_folder", False)):
        if getattr(args, flag, dflt) not in (dflt, 1, False):
            print(f"note: --{flag}: DeepSpeed parallelises / keeps its fragment files; ringzero converts in this "
                  "process with no temp files (the same output)")
    if zero_stage <= 2:
        ds_checkpoint = ds.DeepSpeedCheckpoint(args.input_folder)
        if args.inject_missing_state:
            ds._inject_missing_state(ds_checkpoint)
        ds._check_for_required_state(ds_checkpoint)
        _refuse_tp_merge(ds_checkpoint.get_checkpoint_info(UC_INFO) or {})
        print("*** 1-2. Reading every rank's partitions and writing each parameter's full states")
        _write_full_states(args, zero_stage, [ds_checkpoint.get_zero_files(pp_index=0, tp_index=0, dp_index=i)[0]
                                              for i in range(ds_checkpoint.dp_degree)])
        _write_model_values(args, ds_checkpoint)
        print("*** 3. Saving common optimizer states")
        ds._save_optimizer_state(args, ds_checkpoint)
        for f in ds_checkpoint.mp_rank_files:
            shutil.copy2(f, args.output_folder)
    else:
        model_files = ds._get_zero3_model_state_files(args.input_folder)
        (tp, dp), (tp_o, dp_o) = _zero3_degrees(model_files), _zero3_degrees(optim_files)
        if (tp, dp) != (tp_o, dp_o):
            raise RuntimeError("ZeRO-3 model/optimizer tp_degree or dp_degree mismatch: "
                               f"model=({tp},{dp}), optim=({tp_o},{dp_o})")
        print("*** 1-2. Reading every rank's partitions and writing each parameter's full states")
        _write_full_states(args, zero_stage, optim_files)
        print("*** 3. Saving common optimizer states")
        ds._save_optimizer_state_stage3(args, optim_files)
        for f in model_files:
            shutil.copy2(f, args.output_folder)
    root, step_folder = os.path.split(args.output_folder)
    with open(os.path.join(root, LATEST), "w") as f:
        f.write(step_folder)
    print("*** Done!")


if __name__ == "__main__":
    main(parse_arguments())
