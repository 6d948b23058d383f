"""Every key DeepSpeed 0.19.8's config parser accepts, and what the ZeRO engine does with it.

    python -c "from zero_from_scratch.engine.zero_keys import KEY_STATUS; print(len(KEY_STATUS))"

KEY_STATUS: dotted key → "honoured: …" (it acts, with DeepSpeed's meaning), "refused: …" (ValueError
at start-up when the key is set) or "warned: …" (a warning at start-up when set), the text saying what
DeepSpeed would have done. "refused when …"/"warned when …" entries are checked where the value is read
(grad_keys.py, zero_keys.zero_key_notes, offload.py). A section refused or warned as a whole covers
its sub-keys. "Set" means present and asking for something: not null/false/{}/{"enabled": false}, not
DeepSpeed's own default or "off" for that key (SWITCH, OFF: a config that spells a default out runs).
gate() applies the table.
tests/test_config_keys.py walks DeepSpeed's own schema and fails on a key missing here. Cost: a dict walk.
"""
from __future__ import annotations

import difflib
import warnings

H, R, W = "honoured: ", "refused: ", "warned: "
NOT = "not implemented here; DeepSpeed would "
SAME = "same result here; DeepSpeed would "
GONE = "removed from DeepSpeed; 0.19.8 raises DeepSpeedConfigError on it"

