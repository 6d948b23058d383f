"""zero_optimization keys: what each does in this engine, the overlap/prefetch keys' values, and
the warnings for keys accepted only for DeepSpeed compatibility.

    python -c "from zero_from_scratch.engine.zero_keys import ZERO_KEYS; print(*ZERO_KEYS, sep='\\n')"
"""
from __future__ import annotations

import torch

from zero_from_scratch.engine.key_status import GONE, NOT, SAME, SUB, TOP, H, R, W   # the table's vocabulary
from zero_from_scratch.engine.mixed_cast import NAMES     # DeepSpeed's DtypeEnum spellings
from zero_from_scratch.engine.precision import fp32_accum


def offloads(z: dict) -> list[str]:
    """The zero_optimization keys that turn offload on, spelled as DeepSpeed accepts them: a dict
    with device "cpu"/"nvme" (absent, null, {} or device "none" is off), or the deprecated
    cpu_offload / cpu_offload_param booleans."""
    on = []
    for k in ("offload_optimizer", "offload_param"):
        v = z.get(k)
        if isinstance(v, dict) and v and str(v.get("device", "none")).lower() != "none":
            on.append(f"zero_optimization.{k}.device={v.get('device')!r}")
        elif v not in (None, {}, False) and not isinstance(v, dict):
            on.append(f"zero_optimization.{k}={v!r}")
    on += [f"zero_optimization.{k}=true" for k in ("cpu_offload", "cpu_offload_param") if z.get(k)]
    return on


# Every zero_optimization key this engine accepts, and what it does HERE. "honoured" keys change
# behaviour as written; the others are accepted for DeepSpeed compatibility and produce a warning
# at initialise (zero_key_notes) saying what DeepSpeed would have done, whenever the user sets them
# to something that would matter.
ZERO_KEYS = {
    "overlap_comm": "honoured: stages 1-3 launch each gradient bucket's reduce-scatter from the gradient "
                    "hooks on a background thread while backward goes on, and wait at the end of backward; "
                    "stage 3 also prefetches (all-gathers ahead) the next modules' parameters",
    "contiguous_gradients": "honoured (stages 2-3): true = gradients are copied as they arrive into "
                            "preallocated bucket buffers reused every micro-batch (1, or 2 with overlap_comm, "
                            "more only if backward interleaves buckets); false = a fresh bucket per unit, freed "
                            "after its reduce-scatter. Stage 1 always keeps one flat full-size gradient buffer",
    "reduce_bucket_size": "honoured (stages 0-2): elements per gradient bucket = unit of reduce-scatter and "
                          "all-gather. Stage 3 reduces per module instead (warned if set)",
    "reduce_scatter": "honoured (stages 1-2): false = all-reduce each bucket and keep this rank's block "
                      "(2x the bytes, same result)",
    "stage3_prefetch_bucket_size": "honoured (stage 3 with overlap_comm): elements of upcoming modules kept "
                                   "gathered or in flight ahead of the running one; 0 = no prefetch",
    "stage3_max_live_parameters": "honoured (stage 3): gathered + in-flight elements never exceed this, except "
                                  "when one module alone needs more (then only that module is live)",
    "stage3_max_reuse_distance": "honoured (stage 3): after forward, a module's parameters stay gathered if the "
                                 "traced order uses them again within this many elements (e.g. last layer's "
                                 "forward → its backward); 0 = always release",
    "stage3_param_persistence_threshold": "honoured (stage 3): a module unit of at most this many elements is "
                                          "gathered once per optimizer step and kept (no re-gather in backward)",
}


def zero_overlap_keys(z: dict, resolved: dict) -> dict:
    """ZeroConfig keyword arguments for the overlap / prefetch keys of zero_optimization `z`."""
    out = {"overlap_comm": bool(z.get("overlap_comm", False)),
           "contiguous_gradients": bool(z.get("contiguous_gradients", True)),
           "reduce_scatter": bool(z.get("reduce_scatter", True)),
           "explicit": tuple(sorted(z))}
    for k, default in (("stage3_prefetch_bucket_size", 50_000_000), ("stage3_param_persistence_threshold", 100_000),
                       ("stage3_max_live_parameters", 1_000_000_000), ("stage3_max_reuse_distance", 1_000_000_000)):
        v = z.get(k, default)
        out[k] = default if v == "auto" else v      # "auto" here means DeepSpeed's default
    return out


