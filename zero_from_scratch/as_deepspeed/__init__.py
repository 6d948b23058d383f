"""Bring your own DeepSpeed script: run it unchanged, with `import deepspeed` served by ringzero.

    python -m zero_from_scratch.as_deepspeed SCRIPT [ARGS...]
    torchrun --nproc_per_node 2 -m zero_from_scratch.as_deepspeed SCRIPT [ARGS...]
    deepspeed --num_gpus 2 --module zero_from_scratch.as_deepspeed SCRIPT [ARGS...]
    python -m zero_from_scratch.as_deepspeed --list          (what is served, what is refused)

SCRIPT runs as __main__ (runpy) with sys.argv = [SCRIPT, ARGS...] (the deepspeed launcher's
--local_rank=N handed on first). `deepspeed` and its submodules are ServedModules (finder.py)
whose names resolve through one table (served.py) to ringzero's engines; the installed DeepSpeed
package is never imported. The API followed is DeepSpeed 0.19.8's; what is not served fails at
first use with one line: the API, what DeepSpeed would have done, the nearest ringzero way.
Files: served.py (the table), finder.py (the import machinery and the not-served errors),
top.py (initialize, init_distributed, add_config_arguments), comm.py (deepspeed.comm over
primitives), accelerator.py (get_accelerator, the pin-memory tracker), constants.py (DeepSpeed's enums
and constants, the checkpoint keys), utils.py (logger, log levels, log_dist, set_random_seed, the runtime
helpers), more_layout.py (ZeRO-1/2's flat buffers, IPGBucket), zero_to_fp32.py
(deepspeed.utils.zero_to_fp32 over ringzero's checkpoints),
__main__.py (the command line). Cost: the import of each served name on first use.
"""
