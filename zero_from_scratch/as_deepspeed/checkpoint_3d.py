"""DeepSpeed's 3D checkpoint layout: which file of a (pp, tp, dp) checkpoint folder is which rank's, and
which files each rank of a smaller (pp', tp', dp') job reads (deepspeed.checkpoint.model_3d_desc & co).

    python -m zero_from_scratch.as_deepspeed script.py      # serves, for the script:
        from deepspeed.checkpoint import model_3d_desc, get_model_3d_descriptor
        model_3d_desc(2, 2, 2).reshape(model_3d_desc(1, 2, 1))[0].get_data(pp_index=0, tp_index=1)   # [1, 5, 3, 7]
        get_model_3d_descriptor("ckpt/global_step10").get_desc()                                    # 'PP,TP,DP = (1, 1, 2)'

The numbering (DeepSpeed 0.19.8, checkpoint/reshape_*.py, what its converters read): a folder holds one
`mp_rank_XX_model_states.pt` per model-parallel rank, numbered stage-major (mp = pp_index * tp + tp_index),
and one ZeRO file per (dp, mp) rank, `[bf16_|fp16_]zero_pp_rank_D_mp_rank_XX_optim_states.pt`; sorted by
(dp, mp), ZeRO file number f = dp * (pp * tp) + mp: the data-parallel rank is the outermost digit.

Reshaping only contracts (each degree ≤ the source's: merging files is possible, splitting them is not).
Each step is one rule, "concatenate in order, cut into equal contiguous runs" (an uneven cut fails):
  1. tp: within each pipeline stage, the tp ranks' files are cut into tp' runs (neighbouring tp slices merge);
  2. pp: within each new tp column, the stages' lists (stage order) are cut into pp' runs;
  3. dp: each (pp', tp') cell's model-parallel file m becomes the list of its dp copies m, m+S, m+2S, ...
     (S = pp * tp, the source's files per dp rank), the copies of one m kept together and in dp order, then
     the cell's whole list is cut into dp' runs: target dp rank r reads run r.
The dp rule is the idea: a ZeRO shard is 1/dp of one model-parallel slice's flat buffer, and the slice is
those shards concatenated in dp order. Keeping each slice's dp copies adjacent and ordered means a run, once
concatenated (merge_state: dim 0), is whole slices' flat buffers one after another, never a shard torn from
its neighbours. It follows that the files are divided, not the parameters: with dp' > 1 a target dp rank
holds whole source slices (222 → 122: dp 0 reads files [0, 4] = stage 0's slice, dp 1 reads [2, 6] = stage
1's), which is DeepSpeed's answer too; re-partitioning by parameter is the universal checkpoint's job.
Names, signatures, checks and error messages are DeepSpeed's on purpose: scripts and DeepSpeed's own
tests (unit/checkpoint/test_reshape_checkpoint.py, run by tests/ds_bulk) match on them, and
tests/test_checkpoint_3d.py compares them with the installed DeepSpeed's; the code is ringzero's.
Cost: integer lists; get_model_3d_descriptor loads each model-state file once (ds_pickle.load_file).
"""
from __future__ import annotations

import os
import re

from zero_from_scratch.as_deepspeed.constants import CHECKPOINT_KEYS
from zero_from_scratch.engine.ds_pickle import load_file

PP_DIM, TP_DIM, DP_DIM = "PP", "TP", "DP"
# checkpoint/constants.py's names for what this module reads, from their one home (as_deepspeed/constants.py)
MODEL_FILE_PREFIX, ZERO_FILE_PREFIX, LAYER_FILE_PREFIX = (CHECKPOINT_KEYS[k] for k in (
    "MODEL_FILE_PREFIX", "ZERO_FILE_PREFIX", "LAYER_FILE_PREFIX"))
FP16_ZERO_FILE_PREFIX, BF16_ZERO_FILE_PREFIX = CHECKPOINT_KEYS["FP16_ZERO_FILE_PREFIX"], CHECKPOINT_KEYS["BF16_ZERO_FILE_PREFIX"]
CHECKPOINT_PARALLEL_DIMS, CHECKPOINT_PP_DEGREE, CHECKPOINT_TP_DEGREE = (CHECKPOINT_KEYS[k] for k in (
    "CHECKPOINT_PARALLEL_DIMS", "CHECKPOINT_PP_DEGREE", "CHECKPOINT_TP_DEGREE"))



