"""DeepSpeed's default activation checkpointing is reentrant; the runner makes it its default.

    python -m pytest -q tests/test_ds_reentrant.py

deepspeed.checkpointing.checkpoint under the runner is torch's reentrant checkpoint (DeepSpeed's
CheckpointFunction); a block none of whose inputs requires grad (token ids) runs non-reentrant with a
warning, where DeepSpeed's would leave the block's parameters without gradients. The runner spells
pipeline.use_reentrant true into a PipelineModule's config (ringzero's own entry keeps torch's
non-reentrant default); the pipeline engine then marks stage 0's floating inputs as requiring grad.
Checked against the block run without checkpointing: same output, same parameter gradients.
"""
import warnings

import pytest
import torch
import torch.nn as nn

from pipeline_parallel.engine.ds_pipe import _deepspeed_pipeline_keys
from pipeline_parallel.engine.module import PipelineModule
from zero_from_scratch.as_deepspeed import checkpointing as ds_checkpointing
from zero_from_scratch.as_deepspeed import quirks


def _grads(block, x, ckpt):
    block.zero_grad()
    y = ckpt(block, x) if ckpt else block(x)
    y.sum().backward()
    return y.detach(), [p.grad.clone() for p in block.parameters()]


@pytest.mark.parametrize("needs_grad", [True, False])
def test_reentrant_checkpoint_matches_the_plain_block(needs_grad):
    torch.manual_seed(0)
    block = nn.Sequential(nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 2))
    x = torch.randn(3, 4, requires_grad=needs_grad)
    want = _grads(block, x, None)
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        y = ds_checkpointing.checkpoint(block, x)
        got = _grads(block, x, ds_checkpointing.checkpoint)
    reentrant = type(y.grad_fn).__name__ == "CheckpointFunctionBackward"
    assert reentrant == needs_grad                           # reentrant where it can be, DeepSpeed's default
    assert any("non-reentrant" in str(m.message) for m in w) == (not needs_grad)
    assert torch.equal(got[0], want[0]) and all(torch.allclose(g, h, atol=1e-7) for g, h in zip(got[1], want[1]))
    assert ds_checkpointing.non_reentrant_checkpoint is not ds_checkpointing.checkpoint


def test_the_runner_spells_out_use_reentrant_and_the_pipeline_honours_it():
    c = quirks.pipeline_defaults({"train_batch_size": 2, "pipeline": {"activation_checkpoint_interval": 1}})
    assert c["pipeline"]["use_reentrant"] is True
    assert quirks.pipeline_defaults({"pipeline": {"use_reentrant": False}})["pipeline"]["use_reentrant"] is False
    for cfg, want in (({"pipeline": {"use_reentrant": True}}, ds_checkpointing.checkpoint), ({}, None),
                      ({"pipeline": {"use_reentrant": False}}, ds_checkpointing.non_reentrant_checkpoint)):
        model = PipelineModule([nn.Linear(2, 2), nn.Linear(2, 2)], num_stages=1)
        _deepspeed_pipeline_keys(model, cfg)
        assert model.activation_checkpoint_func is want      # None: ringzero's own default, non-reentrant
