"""DeepSpeed's ZeROCheckpoint (deepspeed.checkpoint): a folder's ZeRO files, which of them each rank of a
(pp, tp, dp) layout reads, and that rank's optimizer state merged from them; merge_state, the merge.

    python -m zero_from_scratch.as_deepspeed script.py      # serves, for the script:
        from deepspeed.checkpoint import ZeROCheckpoint, model_3d_desc
        zc = ZeROCheckpoint("ckpt/global_step10")                        # the folder's own (pp, tp, dp)
        zc.reshape(model_3d_desc(1, 1, 1)); zc.get_files_for_rank(0, 0, 0)   # every ZeRO file, in merge order

Which files each rank reads is checkpoint_3d.py's rule (its docstring). A rank's state follows DeepSpeed
0.19.8 (checkpoint/zero_checkpoint.py, reshape_utils.py): its files merged in order (merge_state: dicts by
key, lists item by item, tensors concatenated on dim 0), each optimizer-state tensor first cut to its
group's unpadded length (group_paddings, then zeroed), partition_count set to the target dp degree.
Its names and error messages are DeepSpeed's on purpose (checkpoint_3d.py's docstring says why).
Cost: one read per file a rank reads (ds_pickle.load_file); the constructor loads the model-state files only when no
source layout is given (get_model_3d_descriptor).
"""
from __future__ import annotations

from collections import OrderedDict

import torch

from zero_from_scratch.as_deepspeed.checkpoint_3d import (basic_folder_validation, get_model_3d_descriptor,
                                                          get_zero_files, model_3d_desc)
from zero_from_scratch.as_deepspeed.constants import CHECKPOINT_KEYS
from zero_from_scratch.as_deepspeed.finder import NotServedAttributeError, message
from zero_from_scratch.engine.ds_pickle import load_file

OPTIMIZER_STATE_DICT, BASE_OPTIMIZER_STATE = CHECKPOINT_KEYS["OPTIMIZER_STATE_DICT"], CHECKPOINT_KEYS["BASE_OPTIMIZER_STATE"]
GROUP_PADDINGS, PARTITION_COUNT = CHECKPOINT_KEYS["GROUP_PADDINGS"], CHECKPOINT_KEYS["PARTITION_COUNT"]


def merge_state(state_a, state_b, key_list=()):
    """Two ranks' states as one: dicts by b's keys (a key only in a is dropped, DeepSpeed's way), lists and
    tuples item by item, tensors concatenated on dim 0, anything else a's."""
    if type(state_a) is not type(state_b):
        raise ValueError(f"Cannot merge two states of types {type(state_a)} and type {type(state_b)}")
    if type(state_a) in (dict, OrderedDict):      # exact types: a dict subclass is "anything else"
        return type(state_a)({k: merge_state(state_a[k], v, [str(k)]) if k in state_a else v
                              for k, v in state_b.items()})
    if type(state_a) in (list, tuple):
        if len(state_a) != len(state_b):
            raise ValueError(f"Cannot merge lists of different lengths, a = {len(state_a)} b = {len(state_b)}")
        return type(state_a)(merge_state(a, b, key_list) for a, b in zip(state_a, state_b))
    return torch.cat([state_a, state_b], 0) if torch.is_tensor(state_a) else state_a


def _load(path):
    """One file, DeepSpeed's pickled objects (loss scaler, ZeroStageEnum) as ds_pickle's stand-ins: a plain
    torch.load would import the deepspeed package, which the runner serves from ringzero."""
    return load_file(path)


def missing_attribute(owner: str, attr: str, private: tuple[str, ...], nearest: str) -> AttributeError:
    """What reading a missing attribute of a served checkpoint class raises: DeepSpeed's private helpers
    (`private`, which ringzero's class does not split out) name the refusal; anything else is a plain miss."""
    if attr in private:
        return NotServedAttributeError(message(f"deepspeed.checkpoint.{owner}.{attr}",
                                               "run its private helper of that name", nearest))
    return AttributeError(f"{owner!r} object has no attribute {attr!r}")


