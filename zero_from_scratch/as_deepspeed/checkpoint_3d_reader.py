"""DeepSpeed's DeepSpeedCheckpoint (deepspeed.checkpoint): a (pp, tp, dp) checkpoint folder ringzero or
DeepSpeed wrote, read as a whole for scripts that inspect or convert it.

    python -m zero_from_scratch.as_deepspeed script.py      # serves, for the script:
        from deepspeed.checkpoint import DeepSpeedCheckpoint
        ck = DeepSpeedCheckpoint("ckpt/global_step10")                  # the folder's own degrees
        ck.pp_degree, ck.tp_degree, ck.dp_degree, ck.get_iteration()
        ck.get_zero_checkpoint_state(pp_index=0, tp_index=0, dp_index=0)   # dp rank 0's ZeRO files, merged

Which files each rank reads is checkpoint_3d.py's rule, a rank's ZeRO state checkpoint_3d_zero.py's.
Reading follows DeepSpeed 0.19.8 (checkpoint/deepspeed_checkpoint.py): the model-state files are loaded
once, at construction, keeping only the entries later asked for (degrees, parameter shapes, AutoEP layer
records, iteration, args, checkpoint_info, universal_checkpoint_info) in `model_state_metadata` and
`global_state`; asking for a degree other than the folder's reshapes the ZeRO file map (contraction only).
Pipeline layer files (`layer_XX-model_*`: XX = 00 the embedding, the last the final norm, the rest
transformer layers cut evenly over the stages) are merged per tp index with Megatron-GPT's rules
(DeepSpeed's: a few names replicated, two row-parallel weights joined on dim 1, the rest on dim 0).
Its names and error messages are DeepSpeed's on purpose (checkpoint_3d.py's docstring says why).
Cost: one torch.load per model-state file at construction; every state getter loads its files.
"""
from __future__ import annotations

import os
import re

import torch

from zero_from_scratch.as_deepspeed.checkpoint_3d import (basic_folder_validation, get_files, get_files_with_prefix,
                                                          get_model_3d_descriptor_from_metadata,
                                                          get_zero_files, meg_2d_parallel_map, model_3d_desc,
                                                          partition_data, reshape_meg_2d_parallel)
from zero_from_scratch.as_deepspeed.checkpoint_3d_zero import ZeROCheckpoint, _load, merge_state, missing_attribute
from zero_from_scratch.as_deepspeed.constants import CHECKPOINT_KEYS

PARAM_SHAPES, UNIVERSAL_CHECKPOINT_INFO = CHECKPOINT_KEYS["PARAM_SHAPES"], CHECKPOINT_KEYS["UNIVERSAL_CHECKPOINT_INFO"]
AUTOEP_LAYERS_KEY, AUTOEP_LAYERS_KEY_LEGACY = CHECKPOINT_KEYS["AUTOEP_LAYERS_KEY"], CHECKPOINT_KEYS["AUTOEP_LAYERS_KEY_LEGACY"]
LAYER_FILE_PREFIX, MODEL_FILE_PREFIX = CHECKPOINT_KEYS["LAYER_FILE_PREFIX"], CHECKPOINT_KEYS["MODEL_FILE_PREFIX"]
CHECKPOINT_PARALLEL_DIMS, CHECKPOINT_PP_DEGREE, CHECKPOINT_TP_DEGREE = (CHECKPOINT_KEYS[k] for k in (
    "CHECKPOINT_PARALLEL_DIMS", "CHECKPOINT_PP_DEGREE", "CHECKPOINT_TP_DEGREE"))
ARGS_KEY, CHECKPOINT_INFO_KEY, ITERATION_KEY = "args", "checkpoint_info", "iteration"
LAYER_FILE_PREFIX_PATTERN = r"layer_(\d+)-model_.*"
EMBEDDING_LAYER_INDEX, FINAL_LAYER_NORM_INDEX = 0, -1
# Megatron-GPT's layer files: names every tp rank holds whole, and the row-parallel weights split on dim 1
SEQUENTIAL_LAYERS = ["input_layernorm.weight", "input_layernorm.bias", "self_attention.dense.bias",
                     "post_attention_layernorm.weight", "post_attention_layernorm.bias", "mlp.dense_4h_to_h.bias",
                     "position_embeddings.weight"]