def zero_key_notes(raw_zero: dict, zero) -> list[str]:          # zero: a config.ZeroConfig
    """Warnings for keys accepted but not (fully) acted on, each saying what DeepSpeed would do."""
    st, notes = zero.stage, []
    setk = set(zero.explicit)

    def note(key, msg):
        notes.append(f"zero_optimization.{key} = {raw_zero.get(key)!r}: {msg}")
    if st == 3 and "reduce_bucket_size" in setk:
        note("reduce_bucket_size", "not used at stage 3 (gradients are reduce-scattered one module at a time); "
             "DeepSpeed would batch several modules' gradients into buckets of this many elements")
    if st in (1, 2) and "allgather_bucket_size" in setk and zero.allgather_bucket_size != zero.reduce_bucket_size:
        note("allgather_bucket_size", "not used: updated shards are all-gathered one reduce bucket at a time "
             "(reduce_bucket_size); DeepSpeed would all-gather in pieces of this many elements (same result)")
    if raw_zero.get("allgather_partitions") is False:
        note("allgather_partitions", "not used: shards are always all-gathered; DeepSpeed would broadcast each "
             "rank's partition instead (same result, different traffic)")
    if raw_zero.get("round_robin_gradients"):
        note("round_robin_gradients", "no effect: DeepSpeed uses it only to spread gradient copies to CPU offload")
    if "sub_group_size" in setk and not offloads(raw_zero):   # with offload it bounds the step's chunks
        note("sub_group_size", "not used: the optimizer steps every shard in 4 Mi-element chunks; DeepSpeed would "
             "step ZeRO-3 shards in sub-groups of this many elements")
    if st != 3 and raw_zero.get("stage3_gather_16bit_weights_on_model_save"):
        note("stage3_gather_16bit_weights_on_model_save", f"no effect at stage {st} (stage 3 only): save_16bit_model "
             "writes the whole state_dict anyway, as DeepSpeed does")
    if st != 3:
        for k in ZERO_KEYS:
            if k.startswith("stage3_") and k in setk:
                note(k, f"no effect at stage {st} (stage 3 only)")
    elif not zero.overlap_comm and "stage3_prefetch_bucket_size" in setk and zero.stage3_prefetch_bucket_size:
        note("stage3_prefetch_bucket_size", "not used without overlap_comm: parameters are gathered when needed; "
             "DeepSpeed would prefetch this many elements ahead (set overlap_comm: true)")
    if st in (0, 3) and raw_zero.get("reduce_scatter") is False:
        note("reduce_scatter", f"no effect at stage {st}")
    if st == 1 and raw_zero.get("contiguous_gradients") is False:
        note("contiguous_gradients", "no effect at stage 1: the full gradient lives in one flat buffer")
    return notes