def get_zero_ckpt_name_for_rank(base_folder: str, dp_rank: int, mp_rank: int) -> str:
    """`base_folder/zero_pp_rank_{dp}_mp_rank_{mp:02d}_optim_states.pt` (DeepSpeed's fp32 ZeRO file name)."""
    name = f"{ZERO_FILE_PREFIX}{dp_rank}_{MODEL_FILE_PREFIX}{mp_rank:02d}{CHECKPOINT_KEYS['OPTIM_FILE_SUFFIX']}"
    return os.path.join(base_folder, name)


def get_layer_ckpt_name_for_rank(base_folder: str, layer_id: str, tp_rank: int) -> str:
    """`base_folder/{layer_id}-model_{tp:02d}_model_states.pt`; layer_id carries its own "layer_" prefix."""
    return os.path.join(base_folder, f"{layer_id}-model_{tp_rank:02d}{CHECKPOINT_KEYS['MODEL_FILE_SUFFIX']}")


def partition_data(data_list: list, num_partitions: int) -> list[list]:
    """`data_list` cut into `num_partitions` equal contiguous runs (DeepSpeed asserts the cut is even)."""
    assert len(data_list) % num_partitions == 0
    size = len(data_list) // num_partitions
    return [data_list[i * size:(i + 1) * size] for i in range(num_partitions)]


class meg_2d_parallel_map:
    """A (pp, tp) grid of file-number lists; `map` keeps DeepSpeed's "pp,tp" string keys."""

    def __init__(self, pp_degree: int, tp_degree: int):
        self.pp_degree, self.tp_degree = pp_degree, tp_degree
        self.map: dict[str, list] = {}

    def simple_init(self) -> None:
        """Each cell holds its own model-parallel rank's number, stage-major."""
        self.map = {self._make_key(*divmod(i, self.tp_degree)): [i] for i in range(self.pp_degree * self.tp_degree)}

    def add_data(self, pp_index: int, tp_index: int, data: list) -> None:
        self._validate_indices(pp_index, tp_index)
        assert type(data) is list
        self.map.setdefault(self._make_key(pp_index, tp_index), []).extend(data)

    def get_data(self, pp_index: int | None = None, tp_index: int | None = None) -> list:
        """The cell's list; an index left None spans its axis (stage-major)."""
        self._validate_indices(pp_index, tp_index)
        pps = range(self.pp_degree) if pp_index is None else [pp_index]
        tps = range(self.tp_degree) if tp_index is None else [tp_index]
        return [x for i in pps for j in tps for x in self.map[self._make_key(i, j)]]

    def print_data(self, tag) -> None:
        print(f"{tag}")
        for key, value in self.map.items():
            print(f"{key} = {value}")

    def _validate_indices(self, pp_index, tp_index) -> None:
        assert pp_index is None or pp_index < self.pp_degree
        assert tp_index is None or tp_index < self.tp_degree

    @staticmethod
    def _make_key(i, j) -> str:
        return f"{i},{j}"


def reshape_meg_2d_parallel(old_pp_degree, old_tp_degree, new_pp_degree, new_tp_degree, verbose=False):
    """Steps 1 and 2 of the module docstring: the (new_pp, new_tp) grid of model-parallel file numbers."""
    assert new_pp_degree <= old_pp_degree
    assert new_tp_degree <= old_tp_degree
    grid = meg_2d_parallel_map(old_pp_degree, old_tp_degree)
    grid.simple_init()
    if verbose:
        grid.print_data("original_2d_map:")
    if new_tp_degree != old_tp_degree:      # each stage's row cut into new_tp runs
        cut = meg_2d_parallel_map(old_pp_degree, new_tp_degree)
        for i in range(old_pp_degree):
            for j, run in enumerate(partition_data(grid.get_data(pp_index=i), new_tp_degree)):
                cut.add_data(i, j, run)
        grid = cut
    if verbose:
        grid.print_data("after_tp_reshape:")
    if new_pp_degree != old_pp_degree:      # each tp column cut into new_pp runs
        cut = meg_2d_parallel_map(new_pp_degree, grid.tp_degree)
        for j in range(grid.tp_degree):
            for i, run in enumerate(partition_data(grid.get_data(tp_index=j), new_pp_degree)):
                cut.add_data(i, j, run)
        grid = cut
    if verbose:
        grid.print_data("final_2d_map:")
    return grid


