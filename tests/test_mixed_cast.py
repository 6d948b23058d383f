"""bf16 training casts parameters, not buffers (DeepSpeed 0.19.8's rule, engine/mixed_cast.py): 2 ranks
against a one-process model cast by hand; data_types.buffer_dtype / keep_in_fp32_modules / param_dtype."""
import pytest
import torch

BASE = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 1, "bf16": {"enabled": True},
        "optimizer": {"type": "Adam", "params": {"lr": 1e-3}}}


class Rotary(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(8, 8)
        self.register_buffer("inv_freq", torch.linspace(1.0, 1.5, 8, dtype=torch.float32))
        self.register_buffer("keep_bias", torch.full((8,), 0.25, dtype=torch.bfloat16))

    def forward(self, x):      # an fp32 buffer beside bf16 weights: the model casts where it uses it
        return self.lin(x * self.inv_freq.to(x.dtype)).float().pow(2).mean()


def _ranks(rank, world):
    import zero_from_scratch
    out = {}
    for stage in (0, 3):
        torch.manual_seed(0)
        model = Rotary()
        ref = Rotary()
        ref.load_state_dict(model.state_dict())
        for p in ref.parameters():          # the reference: DeepSpeed's cast written out (parameters only)
            p.data = p.data.to(torch.bfloat16)
        engine, *_ = zero_from_scratch.initialize(model=model, config={**BASE, "zero_optimization": {"stage": stage}})
        x = torch.randn(2, 8, generator=torch.Generator().manual_seed(1)).to(torch.bfloat16)
        loss = engine(x)
        engine.backward(loss)
        engine.step()
        out[stage] = (engine.module.inv_freq.dtype, engine.module.keep_bias.dtype, engine._config.buffer_dtype,
                      loss.item(), ref(x).item(), {p.dtype for p in engine.module.parameters()})
    cfg = {**BASE, "data_types": {"buffer_dtype": "bf16", "keep_in_fp32_modules": ["keep_*"]}}
    engine, *_ = zero_from_scratch.initialize(model=Rotary(), config=cfg)
    out["opt_in"] = (engine.module.inv_freq.dtype, engine.module.keep_bias.dtype)
    return out


def test_buffers_keep_their_dtype_and_forward_matches_a_one_process_cast(spawn):
    for out in spawn(_ranks, 2):
        for stage in (0, 3):
            inv_freq, keep, buffer_dtype, loss, ref_loss, dtypes = out[stage]
            assert (inv_freq, keep, buffer_dtype, dtypes) == (torch.float32, torch.bfloat16, None, {torch.bfloat16})
            assert loss == ref_loss          # same weights, same bf16 forward: bit for bit
        # buffer_dtype casts every buffer but the ones keep_in_fp32_modules names, which go (back) to fp32
        assert out["opt_in"] == (torch.bfloat16, torch.float32)


def test_param_dtype_must_be_the_training_dtype_and_keep_list_is_checked():
    from zero_from_scratch.engine.config import load_config
    from zero_from_scratch.engine.mixed_cast import cast_model
    with pytest.raises(AssertionError, match="data_types.param_dtype='fp16' conflicts with the enabled precision mode"):
        cast_model(Rotary(), {"data_types": {"param_dtype": "fp16"}}, torch.bfloat16)
    cast_model(m := Rotary(), {"data_types": {"param_dtype": "bf16"}}, torch.bfloat16)
    assert m.lin.weight.dtype == torch.bfloat16 and m.inv_freq.dtype == torch.float32
    with pytest.raises(ValueError, match="keep_in_fp32_modules must be \"auto\" or a list"):
        load_config({**BASE, "data_types": {"keep_in_fp32_modules": "inv_freq"}}, world_size=1)


def test_fp32_warns_that_buffer_dtype_is_ignored_and_the_default_says_nothing():
    import warnings
    from zero_from_scratch.engine.mixed_cast import cast_model
    with pytest.warns(UserWarning, match="ignored in fp32"):
        cast_model(m := Rotary(), {"data_types": {"buffer_dtype": "bf16"}}, torch.float32)
    assert m.inv_freq.dtype == torch.float32                  # DeepSpeed casts nothing in fp32
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        cast_model(Rotary(), {}, torch.float32)
