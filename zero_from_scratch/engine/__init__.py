"""zero_from_scratch's engine: DeepSpeed's API and config around the textbook ZeRO stages.

zero_engine.py (initialize, ZeroEngine) and step.py (the optimizer step); the stages, subclasses of
the textbook's: stages.py (ZeRO-0/1/2, BucketPool), stage3.py (ZeRO-3) with prefetch.py (trace,
prefetch, reuse, live cap), hpz.py, saved.py (saved weights by reference), divergence.py;
comm.py (primitives or torch.distributed, labelled and asynchronous); config.py / zero_keys.py /
auto.py (JSON, "auto"), mpu.py, lr_schedules.py, precision.py, params.py, monitor.py,
offload.py, checkpoint.py / checkpoint_read.py / atomic.py / zero_to_fp32.py,
frozen.py / external.py / lora.py, activation_checkpointing.py, ledger.py / report.py, demo.py,
models.py (the tiny models every comparison trains). Nothing in the textbook imports this package.
"""