LAYER_CONCAT_DIM = {"self_attention.dense.weight": 1, "mlp.dense_4h_to_h.weight": 1}
# what DeepSpeedCheckpoint keeps of an AutoEP layer record (constants.py: AUTOEP_ZERO12_REQUIRED_FIELDS and two more)
AUTOEP_METADATA_FIELDS = ("moe_layer_id", "module_path", "expert_key_prefix", "num_experts", "num_local_experts",
                          "ep_size")


def _autoep_summary(state):
    """The AutoEP layer records with only the fields the converter reads (a non-list: its type's name)."""
    records = state.get(AUTOEP_LAYERS_KEY)
    records = state.get(AUTOEP_LAYERS_KEY_LEGACY) if records is None else records
    if records is None or not isinstance(records, list):
        return records if records is None else type(records).__name__
    return [{k: r[k] for k in AUTOEP_METADATA_FIELDS if k in r} if isinstance(r, dict) else type(r).__name__
            for r in records]


def _state_summary(state) -> dict:
    dims = state.get(CHECKPOINT_PARALLEL_DIMS)
    if isinstance(dims, dict):
        dims = {k: dims.get(k) for k in (CHECKPOINT_PP_DEGREE, CHECKPOINT_TP_DEGREE)}
    elif dims is not None:
        dims = type(dims).__name__
    shapes = state.get(PARAM_SHAPES)
    if isinstance(shapes, (list, tuple)) and all(isinstance(g, dict) for g in shapes):
        shapes = {n: s for g in shapes for n, s in g.items()}
    elif shapes is not None:
        shapes = type(shapes).__name__
    cfg = state.get("ds_config", {})
    if isinstance(cfg, dict):
        flag = cfg.get("use_data_before_expert_parallelism", False)
        cfg = {"use_data_before_expert_parallelism": flag if isinstance(flag, bool) else type(flag).__name__}
    else:
        cfg = type(cfg).__name__
    return {CHECKPOINT_PARALLEL_DIMS: dims, PARAM_SHAPES: shapes, AUTOEP_LAYERS_KEY: _autoep_summary(state),
            "ds_config": cfg}