TOP = {
    "train_batch_size": H + "train_batch_size = micro × gradient_accumulation × N, as DeepSpeed checks",
    "train_micro_batch_size_per_gpu": H + "as train_batch_size", "gradient_accumulation_steps": H + "as train_batch_size",
    "managed_gradient_accumulation": H + "true (DeepSpeed's default): the engine counts micro-steps to the boundary; false: "
                                     "every step() is the boundary, backward() only accumulates (z_ua_boundary.py)",
    "steps_per_print": H + "when set (wall_clock.py): rank 0 prints DeepSpeed's 'step=…, skipped=…, lr=…, mom=…' line every this many "
                       "optimizer steps (DeepSpeed also prints every 10 when absent; here only when set)",
    "dump_state": H + "rank 0 prints every engine attribute at initialise, as print_configuration (wall_clock.py)",
    "seed": W + "not a DeepSpeed 0.19.8 key (DeepSpeed ignores it); seed torch yourself before building the model",
    "disable_python_gc": W + NOT + "call gc.collect() only every this many steps",
    "disable_allgather": W + SAME + "broadcast updated partitions instead of all-gathering them",
    "communication_data_type": "refused when not the model's dtype: DeepSpeed would reduce gradients in that dtype "
                               "(grad_keys.py)",
    "seq_parallel_communication_data_type": W + NOT + "reduce sequence-parallel gradients in this dtype "
                                            "(no sequence parallelism here)",
    "prescale_gradients": H + "÷ N before the reduction (grad_keys.py); refused at stages 2-3 with reduce_scatter, "
                          "as DeepSpeed asserts",
    "gradient_predivide_factor": H + "÷ f before the reduction, × f/N after (grad_keys.py); refused at stages 2-3 "
                                 "with reduce_scatter, as DeepSpeed asserts",
    "gradient_allreduce_op": H + "mean (÷ N) or sum (grad_keys.py); sum refused at stage 3 as DeepSpeed does",
    "zero_optimization": H + "see its keys", "gradient_clipping": H + "global-norm clipping (clip.py), default 1.0",
    "amp": R + GONE,
    "fp16": H + "see its keys", "bf16": H + "see its keys", "bfloat16": H + "DeepSpeed's older name for bf16",
    "torch_autocast": R + NOT + "run forward under torch.autocast in the given dtype",
    "optimizer": H + "see its keys", "scheduler": H + "see its keys",
    "zero_allow_untested_optimizer": W + SAME + "allow a client optimizer it has not tested with ZeRO",
    "zero_force_ds_cpu_optimizer": W + SAME + "insist on DeepSpeedCPUAdam with CPU offload (its Adam is ours)",
    "activation_checkpointing": H + "activation_checkpointing.py (each key honoured or warned there)",
    "comms_logger": H + "per-collective calls, bytes, latency, algbw/busbw on rank 0 (comms_logger.py)",
    "tensorboard": H + "monitor.py", "csv_monitor": H + "monitor.py",
    "wandb": R + NOT + "log the same scalars to Weights & Biases",
    "comet": R + NOT + "log the same scalars to Comet",
    "flops_profiler": H + "per-module FLOPs/MACs/latency of one forward on rank 0 (flops_profiler.py)",
    "wall_clock_breakdown": H + "fwd/bwd/bwd_inner/bwd_allreduce/step ms per optimizer step on rank 0 (wall_clock.py)",
    "memory_breakdown": W + NOT + "print memory use at points of each step; call engine.memory_report()",
    "autotuning": R + NOT + "search ZeRO stage and micro-batch size by running experiments",
    "elasticity": R + GONE,
    "pipeline": W + "read by the pipeline engine (pipeline_parallel), not by ZeRO",
    "data_efficiency": R + NOT + "sample/route data by curriculum (data efficiency library)",
    "curriculum_learning": R + GONE + " (its home is data_efficiency.data_sampling now)",
    "checkpoint": H + "see its keys",
    "sequence_parallel_size": "honoured when 1; refused when larger (zero_keys.value_notes): DeepSpeed would divide "
                              "the data-parallel size by it (Ulysses); the engine takes sequence parallelism from an mpu",
    "data_types": H + "see its keys",
    "data_types.param_dtype": H + "checked: must be the bf16/fp16 training dtype, as DeepSpeed asserts (mixed_cast.py)",
    "data_types.buffer_dtype": H + "buffers cast to it under bf16/fp16 (default: kept as loaded); fp32 ignores it, as "
                               "DeepSpeed does (mixed_cast.py)",
    "data_types.keep_in_fp32_modules": H + "buffers it names stay fp32 under bf16/fp16 (mixed_cast.py)",
    "data_types.grad_accum_dtype": "honoured when null or the model's dtype, and fp32 under bf16 at stages 1-2 (fp32 "
                                   "gradient buffers, precision.grad_dtype); refused otherwise at stages "
                                   "0-2 (zero_keys.value_notes; stage 0: DeepSpeed raises); warned at stage 3, which "
                                   "ignores it",
    "dataloader_drop_last": W + NOT + "drop the last partial batch of deepspeed_io's loader",
    "aio": W + SAME + "tune asynchronous NVMe I/O (queue depth, block size, threads)",
    "log_level": W + NOT + "set DeepSpeed's logger level",
    "datastates_ckpt": R + NOT + "write checkpoints asynchronously with DataStates",
    "compile": R + NOT + "compile the engine with DeepCompile",
    "compression_training": R + GONE,
    "eigenvalue": R + GONE,
    "expert_parallel": R + NOT + "swap a model's MoE blocks for AutoEP layers sharded over an expert-parallel group "
                       "(deepspeed.moe.layer.MoE is served: moe_params.py)",
    "use_data_before_expert_parallelism": H + "the MoE layers' expert / expert-data-parallel groups take consecutive "
                                          "ranks for data first (moe_params.prepare → expert_groups.py)",
    "hybrid_engine": R + NOT + "switch between training and inference kernels (RLHF)",
    "tensor_parallel": R + NOT + "shard linear layers by AutoTP (use tensor_parallel/ with an mpu)",
    "timers": W + NOT + "time throughput with synchronised timers",
    "vocabulary_size": W + NOT + "pad the vocabulary for tensor-core shapes",
    "weight_quantization": R + NOT + "quantize weights after loading (inference)",
    **{k: R + GONE for k in ("graph_harvesting", "nebula", "progressive_layer_drop", "quantize_training",
                             "sparse_attention", "sparse_gradients")},
}
SUB = {
    "fp16.enabled": H + "fp16 parameters, fp32 master, loss scaling (precision.py)",
    **{f"fp16.{k}": H + "DeepSpeed's dynamic loss scaler, step for step (precision.py)"
       for k in ("loss_scale", "initial_scale_power", "loss_scale_window", "hysteresis", "consecutive_hysteresis",
                 "min_loss_scale")},
    "fp16.auto_cast": "refused when true: DeepSpeed would cast forward's floating inputs to fp16 (grad_keys.py)",
    "fp16.fp16_master_weights_and_grads": R + NOT + "keep master weights and gradients in fp16",
    "bf16.enabled": H + "bf16 parameters, fp32 master (precision.py)", "bfloat16.enabled": H + "as bf16.enabled",
    "bf16.immediate_grad_update": W + SAME + "accumulate into fp32 gradients as each arrives",
    "bf16.check_grad_overflow": H + "false at stages 1-2: a non-finite norm steps, as DeepSpeed (step.py); 0, 3 skip",
    "bf16.bf16_master_weights_and_grads": R + NOT + "keep master weights and gradients in bf16",
    "bf16.bf16_optimizer_states": R + NOT + "keep Adam's m and v in bf16",
    "comms_logger.enabled": H + "comms_logger.py", "comms_logger.prof_all": H + "false + prof_ops: only those",
    "comms_logger.prof_ops": H + "the collectives to list when prof_all is false",
    "comms_logger.verbose": W + NOT + "print every collective as it runs (the table per step is printed instead)",
    "comms_logger.debug": W + NOT + "name the calling function of each collective",
    **{f"flops_profiler.{k}": H + "flops_profiler.py" for k in ("enabled", "profile_step", "module_depth", "detailed",
                                                                "output_file", "recompute_fwd_factor")},
    "flops_profiler.top_modules": W + NOT + "list the top-k modules per depth (every module is listed instead)",
    "optimizer.type": H + "Adam/AdamW in any letter case (other types: engine/optimizers.py when present)",
    "optimizer.params": H + "lr, betas, eps, weight_decay, adam_w_mode, torch_adam, bias_correction; others warned",
    "optimizer.legacy_fusion": W + NOT + "use the legacy fused fp16 optimizer",
    "scheduler.type": H + "WarmupLR, WarmupDecayLR (lr_schedules.py)", "scheduler.params": H + "lr_schedules.py",
    "checkpoint.tag_validation": H + "WARN/IGNORE/FAIL when ranks pass different tags (checkpoint.py::_rank0_tag)",
    "checkpoint.load_universal": H + "load_checkpoint reads DeepSpeed's universal folder (ds_to_universal's) at any N, "
                                 "stages 1-3 (checkpoint_universal.py; stage 0 and model parallelism refused there)",
    "checkpoint.use_node_local_storage": W + SAME + "let each node's rank 0 write to local storage",
    "checkpoint.parallel_write": W + SAME + "write checkpoint files from several ranks in a pipeline",
    "checkpoint.checkpoint_serialization": W + SAME + "choose torch.save's serialisation",
    "checkpoint.writer": W + SAME + "use a faster checkpoint writer (fast / decoupled)",
    **{f"{s}.{k}": H + "monitor.py" for s in ("tensorboard", "csv_monitor") for k in ("enabled", "output_path", "job_name")},
    **{f"activation_checkpointing.{k}": H + "activation_checkpointing.py (warned there where it has no effect)"
       for k in ("partition_activations", "number_checkpoints", "contiguous_memory_optimization",
                 "synchronize_checkpoint_boundary", "profile", "cpu_checkpointing")},
}