def flatten_dp_dimension(meg_2d_map, src_2d_size: int, dp_degree: int):
    """Step 3, first half: each file number m of a cell → its dp copies m, m + S, ... (kept together)."""
    out = meg_2d_parallel_map(meg_2d_map.pp_degree, meg_2d_map.tp_degree)
    for i in range(meg_2d_map.pp_degree):
        for j in range(meg_2d_map.tp_degree):
            for m in meg_2d_map.get_data(i, j):
                out.add_data(i, j, [m + d * src_2d_size for d in range(dp_degree)])
    return out


def unflatten_dp_dimension(meg_2d_map, dp_degree: int) -> list:
    """Step 3, second half: every cell's list cut into dp_degree runs; grid r holds the runs r."""
    grids = [meg_2d_parallel_map(meg_2d_map.pp_degree, meg_2d_map.tp_degree) for _ in range(dp_degree)]
    for i in range(meg_2d_map.pp_degree):
        for j in range(meg_2d_map.tp_degree):
            for grid, run in zip(grids, partition_data(meg_2d_map.get_data(i, j), dp_degree)):
                grid.add_data(i, j, run)
    return grids


class model_3d_desc:
    """A checkpoint's (pp, tp, dp) degrees; `reshape(target)` → one 2D grid per target dp rank."""

    def __init__(self, pp_degree=1, tp_degree=1, dp_degree=1):
        self.pp_degree, self.tp_degree, self.dp_degree = pp_degree, tp_degree, dp_degree

    def reshape(self, target_3d_desc, verbose=False) -> list:
        ok, errors = self.can_reshape(target_3d_desc)
        assert ok, ",".join(errors)
        grid = reshape_meg_2d_parallel(self.pp_degree, self.tp_degree, target_3d_desc.pp_degree,
                                       target_3d_desc.tp_degree, verbose=verbose)
        flat = flatten_dp_dimension(grid, self.pp_degree * self.tp_degree, self.dp_degree)
        return unflatten_dp_dimension(flat, target_3d_desc.dp_degree)

    def get_desc(self) -> str:
        return f"{PP_DIM},{TP_DIM},{DP_DIM} = ({self.pp_degree}, {self.tp_degree}, {self.dp_degree})"

    def world_size(self) -> int:
        return self.pp_degree * self.tp_degree * self.dp_degree

    def _axes(self):
        return ((PP_DIM, self.pp_degree), (TP_DIM, self.tp_degree), (DP_DIM, self.dp_degree))

    def is_valid(self, pp_index, tp_index, dp_index):
        errors = [f"{name} indexing error: index {index} >= degree {degree}"
                  for index, (name, degree) in zip((pp_index, tp_index, dp_index), self._axes()) if index >= degree]
        return not errors, errors

    def can_reshape(self, target_3d_desc):
        """(ok, errors): only contraction, each degree ≤ the source's."""
        errors = [f"Expansion reshape not supported - {name}: {old} ---> {new}"
                  for (name, old), (_, new) in zip(self._axes(), target_3d_desc._axes()) if new > old]
        return not errors, errors


def basic_folder_validation(dir) -> None:
    assert os.path.exists(dir), f"{dir} path does not exist"
    assert os.path.isdir(dir), f"{dir} is not a folder"


def get_files(dir) -> list[str]:
    """Every file under `dir`, subfolders included (os.walk order)."""
    return [os.path.join(root, f) for root, _, files in os.walk(dir) for f in files]


def get_files_with_prefix(all_files, prefix) -> list[str]:
    return sorted(p for p in all_files if os.path.basename(p).startswith(prefix))