class DeepSpeedCheckpoint:
    """A checkpoint folder read for a (pp, tp, dp) layout: its own by default, or a contraction of it."""

    def __init__(self, dir, tp_degree=None, pp_degree=None, dp_degree=None, final_layer_norm_idx=FINAL_LAYER_NORM_INDEX):
        self.final_layer_norm_idx = final_layer_norm_idx
        self.dir = dir
        self.file_list = get_files(dir)
        self.layer_files = sorted(p for p in self.file_list if re.fullmatch(LAYER_FILE_PREFIX_PATTERN, os.path.basename(p)))
        self._validate_folder(dir, pipeline_parallel=bool(self.layer_files))
        self.mp_rank_files = get_files_with_prefix(self.file_list, MODEL_FILE_PREFIX)
        self.model_state_metadata, self.global_state = [], {}
        for i, path in enumerate(self.mp_rank_files):      # each model-state file loaded once, here
            state = _load(path)
            self.model_state_metadata.append((path, _state_summary(state)))
            if i == 0:
                self.global_state = {ITERATION_KEY: state.get(ITERATION_KEY, 0),
                                     **{k: state.get(k) for k in (ARGS_KEY, CHECKPOINT_INFO_KEY, UNIVERSAL_CHECKPOINT_INFO)}}
            del state
        source = get_model_3d_descriptor_from_metadata(self.file_list, get_zero_files(dir), self.model_state_metadata)
        self.zero_checkpoint = zc = ZeROCheckpoint(dir, source_3d=source)
        self.layer_keys = self._get_layer_keys()
        self.layer_count = len(self.layer_keys)
        self.tp_degree = zc.get_src_tp_degree() if tp_degree is None else tp_degree
        self.pp_degree = zc.get_src_pp_degree() if pp_degree is None else pp_degree
        self.dp_degree = zc.get_src_dp_degree() if dp_degree is None else dp_degree
        self.original_world_size = zc.get_src_world_size()
        self.world_size = self.tp_degree * self.pp_degree * self.dp_degree
        self.old_2d_map = meg_2d_parallel_map(zc.get_src_pp_degree(), zc.get_src_tp_degree())
        self.old_2d_map.simple_init()
        self.new_2d_map = reshape_meg_2d_parallel(zc.get_src_pp_degree(), zc.get_src_tp_degree(),
                                                  self.pp_degree, self.tp_degree)
        if self.is_change_pp_degree() or self.is_change_tp_degree() or self.is_change_dp_degree():
            zc.reshape(model_3d_desc(self.pp_degree, self.tp_degree, self.dp_degree))
        assert len(self.mp_rank_files) % self.tp_degree == 0
        assert zc.num_files % (self.pp_degree * self.tp_degree) == 0
        assert zc.num_files % self.tp_degree == 0
        transformer_keys = self.layer_keys[1:self.final_layer_norm_idx]
        per_stage = len(transformer_keys) // self.pp_degree if self.pp_degree > 0 else 1
        self.pp_to_transformer_map = {i: transformer_keys[i * per_stage:(i + 1) * per_stage] for i in range(self.pp_degree)}
        self.transformer_file_map = {}
        for k, key in enumerate(transformer_keys):     # (tp, pp) → one list of tp files per transformer layer
            runs = partition_data(get_files_with_prefix(self.layer_files, key + "-"), self.tp_degree)
            for tp in range(self.tp_degree):
                self.transformer_file_map.setdefault((tp, k // per_stage), []).append(runs[tp])
        self.tp_to_embedding_map = self._build_tp_other_layer_map(EMBEDDING_LAYER_INDEX)
        self.tp_to_final_norm_map = self._build_tp_other_layer_map(self.final_layer_norm_idx)

    def is_change_tp_degree(self):
        return self.tp_degree != self.zero_checkpoint.get_src_tp_degree()

    def is_change_pp_degree(self):
        return self.pp_degree != self.zero_checkpoint.get_src_pp_degree()

    def is_change_dp_degree(self):
        return self.dp_degree != self.zero_checkpoint.get_src_dp_degree()

    def get_zero_checkpoint_state(self, pp_index, tp_index, dp_index, strip_tensor_paddings: bool = True) -> dict:
        return self.zero_checkpoint.get_state_for_rank(pp_index, tp_index, dp_index, keys_to_ignore=[PARAM_SHAPES],
                                                       strip_tensor_paddings=strip_tensor_paddings)

    def get_zero_files(self, pp_index, tp_index, dp_index) -> list:
        return self.zero_checkpoint.get_files_for_rank(pp_index, tp_index, dp_index)

    def _get_checkpoint_value(self, key):
        if key not in self.global_state:
            self.global_state[key] = _load(self.mp_rank_files[0]).get(key, None)
        return self.global_state[key]

    def get_iteration(self):
        if ITERATION_KEY not in self.global_state:
            self.global_state[ITERATION_KEY] = _load(self.mp_rank_files[0]).get(ITERATION_KEY, 0)
        return self.global_state[ITERATION_KEY]

    def get_args(self):
        return self._get_checkpoint_value(ARGS_KEY)

    def get_checkpoint_info(self, info_key=CHECKPOINT_INFO_KEY):
        return self._get_checkpoint_value(info_key)

    def get_2d_parallel_files(self, tp_index: int, pp_index: int) -> list:
        assert tp_index < self.tp_degree and pp_index < self.pp_degree
        return [self.mp_rank_files[i] for i in self.new_2d_map.get_data(pp_index=pp_index, tp_index=tp_index)]

    def get_2d_parallel_state(self, tp_index: int, pp_index: int) -> dict:
        merged = None
        for path in self.get_2d_parallel_files(tp_index=tp_index, pp_index=pp_index):
            sd = _load(path)
            merged = sd if merged is None else merge_state(merged, sd)
        return merged

    def get_embedding_layer_id(self):
        return self.layer_keys[EMBEDDING_LAYER_INDEX]

    def get_final_norm_layer_id(self):
        return self.layer_keys[self.final_layer_norm_idx]

    def get_embedding_files(self, tp_index: int) -> list:
        assert tp_index in self.tp_to_embedding_map
        return self.tp_to_embedding_map[tp_index]

    def get_embedding_state(self, tp_index: int) -> dict:
        return self._merge_state_dicts([_load(f) for f in self.get_embedding_files(tp_index)])

    def get_final_norm_files(self, tp_index: int) -> list:
        assert tp_index in self.tp_to_final_norm_map
        return self.tp_to_final_norm_map[tp_index]

    def get_final_norm_state(self, tp_index: int) -> dict:
        return _load(self.get_final_norm_files(tp_index)[0])     # replicated over tp: the first file's

    def get_pp_transformer_map(self, pp_index: int) -> list:
        assert pp_index < self.pp_degree
        return self.pp_to_transformer_map[pp_index]

    def get_transformer_state(self, tp_index: int, pp_index: int) -> list:
        assert tp_index < self.tp_degree and pp_index < self.pp_degree
        return [self._merge_state_dicts([_load(f) for f in files]) for files in self.transformer_file_map[(tp_index, pp_index)]]

    def __getattr__(self, attr):
        raise missing_attribute("DeepSpeedCheckpoint", attr, (
            "_build_pp_transformer_map", "_build_transformer_file_map", "_discover_model_state_metadata",
            "_lightweight_autoep_metadata", "_lightweight_ds_config", "_lightweight_param_shapes",
            "_lightweight_parallel_dimensions", "_sanity_check"),
            "what __init__ built: pp_to_transformer_map, transformer_file_map, model_state_metadata")

    def show_2d_mapping(self):
        print("reshaped 2d map ---- begin")
        for i in range(self.pp_degree):
            for j in range(self.tp_degree):
                print(f"[{i}, {j}] = {self.get_2d_parallel_files(pp_index=i, tp_index=j)}")
        print("reshaped 2d map ---- end")

    def _dump_mapping(self, data_map, map_tag=None):
        if map_tag is not None:
            print(f"Dump mapping: {map_tag}")
        for k, v in data_map.items():
            print(f"{k} = {v}")

    def show_tp_embedding_map(self):
        self._dump_mapping(self.tp_to_embedding_map, "tp_to_embedding_layers")

    def show_tp_final_norm_map(self):
        self._dump_mapping(self.tp_to_final_norm_map, "tp_to_final_norm_layers")

    def show_pp_transformer_map(self):
        self._dump_mapping(self.pp_to_transformer_map, "pp_to_transformer_layers")

    def show_transformer_file_map(self):
        self._dump_mapping(self.transformer_file_map, "rank_to_transformer_files")

    def validate_files(self):
        for file in self.file_list:
            if not os.path.isfile(file):
                print(f"Error: {file} is not existent")

    def _build_tp_other_layer_map(self, layer_index: int) -> dict:
        if not self.layer_files:
            return {}
        assert layer_index <= len(self.layer_files)
        files = get_files_with_prefix(self.layer_files, self.layer_keys[layer_index])
        return dict(enumerate(partition_data(files, self.tp_degree)))

    def _get_layer_keys(self) -> list:
        ids = {re.search(LAYER_FILE_PREFIX_PATTERN, os.path.basename(p)).group(1) for p in self.layer_files}
        return [LAYER_FILE_PREFIX + i for i in sorted(ids, key=int)]

    @staticmethod
    def _merge_state_dicts(sd_list) -> dict:
        return {k: sd_list[0][k] if k in SEQUENTIAL_LAYERS else torch.cat([sd[k] for sd in sd_list], LAYER_CONCAT_DIM.get(k, 0))
                for k in sd_list[0]}

    @staticmethod
    def _validate_folder(dir, pipeline_parallel: bool) -> None:
        basic_folder_validation(dir)
        files = get_files(dir)
        for prefix in [MODEL_FILE_PREFIX] + ([LAYER_FILE_PREFIX, f"{LAYER_FILE_PREFIX}01"] if pipeline_parallel else []):
            assert get_files_with_prefix(files, prefix), \
                f"{dir} seems a bogus DeepSpeed checkpoint folder: Cannot find {prefix}* files in there."
