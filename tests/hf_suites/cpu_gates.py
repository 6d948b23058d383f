"""pytest plugin for the Hugging Face suites' runs (`-p tests.hf_suites.cpu_gates`, tests/hf_suites/run.py).

    python -m tests.hf_suites.run --mode deepspeed tests/deepspeed/test_deepspeed.py   (loads it)

accelerate gates its DeepSpeed tests on having an accelerator (`require_non_cpu`) or several
(`require_multi_device`), and skips them here. This plugin opens those two gates before the test files
are imported, so that every test runs on this CPU (fp16 and hub gates stay as they are); whether a case
is compared is decided by what the installed DeepSpeed does with it on the same CPU (tests/hf_suites/table.py).
Cost: nothing at run time.
"""
import accelerate.test_utils.testing as _testing


def _open(test_case):
    return test_case


_testing.require_non_cpu = _open        # the test files import the names after this plugin has loaded
_testing.require_multi_device = _open
