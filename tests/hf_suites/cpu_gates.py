"""pytest plugin for the Hugging Face suites' runs (`-p cpu_gates`, tests/hf_suites on PYTHONPATH: run.py).

    python -m tests.hf_suites.run --mode deepspeed tests/deepspeed/test_deepspeed.py   (loads it)

accelerate gates its DeepSpeed tests on having an accelerator (`require_non_cpu`) or several
(`require_multi_device`), transformers its in-process ones on one (`require_torch_accelerator`) and
`TrainingArguments(bf16=True)` on a GPU with bf16; all are skipped or stopped here. This plugin opens
those gates before the test files are imported, so that the tests run on this CPU (fp16 and hub gates
stay as they are; transformers' `require_torch_multi_accelerator` stays shut: those tests launch scripts
the local copy lacks); whether a case is compared is decided by what the installed DeepSpeed does with
it on the same CPU (tests/hf_suites/table.py).
Cost: nothing at run time.
"""
import accelerate.test_utils.testing as _testing
import transformers.testing_utils as _hf_testing
import transformers.training_args as _hf_training_args


def _open(test_case):
    return test_case


_testing.require_non_cpu = _open        # the test files import the names after this plugin has loaded
_testing.require_multi_device = _open
_hf_testing.require_torch_accelerator = _open
# TrainingArguments(bf16=True) stops unless a GPU has bf16; DeepSpeed's CPU accelerator does (fp16 stays refused by it)
_hf_training_args.is_torch_bf16_gpu_available = lambda: True