def sort_zero_files(files, prefix) -> list[str]:
    """ZeRO files in (dp rank, mp rank) order, read from their names."""
    pattern = re.compile(f"{prefix}([0-9]+)_{MODEL_FILE_PREFIX}([0-9]+)")
    keyed = []
    for f in files:
        m = pattern.search(f)
        if not m:
            raise ValueError(f"Cannot parse dp_rank and mp_rank from {f}")
        keyed.append((int(m.group(1)), int(m.group(2)), f))
    return [f for *_, f in sorted(keyed, key=lambda k: k[:2])]


def get_zero_files(dir) -> list[str]:
    """The ZeRO files of the first kind present (fp32, fp16, then bf16 names), sorted as above."""
    files = get_files(dir)
    for prefix in (ZERO_FILE_PREFIX, FP16_ZERO_FILE_PREFIX, BF16_ZERO_FILE_PREFIX):
        found = get_files_with_prefix(files, prefix)
        if found:
            return sort_zero_files(found, prefix)
    return []


def _recorded_degrees(model_file, dims) -> tuple[int, int]:
    if not isinstance(dims, dict):
        raise RuntimeError(f"Checkpoint {CHECKPOINT_PARALLEL_DIMS} must be a dictionary in {model_file}.")
    out = []
    for key in (CHECKPOINT_PP_DEGREE, CHECKPOINT_TP_DEGREE):
        value = dims.get(key)
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise RuntimeError(f"Checkpoint {key} must be a positive integer in {model_file}, got {value!r}.")
        out.append(value)
    return out[0], out[1]


def get_model_3d_descriptor_from_metadata(file_list, zero_file_list, model_state_metadata) -> model_3d_desc:
    """The folder's (pp, tp, dp): from the degrees each model-state file records (all must, and agree),
    else, for folders written before that record existed, from file counts: layer_01-* files (one per tp
    rank of a pipeline) give tp, otherwise every model file is a tp rank of one stage."""
    model_files = [f for f, _ in model_state_metadata]
    recorded = [(f, md.get(CHECKPOINT_PARALLEL_DIMS)) for f, md in model_state_metadata]
    degrees = [_recorded_degrees(f, d) for f, d in recorded if d is not None]
    if degrees:
        missing = [f for f, d in recorded if d is None]
        if missing:
            raise RuntimeError(f"Checkpoint {CHECKPOINT_PARALLEL_DIMS} is missing from model-state files: {missing}")
        if len(set(degrees)) != 1:
            raise RuntimeError(f"Checkpoint {CHECKPOINT_PARALLEL_DIMS} disagrees across model-state files: {degrees}")
        pp, tp = degrees[0]
        if len(model_files) != pp * tp:
            raise RuntimeError(f"Checkpoint model-state file count {len(model_files)} does not match "
                               f"{CHECKPOINT_PP_DEGREE}={pp} * {CHECKPOINT_TP_DEGREE}={tp}.")
        if len(zero_file_list) % (pp * tp):
            raise RuntimeError(f"Checkpoint ZeRO file count {len(zero_file_list)} is not divisible by "
                               f"{CHECKPOINT_PP_DEGREE}={pp} * {CHECKPOINT_TP_DEGREE}={tp}.")
        return model_3d_desc(pp, tp, max(1, len(zero_file_list) // (pp * tp)))
    stage0 = len(get_files_with_prefix(file_list, f"{LAYER_FILE_PREFIX}01"))
    tp = stage0 if stage0 > 0 else len(model_files)
    pp = len(model_files) // tp if stage0 > 0 else 1
    return model_3d_desc(pp, tp, max(1, len(zero_file_list) // (pp * tp)))


def get_model_3d_descriptor(dir) -> model_3d_desc:
    """The (pp, tp, dp) of a checkpoint folder; loads each model-state file once for its recorded degrees."""
    files = get_files(dir)
    metadata = []
    for f in get_files_with_prefix(files, MODEL_FILE_PREFIX):
        state = load_file(f)         # DeepSpeed's pickled objects as stand-ins (ds_pickle.py)
        metadata.append((f, {CHECKPOINT_PARALLEL_DIMS: state.get(CHECKPOINT_PARALLEL_DIMS)}))
        del state
    return get_model_3d_descriptor_from_metadata(files, get_zero_files(dir), metadata)
