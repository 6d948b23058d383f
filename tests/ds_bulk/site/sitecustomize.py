"""On PYTHONPATH for the bulk run (tests/ds_bulk/run.py): with RINGZERO_DEEPSPEED=1, every process
(pytest and each rank DeepSpeed's DistributedTest starts) gets `import deepspeed` from ringzero,
as `python -m zero_from_scratch.as_deepspeed` gives a script. Cost: one finder on sys.meta_path."""
import os

if os.environ.get("RINGZERO_DEEPSPEED") == "1":
    from zero_from_scratch.as_deepspeed import finder

    finder.install()
