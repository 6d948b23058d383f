"""On PYTHONPATH for the Hugging Face suites' runs (tests/hf_suites/run.py): every process they start, pytest
and each process `accelerate launch` or `torchrun` starts, runs this at interpreter start.

    python -m tests.hf_suites.run      (puts this folder first on PYTHONPATH)

It runs the bulk run's sitecustomize (tests/ds_bulk/site: with RINGZERO_DEEPSPEED=1, `import deepspeed`
from ringzero), then, with RINGZERO_HF_CPU_GATES=1, opens in the launched scripts the one gate
cpu_gates.py opens in pytest for them: `TrainingArguments(bf16=True)` stops unless a GPU has bf16, and
DeepSpeed's CPU accelerator runs bf16. The gate is opened when `transformers.training_args` is first
imported (an import hook), so a process that never imports transformers pays nothing.
Cost: one finder on sys.meta_path.
"""
import importlib.abc
import os
import runpy
import sys

runpy.run_path(os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))),
                            "ds_bulk", "site", "sitecustomize.py"))

_TARGET = "transformers.training_args"


class _OpenBf16Gate(importlib.abc.MetaPathFinder):
    """After transformers.training_args executes, its bf16-needs-a-GPU check answers yes (as in cpu_gates.py)."""

    def find_spec(self, name, path, target=None):
        if name != _TARGET:
            return None
        sys.meta_path.remove(self)
        try:
            import importlib.util
            spec = importlib.util.find_spec(name)
        finally:
            sys.meta_path.insert(0, self)
        if spec is None or spec.loader is None:
            return spec
        run = spec.loader.exec_module

        def exec_module(module):
            run(module)
            module.is_torch_bf16_gpu_available = lambda: True

        spec.loader.exec_module = exec_module
        return spec


if os.environ.get("RINGZERO_HF_CPU_GATES") == "1":
    sys.meta_path.insert(0, _OpenBf16Gate())
