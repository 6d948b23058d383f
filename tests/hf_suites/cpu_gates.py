"""pytest plugin for the Hugging Face suites' runs (`-p cpu_gates`, tests/hf_suites on PYTHONPATH: run.py).

    python -m tests.hf_suites.run --mode deepspeed tests/deepspeed/test_deepspeed.py   (loads it)

accelerate gates its DeepSpeed tests on having an accelerator (`require_non_cpu`) or several
(`require_multi_device`), transformers its in-process ones on one (`require_torch_accelerator`), its
launched ones on several (`require_torch_multi_accelerator`) and `TrainingArguments(bf16=True)` on a GPU
with bf16; all are skipped or stopped here. This plugin opens those gates before the test files are
imported, so that the tests run on this CPU (fp16 and hub gates stay as they are); whether a case is
compared is decided by what the installed DeepSpeed does with it on the same CPU (tests/hf_suites/table.py).

transformers' launched tests start `accelerate launch --num_processes N` with N its count of devices,
0 for the CPU. The plugin counts the CPU as one device (RINGZERO_HF_CPU_DEVICES, default 1): accelerate
1.15 puts DeepSpeed on several processes only through an accelerator's backend (`PartialState` with
`ACCELERATE_USE_DEEPSPEED` and no accelerator leaves each rank "process 0 of 1" while DeepSpeed's
group has them all, and DeepSpeed stops on "train_batch_size ... != ... * 2"), so one process is what
runs; with 2 the run shows that stop. The model-zoo cases launch transformers' `examples/pytorch`
scripts, which the local copy does not hold: they are skipped with that reason rather than started to
fail on a missing file (UPSTREAM.md says why they would not be compared anyway: every one is fp16).
Cost: nothing at run time.
"""
import os

import accelerate.test_utils.testing as _testing
import pytest
import transformers.testing_utils as _hf_testing
import transformers.training_args as _hf_training_args


def _open(test_case):
    return test_case


_testing.require_non_cpu = _open        # the test files import the names after this plugin has loaded
_testing.require_multi_device = _open
_hf_testing.require_torch_accelerator = _open
_hf_testing.require_torch_multi_accelerator = _open
# TrainingArguments(bf16=True) stops unless a GPU has bf16; DeepSpeed's CPU accelerator does (fp16 stays refused by it)
_hf_training_args.is_torch_bf16_gpu_available = lambda: True
_CPU_DEVICES = int(os.environ.get("RINGZERO_HF_CPU_DEVICES", "1"))
if hasattr(_hf_testing, "BACKEND_DEVICE_COUNT"):
    _hf_testing.BACKEND_DEVICE_COUNT["cpu"] = lambda: _CPU_DEVICES


def pytest_runtest_setup(item):
    """A model-zoo case whose `examples/pytorch` script is absent from the copy: skipped, saying so."""
    if item.name.startswith("test_zero_to_fp32"):
        examples = os.path.join(str(item.config.rootpath), "examples", "pytorch")
        if not os.path.isdir(examples):
            pytest.skip("launches transformers' examples/pytorch scripts, not in the local copy (tests/hf_suites/UPSTREAM.md)")
