"""The checks DeepSpeed's ds_to_universal makes on a checkpoint's own records before converting it.

    from deepspeed.checkpoint.ds_to_universal import _validate_autotp_conversion_support   # under the runner
    _validate_autotp_conversion_support(universal_checkpoint_info)     # ValueError naming the unconvertible

Both follow DeepSpeed 0.19.8 (checkpoint/ds_to_universal.py), its error texts included: the AutoTP record of
parameters it marked unconvertible, and the AutoEP layer records of a ZeRO-1/2 folder's model-state files.
ringzero's own folders carry neither (it refuses AutoTP training and MoE checkpoints), so both pass on them;
they are served because scripts and DeepSpeed's tests call them on records they build. Cost: one pass over the
records.
"""
from __future__ import annotations

from zero_from_scratch.engine.checkpoint_universal_layout import UC_KEYS


def _validate_autotp_conversion_support(info: dict) -> None:
    """DeepSpeed's ValueError for parameters its AutoTP marked unconvertible (a checkpoint's own record)."""
    bad = info.get(UC_KEYS["AUTOTP_UNSUPPORTED_PARAMETER_PATTERNS"], {})
    if bad:
        details = ", ".join(f"{p}: {why}" for p, why in sorted(bad.items()))
        raise ValueError(f"AutoTP universal checkpoint conversion is not supported for {details}.")


def _aggregate_autoep_zero12_metadata(model_state_metadata):
    """DeepSpeed's check of DeepSpeedCheckpoint.model_state_metadata ([(model file, {param_shapes: {name: shape},
    ds_autoep_layers, ds_config}), ...]) before a ZeRO-1/2 conversion: (per-file param shapes, the AutoEP layer
    entries merged by expert_key_prefix or None, use_data_before_expert_parallelism), DeepSpeed's RuntimeError
    for a malformed entry. ringzero writes no AutoEP layers (it refuses MoE checkpoints), so its folders give None."""
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
