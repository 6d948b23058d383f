"""ZeRO parity harnesses: the same run under real DeepSpeed and under zero_from_scratch.

sides.py (either engine; the only module here that imports deepspeed), harness.py, compare.py,
ds_parity.py (CLI), universal_compare.py. Production code never imports this package.
"""