# The rest of zero_optimization, as DeepSpeed 0.19.8's DeepSpeedZeroConfig accepts it (key_status.py's words)
ZERO_STATUS = {
    **ZERO_KEYS,                                       # each "honoured…: what it does here"
    "stage": H + "0-3 (stages.py, stage3.py)",
    "allgather_bucket_size": "warned when it differs from reduce_bucket_size at stages 1-2 (zero_key_notes)",
    "allgather_partitions": "warned when false (zero_key_notes)",
    "round_robin_gradients": "warned when true (zero_key_notes)",
    "sub_group_size": H + "with offload_optimizer: elements per step chunk (at most 2^20); warned otherwise (zero_key_notes)",
    "stage3_gather_16bit_weights_on_model_save": H + "stage 3: save_16bit_model gathers the full model-dtype "
                                                 "state_dict on rank 0 (surface.py); false: it saves nothing",
    "stage3_gather_fp16_weights_on_model_save": H + "the older name of stage3_gather_16bit_weights_on_model_save",
    "zero_hpz_partition_size": H + "ZeRO++ hpZ secondary shards (hpz.py)",
    "offload_optimizer": H + "device cpu/nvme, nvme_path, pin_memory (offload.py; transfer tuning keys warned there); "
                         "nvme at stage 3 keeps the gradient shards in files too (param_offload.make_grads)",
    **{f"offload_optimizer.{k}": H + "offload.py" for k in ("device", "nvme_path", "pin_memory")},
    **{f"offload_optimizer.{k}": "warned when set: tunes CUDA/AIO transfers (offload.py)"
       for k in ("buffer_count", "fast_init", "ratio", "pipeline_read", "pipeline_write")},
    "offload_optimizer.super_offload": R + NOT + "run the CPU optimizer step overlapped (SuperOffload)",
    "offload_optimizer.cpuadam_cores_perc": W + "DeepSpeed reads it only with super_offload (refused here) to pin "
                                            "CPU Adam to this share of cores",
    "offload_param": H + "stage 3: parameter shards on the host or in files (param_offload.py); refused at stages 0-2",
    **{f"offload_param.{k}": H + "param_offload.py" for k in ("device", "nvme_path", "pin_memory")},
    "offload_param.buffer_count": H + "shards held in buffers at once (param_offload.py)",
    "offload_param.buffer_size": H + "elements per buffer; a larger unit shard is refused (param_offload.py)",
    "offload_param.max_in_cpu": H + "nvme: shard elements kept in host memory, the rest in files (param_offload.py)",
    "cpu_offload": "refused when true: DeepSpeed's old spelling of offload_optimizer cpu",
    "cpu_offload_param": "refused when true: DeepSpeed's old spelling of offload_param cpu (use offload_param)",
    "cpu_offload_use_pin_memory": W + SAME + "pin the old cpu_offload's buffers",
    "use_multi_rank_bucket_allreduce": W + SAME + "all-reduce buckets spanning several owners at once",
    "compute_grad_norm": W + "the global norm is always computed here; DeepSpeed would skip it when false and unclipped",
    "load_from_fp32_weights": W + SAME + "load the fp32 master from the checkpoint's fp32 copy (we always do)",
    "elastic_checkpoint": W + SAME + "save optimizer state re-partitionable to another N",
    "zenflow": R + NOT + "update only the top-k gradient columns on GPU and the rest on CPU (ZenFlow)",
    "stage3_model_persistence_threshold": W + NOT + "cap the total elements kept persistent at stage 3",
    "stage3_module_granularity_threshold": H + "stage 3: the first module top-down whose elements per layer are at "
                                           "or under it is a ZeRO-3 leaf, gathered whole (leaf.py set_by_granularity)",
    "stage3_use_all_reduce_for_fetch_params": W + SAME + "fetch parameters with all-reduce instead of all-gather",
    "stage3_allgather_sequential": W + SAME + "all-gather parameters one at a time",
    "ignore_unused_parameters": H + "false at stages 1-2 with offload_optimizer: the step asserts, as DeepSpeed's, that "
                                "every trainable parameter of this rank's shards had a gradient this step "
                                "(unused_params.py); "
                                "elsewhere DeepSpeed checks nothing either (an unused parameter's gradient is 0)",
    "legacy_stage1": W + SAME + "use the old stage-1 implementation",
    "parameter_alignment": W + SAME + "pad each partition to this many elements",
    "zero_quantized_weights": H + "stage 3: ZeRO++ qwZ, weights all-gathered as block-wise int8 (qwz.py); "
                              "warned at other stages (zeropp.py)",
    "zero_quantized_nontrainable_weights": R + NOT + "keep frozen weights int8-quantized",
    "zero_quantized_gradients": H + "stage 3: ZeRO++ qgZ, gradients reduced by int4 all-to-alls, intra- then "
                                "inter-node (qgz.py); warned at other stages (zeropp.py)",
    "memory_efficient_linear": H + "under the runner, true (DeepSpeed's default) puts DeepSpeed's ZeRO-3 Linear "
                               "function in place of F.linear and false keeps torch's (as_deepspeed/z3lin_linear.py); "
                               "ringzero's own engine saves a gathered weight by reference either way (saved.py)",
    "pipeline_loading_checkpoint": W + SAME + "load checkpoints for the pipeline engine at stage 3",
    "override_module_apply": W + SAME + "gather parameters around module.apply",
    "log_trace_cache_warnings": W + SAME + "log stage-3 trace-cache invalidations",
    "enable_sanity_checks": W + SAME + "check stage-3 parameter states (slow)",
    "save_muon_momentum_buffer_in_memory": W + SAME + "keep Muon's momentum buffer on the device",
    "leaf_module": H + "classes / names / name_suffixes flag ZeRO-3 leaf modules, each gathered whole (leaf.py)",
    **{f"leaf_module.{k}": H + f"modules flagged as ZeRO-3 leaves by {what} (leaf.py)"
       for k, what in (("classes", "class name"), ("names", "name"), ("name_suffixes", "name suffix"))},
    "mics_shard_size": R + GONE + " (MiCS: shard within groups of this many ranks; -1, its old default, is off)",
    "mics_hierarchical_params_gather": R + GONE + " (MiCS)",
    "zeropp_loco_param": R + GONE + " (LoCo error feedback for qgZ)",
}
# The keys initialize's client-object paths read (client_optim.py, dataloader.py), and the sections' new types
SURFACE_STATUS = {
    "zero_allow_untested_optimizer": H + "required, as DeepSpeed asserts, for an optimizer outside ZeRO's tested list "
                                     "(SGD) at stages 1-3 (client_optim.py)",
    "zero_force_ds_cpu_optimizer": H + "true (default): offload_optimizer with a client optimizer other than "
                                   "DeepSpeedCPUAdam is refused, as DeepSpeed raises (client_optim.py)",
    "dataloader_drop_last": H + "drop_last of initialize(training_data=)'s loader (dataloader.py)",
    "optimizer.type": H + "Adam/AdamW/Lion/Adagrad in any letter case, SGD (client_optim.py, optimizers.py); other "
                      "torch.optim names refused",
    "optimizer.params": H + "each class's own arguments (client_optim.DEFAULTS), torch_adam/adam_w_mode/bias_correction "
                        "for Adam; foreach/fused/differentiable/capturable accepted (same maths); another class's "
                        "argument refused (DeepSpeed's constructor call would raise TypeError); unknown names warned",
    "scheduler.type": H + "lr_schedules.VALID_LR_SCHEDULES; torch.optim.lr_scheduler names refused",
    "scheduler.params": H + "each schedule's own arguments (lr_schedules.py)",
}
KEY_STATUS = {**TOP, **SUB, **SURFACE_STATUS, **{f"zero_optimization.{k}": v for k, v in ZERO_STATUS.items()}}