class ZeROCheckpoint:
    """A folder's ZeRO files and which of them each (pp, tp, dp) rank of the target layout reads."""

    def __init__(self, dir, source_3d=None):
        basic_folder_validation(dir)
        self.dir = dir
        self.file_list = get_zero_files(dir)
        self.num_files = len(self.file_list)
        assert self.num_files > 0, f"No ZeRO files found in {dir}"
        self.src_3d = get_model_3d_descriptor(dir) if source_3d is None else source_3d
        self.reshape(model_3d_desc(self.src_3d.pp_degree, self.src_3d.tp_degree, self.src_3d.dp_degree))

    def get_src_world_size(self):
        return self.src_3d.world_size()

    def get_src_tp_degree(self):
        return self.src_3d.tp_degree

    def get_src_pp_degree(self):
        return self.src_3d.pp_degree

    def get_src_dp_degree(self):
        return self.src_3d.dp_degree

    def reshape(self, target_3d_desc) -> None:
        self.target_3d = target_3d_desc
        self._3d_file_map = self.src_3d.reshape(target_3d_desc)

    def get_file_indices_for_rank(self, pp_index, tp_index, dp_index) -> list:
        assert dp_index < len(self._3d_file_map), f"DP index {dp_index} >= DP degree {len(self._3d_file_map)}"
        return self._3d_file_map[dp_index].get_data(pp_index, tp_index)

    def get_files_for_rank(self, pp_index, tp_index, dp_index) -> list:
        return [self.file_list[i] for i in self.get_file_indices_for_rank(pp_index, tp_index, dp_index)]

    def get_state_for_rank(self, pp_index, tp_index, dp_index, keys_to_ignore=(), strip_tensor_paddings=True):
        merged = None
        for path in self.get_files_for_rank(pp_index, tp_index, dp_index):
            sd = _load(path)
            for key in keys_to_ignore:
                sd.pop(key, None)
            if strip_tensor_paddings:
                self._strip_tensor_paddings(sd)
            merged = sd if merged is None else merge_state(merged, sd)
            osd = merged.get(OPTIMIZER_STATE_DICT) or {}
            if osd.get(PARTITION_COUNT):      # the merged state is one partition of the target dp degree
                osd[PARTITION_COUNT] = [self.target_3d.dp_degree] * len(osd[PARTITION_COUNT])
            if strip_tensor_paddings and osd.get(GROUP_PADDINGS):
                osd[GROUP_PADDINGS] = [0] * len(osd[GROUP_PADDINGS])
        return merged

    def __getattr__(self, attr):
        # DeepSpeed 0.19.8's print_3d_file_map loops over the int pp_degree: any call raises TypeError there
        if attr == "print_3d_file_map":
            raise NotServedAttributeError(message(
                f"deepspeed.checkpoint.ZeROCheckpoint.{attr}", "raise TypeError ('int' object is not iterable)",
                "print_3d_index_map, then get_files_for_rank(pp_index, tp_index, dp_index)"))
        raise missing_attribute("ZeROCheckpoint", attr, ("_clear_group_paddings", "_get_optimizer_state",
                                                         "_get_param_group_states", "_update_partition_count"),
                                "get_state_for_rank, which does these steps inline")

    def print_3d_index_map(self, tag=None):
        if tag:
            print(f"3D index map: {tag}")
        for dp_index, grid in enumerate(self._3d_file_map):
            grid.print_data(f"dp = {dp_index}")

    @staticmethod
    def _strip_tensor_paddings(sd) -> None:
        """Each optimizer-state tensor (not `step`) cut to its group's length without the ZeRO padding."""
        osd = sd.get(OPTIMIZER_STATE_DICT) or {}
        groups = (osd.get(BASE_OPTIMIZER_STATE) or {}).get("state")
        paddings = osd.get(GROUP_PADDINGS)
        if groups is None or paddings is None:
            return
        for key, group in groups.items():
            if paddings[key]:
                for name, value in group.items():
                    if name != "step" and torch.is_tensor(value):
                        group[name] = value.narrow(0, 0, value.numel() - paddings[key]).clone()
