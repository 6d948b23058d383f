"""Every key DeepSpeed 0.19.8's config parser accepts, and what the PIPELINE engine does with it.

    python -c "from pipeline_parallel.engine.pipe_keys import KEY_STATUS; print(len(KEY_STATUS))"

The JSON goes through the ZeRO engine's parser (zero_from_scratch/engine/config.py), so its table
(zero_from_scratch/engine/zero_keys.py: honoured / refused / warned, same vocabulary) is the
start; OVERRIDES replace the entries whose meaning differs here — a key the ZeRO engine honours
with machinery the pipeline engine does not run is refused or warned at start-up here (gate()
in engine/config.py), never accepted in silence. Cost: a dict walk at initialize.
"""
from __future__ import annotations

from zero_from_scratch.engine.key_status import NOT, SAME, H, R, W
from zero_from_scratch.engine.zero_keys import KEY_STATUS as ZERO_TABLE

PNOT = "not done by the pipeline engine; DeepSpeed's pipeline engine would "

OVERRIDES = {
    "steps_per_print": H + "rank 0 prints DeepSpeed's pipeline line 'steps: N loss: … iter time (s): … samples/sec: …' "
                       "every this many steps (DeepSpeed's default 10; here only when set)",
    "dump_state": W + PNOT + "print every engine attribute at initialise",
    "prescale_gradients": W + SAME + "divide gradients by dp before the all-reduce (here: after; same up to rounding)",
    "gradient_predivide_factor": W + SAME + "divide by f before the all-reduce and f/dp after (here: ÷ dp after)",
    "gradient_allreduce_op": "refused when 'sum': the pipeline engine averages gradients over dp (DeepSpeed would "
                             "sum); 'mean' is honoured",
    "gradient_clipping": H + "global norm over every stage (engine/step.py); pipeline.clip_norm 'stage0' gives "
                         "DeepSpeed's fp32 pipeline rule",
    "comms_logger": W + PNOT + "log each collective; engine.step_bytes holds the bytes sent per axis instead",
    "flops_profiler": W + PNOT + "profile one forward's FLOPs per module",
    "wall_clock_breakdown": W + PNOT + "print fwd/bwd/step times; engine.timeline holds every instruction's time",
    "activation_checkpointing": W + PNOT + "configure deepspeed.checkpointing (partition/cpu activations); here "
                                "PipelineModule(activation_checkpoint_interval=k) checkpoints each stage with "
                                "torch.utils.checkpoint",
    "tensorboard": H + "see its keys", "csv_monitor": H + "see its keys",
    **{f"{s}.{k}": H + "zero_from_scratch/engine/monitor.py: lr, loss_scale (fp16), train_loss, grad_norm, "
       "samples_per_sec per step, on rank 0" for s in ("tensorboard", "csv_monitor") for k in ("enabled", "output_path",
                                                                                              "job_name")},
    "fp16.enabled": H + "16-bit stages, fp32 masters, loss scaling (engine/mixed.py)",
    **{f"fp16.{k}": H + "DeepSpeed's FP16_UnfusedOptimizer scale schedule (engine/mixed.py)"
       for k in ("loss_scale", "initial_scale_power", "loss_scale_window", "min_loss_scale")},
    **{f"fp16.{k}": W + SAME + "ignore it on its unfused fp16 optimizer (torch_adam): no hysteresis on that path"
       for k in ("hysteresis", "consecutive_hysteresis")},
    "bf16.enabled": H + "bf16 stages, fp32 masters (engine/mixed.py)", "bfloat16.enabled": H + "as bf16.enabled",
    "bf16.immediate_grad_update": W + NOT + "accumulate each micro-batch's gradient into fp32 as it arrives "
                                  "(here gradients accumulate in bf16 over the m micro-batches)",
    "optimizer.type": H + "Adam/AdamW (torch, as torch_adam) or Lion (engine/optim.py)",
    "optimizer.params": H + "Adam: lr, betas, eps, weight_decay, adam_w_mode; Lion: lr, betas, weight_decay",
    "dataloader_drop_last": H + "initialize(training_data=…)'s loader drops the last partial micro-batch",
    "pipeline": H + "schedule, virtual_stages, clip_norm (engine/config.py)",
    "zero_optimization": H + "see its keys",
    "zero_optimization.stage": H + "0, or 1: optimizer state sharded over the data axis (engine/zero1.py); 2/3 "
                               "refused as DeepSpeed refuses them with pipeline parallelism",
    "zero_optimization.offload_optimizer": "refused when not stage 1 with device cpu (engine/config.py): DeepSpeed "
                                           "offloads only a ZeRO optimizer; honoured at stage 1 (engine/zero1.py)",
}
# every other zero_optimization key the ZeRO engine acts on has nothing to act on at stage 0
for _k, _v in ZERO_TABLE.items():
    if _k.startswith("zero_optimization.") and _k not in OVERRIDES and not _v.startswith((R, W)) \
            and not _k.startswith("zero_optimization.offload_optimizer."):
        OVERRIDES[_k] = W + "no effect: the pipeline engine's ZeRO-1 (engine/zero1.py) has no buckets, overlap or stage 3"
    if _k.startswith(("activation_checkpointing.", "comms_logger.", "flops_profiler.")) and _k not in OVERRIDES:
        OVERRIDES[_k] = W + PNOT + "act on this key (its section is not run here)"

KEY_STATUS = {**ZERO_TABLE, **OVERRIDES}
# what engine/config.py gates: the overrides; every other key reads as honoured here, so the walk
# reaches nested overrides without repeating the ZeRO parser's own refusals and warnings
GATE_TABLE = {k: (v if k in OVERRIDES else H + "the ZeRO parser's table applies") for k, v in KEY_STATUS.items()}