def _cov(status: str) -> bool:
    return status.startswith((R, W))


def status(table: dict, key: str) -> str | None:
    """The status that covers a dotted key: its own, or a refused/warned section's above it."""
    if key in table:
        return table[key]
    parts = key.split(".")
    for i in range(len(parts) - 1, 0, -1):
        s = table.get(".".join(parts[:i]))
        if s is not None and _cov(s):
            return s
    return None


# A section DeepSpeed switches on by one key: off (its default) it asks for nothing, whatever else it holds
SWITCH = {**{k: ("enabled", (None, False)) for k in (
    "amp", "torch_autocast", "wandb", "comet", "autotuning", "elasticity", "data_efficiency", "curriculum_learning",
    "datastates_ckpt", "eigenvalue", "expert_parallel", "hybrid_engine", "nebula", "progressive_layer_drop",
    "quantize_training")},
    "tensor_parallel": ("autotp_size", (None, 0, 1)),       # DeepSpeed's engine: AutoTP when autotp_size > 1
    "compile": ("deepcompile", (None, False))}
# A refused key at the value DeepSpeed means as "off" (its default) asks for nothing either
OFF = {"zero_optimization.mics_shard_size": (-1,)}
# Sections DeepSpeed switches on by any of several keys, or by being present at all (zenflow/engine.py)
ANY_OF = {"data_efficiency": (("enabled",), ("data_routing", "random_ltd", "enabled"), ("data_sampling", "enabled"))}
PRESENT = ("zero_optimization.zenflow",)