# deepspeed.initialize's arguments (DeepSpeed 0.19.8's signature) and what zero_from_scratch.initialize does with each
INITIALIZE_ARGS = {
    "args": H + "args.deepspeed_config (or deepscale_config) when no config is passed; args.local_rank written back",
    "model": H + "the nn.Module to wrap (required)",
    "optimizer": H + "a torch.optim.Adam/AdamW/SGD/Adagrad or FusedAdam/DeepSpeedCPUAdam/FusedLion/DeepSpeedCPULion "
                     "object, or a callable of the parameters; its param groups drive the shards (client_optim.py)",
    "model_parameters": H + "parameters or param groups (params.py)",
    "training_data": H + "a Dataset → DeepSpeed's distributed loader, the third returned value (dataloader.py)",
    "lr_scheduler": H + "an object with step(), or a callable of the optimizer; replaces the config's (surface.py)",
    "distributed_port": H + "MASTER_PORT when initialize starts torch.distributed and none is set (surface.py)",
    "mpu": H + "the model-parallel unit: ZeRO over its data-parallel group (mpu.py)",
    "dist_init_required": H + "False: never start torch.distributed; None/True: start it when nobody did",
    "collate_fn": H + "the training loader's collate_fn",
    "config": H + "a DeepSpeed JSON path or dict (config.py)",
    "mesh_param": R + NOT + "build a data × sequence parallel device mesh (use mpu=)",
    "config_params": H + "the same as config (accelerate passes this name)",
}


def value_notes(raw: dict, dtype: str, stage: int) -> str | None:
    """sequence_parallel_size, and data_types.grad_accum_dtype against what the engine does: gradients
    accumulate in the model's dtype, or in fp32 under bf16 at stages 1-2. A refusal
    raises; a value DeepSpeed ignores returns the note."""
    sp = raw.get("sequence_parallel_size", 1)
    if sp != 1:
        raise ValueError(f"config key 'sequence_parallel_size' = {sp!r} is refused: not implemented here without an mpu; "
                         "DeepSpeed would divide the data-parallel size by it (Ulysses sequence parallelism); pass "
                         "initialize(mpu=...) with the sequence-parallel groups (mpu.py)")
    want = (raw.get("data_types") or {}).get("grad_accum_dtype")
    names = {"fp32": NAMES[torch.float32], "fp16": NAMES[torch.float16], "bf16": NAMES[torch.bfloat16]}
    if want is None or want in names[dtype]:
        return None
    if fp32_accum(raw, dtype == "bf16", stage):
        return None                    # fp32 gradient buffers, as DeepSpeed's (precision.grad_dtype)
    if stage == 3:
        return (f"data_types.grad_accum_dtype = {want!r}: DeepSpeed's ZeRO-3 ignores it (gradients accumulate in the "
                f"model's {dtype}), as here")
    raise ValueError(f"config key 'data_types.grad_accum_dtype' = {want!r} is refused with {dtype} at ZeRO stage {stage}: "
                     "not implemented here (gradients accumulate in the model's dtype); DeepSpeed would "
                     + ("raise NotImplementedError (stage 0 accumulates in the model's dtype only)" if stage == 0 else
                        "accumulate gradients in that dtype (served here only for bf16 with fp32 at stages 1-2)")
                     + "; drop the key or set it null")
