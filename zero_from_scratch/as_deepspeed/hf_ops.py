"""deepspeed.ops.aio's AsyncIOBuilder under the runner: a builder that says async-io is not available here.

    from deepspeed.ops.aio import AsyncIOBuilder         (under python -m zero_from_scratch.as_deepspeed)
    deepspeed.ops.__compatible_ops__[AsyncIOBuilder.NAME]  # False: scripts and test gates take their no-aio path

Scripts and test suites (transformers' `require_deepspeed_aio`, DeepSpeed's own NVMe tests) read the
builder's NAME at import time to ask whether DeepSpeed's async-io C++ op can be built. DeepSpeed answers
False on a machine without libaio; ringzero builds no C++ op at all, so it answers False everywhere
(constants.COMPATIBLE_OPS) and load() raises with the reason. Cost: nothing.
"""
from zero_from_scratch.as_deepspeed.constants import _OpBuilder


class AsyncIOBuilder(_OpBuilder):
    """DeepSpeed's op_builder.AsyncIOBuilder: NAME "async_io"; is_compatible() False, load() refused."""
    NAME = "async_io"
