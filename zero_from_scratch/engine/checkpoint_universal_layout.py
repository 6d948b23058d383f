"""DeepSpeed's universal checkpoint layout: the names and pickled objects its converter and loader share.

    from zero_from_scratch.engine.checkpoint_universal_layout import param_file, slice_mappings
    param_file("ckpt/global_step3_universal", "net.0.weight", "exp_avg")   # …/zero/net.0.weight/exp_avg.pt

A universal folder (DeepSpeed 0.19.8, deepspeed/checkpoint/ds_to_universal.py) holds, next to copies of the
source folder's *_model_states.pt files, one folder per parameter under zero/:
  fp32.pt, exp_avg.pt, exp_avg_sq.pt  the full tensor of that parameter: from a ZeRO-1/2 source a dict
                                      {"cat_dim": 0, "param": tensor of the parameter's shape}, from ZeRO-3 the
                                      bare flat tensor; a parameter with no optimizer state (frozen, a buffer:
                                      ZeRO-1/2 only) gets fp32.pt {"param": its module value in fp32}
  step.pt                             ZeRO-1/2 only: the step of the parameter's optimizer group
  zero/optimizer_state.pt             rank 0's optimizer dict without the per-rank tensors, plus param_groups
and `latest_universal` beside the folder names it. The source ZeRO-1/2 optimizer files must carry
param_slice_mappings (each parameter's fragment of the rank's flat fp32 partition, DeepSpeed's
fragment_address) and per-rank group_paddings: checkpoint_ds.write uses slice_mappings below.
Pickled DeepSpeed objects (its loss scaler, fragment addresses) read as stand-ins that keep their class name,
so a file re-written still names DeepSpeed's class (ds_pickle.py). Cost: none (names).
"""
from __future__ import annotations

import os
from collections import OrderedDict

STATES = ("fp32", "exp_avg", "exp_avg_sq")        # the per-parameter tensors, DeepSpeed's names
LATEST = "latest_universal"
UC_INFO = "universal_checkpoint_info"
# deepspeed/checkpoint/constants.py's universal-checkpoint names (the runner serves them from here)
UC_KEYS = {"PARAM": "param", "CAT_DIM": "cat_dim", "PARAM_SLICE_MAPPINGS": "param_slice_mappings",
           "UNIVERSAL_CHECKPOINT_VERSION_KEY": "universal_checkpoint_version", "UNIVERSAL_CHECKPOINT_VERSION_VALUE": 0.4,
           "AUTOTP_UNSUPPORTED_PARAMETER_PATTERNS": "autotp_unsupported_parameter_patterns",
           "VOCABULARY_PARAMETER_PATTERNS": "vocabulary_parameter_patterns",
           "PIPELINE_REPLICATED_PARAMETER_PATTERNS": "pipeline_replicated_parameter_patterns",
           "PARAMETER_TO_AVERAGE_PATTERNS": "parameter_to_average_patterns",
           "PARAMETER_WITH_ROW_PARALLELISM_PATTERNS": "parameter_with_row_parallelism_patterns",
           "TP_REPLICATED_PARAMETER_PATTERNS": "tp_replicated_parameter_patterns",
           "PARAMETER_WITH_2_SUB_PARAMS_CAT_DIM_0": "parameter_with_2_sub_params_cat_dim_0",
           "PARAMETER_WITH_SUB_PARAMS": "parameter_with_sub_params", "AFFINE_MAP": "affine_map"}
globals().update(UC_KEYS)
PARAM, CAT_DIM = UC_KEYS["PARAM"], UC_KEYS["CAT_DIM"]     # the keys inside a ZeRO-1/2 source's files
# the uc-info keys that tell DeepSpeed's merge how to join tensor-parallel slices (the pipeline one only skips
# stages > 0 and the AutoTP one only refuses: neither joins anything)
TP_PATTERNS = tuple(v for k, v in UC_KEYS.items() if k.endswith(("_PATTERNS", "_PARAMS", "_DIM_0", "AFFINE_MAP"))
                    and k not in ("AUTOTP_UNSUPPORTED_PARAMETER_PATTERNS", "PIPELINE_REPLICATED_PARAMETER_PATTERNS"))


def param_file(folder: str, name: str, state: str) -> str:
    return os.path.join(folder, "zero", name, f"{state}.pt")


class FragmentAddress:
    """Pickled as DeepSpeed's utils/tensor_fragment.py fragment_address (a dataclass numel, start): where one
    parameter's elements lie in a rank's flat fp32 partition. Written as is, DeepSpeed is not imported."""
    _deepspeed_name = ("deepspeed.utils.tensor_fragment", "fragment_address")

    def __init__(self, numel: int, start: int):
        self.numel, self.start = numel, start

    def __repr__(self):
        return f"fragment_address(numel={self.numel}, start={self.start})"


def slice_mappings(names: list, numels: list, n: int, r: int, size: int) -> tuple[OrderedDict, int]:
    """One ZeRO-1/2 group flattened in `names` order and padded to `size` elements, cut into n equal
    partitions: ({name: FragmentAddress within rank r's partition} for each parameter that has elements
    there, the padding inside rank r's partition) — DeepSpeed's _param_slice_mappings and groups_padding
    (runtime/zero/stage_1_and_2.py: _create_param_mapping, the 'Record padding' lines)."""
    p, lo_r = size // n, r * (size // n)
    out, off = OrderedDict(), 0
    for name, k in zip(names, numels):
        lo, hi = max(off, lo_r), min(off + k, lo_r + p)
        if hi > lo:
            out[name] = FragmentAddress(hi - lo, lo - lo_r)
        off += k
    return out, max(0, min(p, lo_r + p - off))