def _dig(d, path):
    for k in path:
        d = d.get(k) if isinstance(d, dict) else None
    return bool(d)


def is_set(v, key: str = "") -> bool:
    """Present and asking for something: not null/false/{}/{"enabled": false}, not DeepSpeed's "off"
    for the key (OFF, SWITCH), and for a section, some key inside it set."""
    if key in PRESENT:
        return v is not None
    if key in ANY_OF and isinstance(v, dict):
        return any(_dig(v, path) for path in ANY_OF[key])
    if key in SWITCH and isinstance(v, dict):
        k, off = SWITCH[key]
        return v.get(k) not in off
    if v is None or v is False or v == {} or any(v is o or (type(v) is type(o) and v == o) for o in OFF.get(key, ())):
        return False
    if isinstance(v, dict):
        return v.get("enabled") is not False and any(is_set(x, f"{key}.{k}" if key else k) for k, x in v.items())
    return True


def gate(raw: dict, table: dict, aliases: dict | None = None, where: str = "zero_from_scratch") -> set[str]:
    """Raise for the first set key the table refuses, warn once for those it warns; returns the dotted
    keys the table knows (so they are not reported again as unknown)."""
    known, warned = set(), []

    def walk(d, pre):
        for k, v in d.items():
            k = (aliases or {}).get(pre + k, pre + k)
            st = status(table, k)
            if st is None:
                continue
            known.add(k)
            if k in table and GONE in st:        # DeepSpeed raises on the key itself, whatever its value
                raise ValueError(f"config key {k!r} = {v!r} is refused: {st[len(R):]}")
            if k in table and _cov(st) and is_set(v, k):
                if st.startswith(R):
                    raise ValueError(f"config key {k!r} = {v!r} is refused: {st[len(R):]}")
                warned.append(f"{k} = {v!r}: {st[len(W):]}")
            elif isinstance(v, dict) and not _cov(st):
                walk(v, k + ".")
    walk(raw, "")
    if warned:
        warnings.warn(f"{where}: config keys accepted but not acted on: " + "; ".join(warned), stacklevel=3)
    return known


def suggest(key: str, names) -> str:
    """' (did you mean X?)' for a near miss of a known key, else ''."""
    close = difflib.get_close_matches(key.split(".")[-1], sorted(names), n=1)
    return f" (did you mean {close[0]!r}?)" if close else ""


def enabled_section(raw: dict, name: str, keys: set) -> dict | None:
    """An instrument's section when it is switched on ({"enabled": true, ...}), else None; a key it
    does not know is an error naming it, so a misspelt option never passes in silence."""
    s = raw.get(name)
    if not s or not isinstance(s, dict) or not s.get("enabled", False):
        return None
    bad = set(s) - keys
    if bad:
        raise ValueError(f"config keys {sorted(name + '.' + k for k in bad)} are not supported; allowed: {sorted(keys)}")
    return s
