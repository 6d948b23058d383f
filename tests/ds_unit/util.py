"""DeepSpeed's tests/unit/util.py helper that a ported body uses: no_child_process_in_deepspeed_io.

    python -m pytest -q tests/test_ds_unit_bodies.py

Upstream: deepspeedai/DeepSpeed tests/unit/util.py at commit edaa7221267243c7be7fb49c5d5f5c4fb97b4641
(Apache-2.0, Copyright (c) Microsoft Corporation, DeepSpeed Team), unchanged. Cost: none.
"""
import deepspeed


class no_child_process_in_deepspeed_io:

    def __enter__(self):
        # deepspeed_io defaults to creating a dataloader that uses a
        # multiprocessing pool. Our tests use pools and we cannot nest pools in
        # python. Therefore we're injecting this kwarg to ensure that no pools
        # are used in the dataloader.
        self.old_method = deepspeed.runtime.engine.DeepSpeedEngine.deepspeed_io

        def new_method(*args, **kwargs):
            kwargs["num_local_io_workers"] = 0
            return self.old_method(*args, **kwargs)

        deepspeed.runtime.engine.DeepSpeedEngine.deepspeed_io = new_method

    def __exit__(self, *_):
        deepspeed.runtime.engine.DeepSpeedEngine.deepspeed_io = self.old_method
