"""zero_from_scratch's engine: DeepSpeed's API and config around the textbook ZeRO stages.

zero_engine.py (initialize, ZeroEngine), config.py / auto.py (JSON, "auto"), mpu.py, monitor.py,
offload.py / offload_cpu.py, checkpoint.py / atomic.py / zero_to_fp32.py, prefetch.py, hpz.py,
frozen.py / external.py, activation_checkpointing.py, precision.py, params.py, ledger.py / report.py,
models.py (the tiny models every comparison trains). Nothing in the textbook imports this package.
"""
