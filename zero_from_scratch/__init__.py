"""ZeRO-1/2/3 from scratch, driven by DeepSpeed's API and JSON config.

    torchrun --standalone --nproc_per_node 2 -m zero_from_scratch.demo --stage 2
    python -m zero_from_scratch.engine.report --model distilbert --world-size 2      (arithmetic only)
    python -m zero_from_scratch.engine.zero_to_fp32 CKPT_DIR OUT.pt

    engine, optimizer, _, lr_scheduler = zero_from_scratch.initialize(
        model=model, model_parameters=model.parameters(), config="ds_config.json")
    loss = engine(**batch).loss; engine.backward(loss); engine.step()

Files: config.py (JSON → dataclasses), auto.py (DeepSpeed's "auto" and batch arithmetic, shared
with classification), sharding.py (the one layout function), optim.py (Adam on shards, DeepSpeed's
LR schedules), precision.py (bf16/fp16, loss scaler), comm.py (primitives or torch.distributed),
stage1.py / stage2.py / stage3.py (what each stage changes), mpu.py (initialize(mpu=): ZeRO over
the data-parallel group of a tensor-parallel model), engine.py, ledger.py (memory and
communication vs the formulas), checkpoint.py (+ zero_to_fp32.py, atomic.py). Comparing with
DeepSpeed: models.py (tiny models), sides.py (either engine; the only deepspeed import),
parity_harness.py, parity_compare.py, ds_parity.py (CLI).
"""
from zero_from_scratch.engine.checkpoint import CheckpointError, consolidate
from zero_from_scratch.engine.config import load_config
from zero_from_scratch.engine.zero_engine import ZeroEngine, initialize
from zero_from_scratch.engine.external import ZeroExternalParameterError, register_external_parameter
from zero_from_scratch.stage3 import ZeroDivergenceError

__all__ = ["initialize", "ZeroEngine", "load_config", "consolidate", "CheckpointError", "ZeroDivergenceError",
           "register_external_parameter", "ZeroExternalParameterError"]
