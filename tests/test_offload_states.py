"""engine.offload_states / reload_states as DeepSpeed 0.19.8's (runtime/engine.py, zero/stage_1_and_2.py, stage3.py).

Reference: the same engine trained without the round trip. Offloading every state between a backward
and its step, then reloading, must leave training bit for bit equal (the states come back into the
engine's own tensors; a stale view or a lost byte would change the weights). On this CPU-only machine
host and engine device are one device, so the test checks that the right bytes left: every storage
of each chosen state is 0 bytes while offloaded (and the state's host copies are where
get_state_devices says), the tensor objects are the engine's own before and after; with
offload_optimizer the optimizer states and master stay (DeepSpeed leaves them out); DeepSpeed's
refusals keep its words (stage 0: its optimizer has no offload_states)."""
import pytest
import torch
import torch.nn as nn
from tests.test_zero_no_sync import _data, _model   # the same model and batches

CASES = ((1, "bf16"), (2, "bf16"), (3, "bf16"), (3, "fp32"))


def _cfg(stage, prec, world, **zero):
    cfg = {"train_batch_size": 4 * world, "optimizer": {"type": "Adam", "params": {"lr": 1e-2}},
           "zero_optimization": {"stage": stage, **zero}}
    if prec == "bf16":
        cfg["bf16"] = {"enabled": True}
    return cfg


def _train(e, rank, round_trip):
    """Three steps; with round_trip, every state offloaded and reloaded between backward and step."""
    from zero_from_scratch.engine.offload_states import OffloadStateTypeEnum as S, get_state_devices, state_tensors
    seen = {}
    for i in range(3):
        x, y = _data(i, rank)
        e.backward(nn.functional.mse_loss(e(x.to(e.module[0].weight.dtype)).float(), y))
        if round_trip and i > 0:
            before = {s: [id(t) for t in state_tensors(e, s)] for s in S}
            e.offload_states()
            seen["empty"] = {s.value: [t.untyped_storage().nbytes() for t in state_tensors(e, s)] for s in S}
            seen["devices"] = {s.value: get_state_devices(e, s) for s in S}
            st = e.stage                       # the engine's own attributes, named independently of state_tensors
            named = [e.optimizer.state[0]["exp_avg"], e.optimizer.state[0]["exp_avg_sq"],
                     e.stage.pshard[0] if e.stage_id == 3 else e.module[0].weight,
                     (st.gshard if e.stage_id >= 2 else st.gflat)[0]] + ([e.master[0]] if e.mixed else [])
            seen["named"] = [t.untyped_storage().nbytes() for t in named]
            seen["guarded"] = []
            for call in (lambda: e(x), e.step):   # reading a 0-byte storage would read freed memory
                try:
                    call()
                except RuntimeError as err:
                    seen["guarded"].append(str(err).split(" while")[0])
            e.reload_states()
            seen["same"] = before == {s: [id(t) for t in state_tensors(e, s)] for s in S}
            seen["back"] = all(t.untyped_storage().nbytes() > 0 for s in S for t in state_tensors(e, s))
        e.step()
    from zero_from_scratch.engine.safe_api import safe_get_full_fp32_param, safe_get_full_optimizer_state
    ps = list(e.module.parameters())
    return ([safe_get_full_fp32_param(p) for p in ps], [safe_get_full_optimizer_state(p, "exp_avg_sq") for p in ps],
            seen)


def _run(rank, world):
    import zero_from_scratch
    from zero_from_scratch.engine.offload_states import state_tensors, OffloadStateTypeEnum as S
    out = {}
    for stage, prec in CASES:
        runs = [_train(zero_from_scratch.initialize(model=_model(), config=_cfg(stage, prec, world))[0], rank, rt)
                for rt in (False, True)]
        out[stage, prec] = runs
    # offload_optimizer cpu: DeepSpeed leaves the states already on the host out
    e, *_ = zero_from_scratch.initialize(model=_model(), config=_cfg(2, "bf16", world,
                                                                     offload_optimizer={"device": "cpu"}))
    e.offload_states()
    out["kept"] = {s.value: [t.untyped_storage().nbytes() > 0 for t in state_tensors(e, s)] for s in S}
    e.reload_states()
    errs = []
    for call in (lambda: e.offload_states(device="nvme"),
                 lambda: zero_from_scratch.initialize(model=_model(), config=_cfg(
                     3, "fp32", world, offload_param={"device": "cpu"}))[0].offload_states(),
                 lambda: zero_from_scratch.initialize(model=_model(), config=_cfg(0, "fp32", world))[0].offload_states()):
        try:
            call()
        except (ValueError, AssertionError, AttributeError) as err:
            errs.append(str(err).split(" (")[0])
    out["errs"] = errs
    return out


def test_offload_and_reload_free_the_states_and_leave_training_bit_for_bit(spawn):
    for rank, out in enumerate(spawn(_run, 2)):
        for key in CASES:
            (w0, v0, _), (w1, v1, seen) = out[key]
            assert all(torch.equal(a, b) for a, b in zip(w0, w1)), (rank, key)
            assert all(torch.equal(a, b) for a, b in zip(v0, v1)), (rank, key)
            moved = ["optim_states", "lp_params", "lp_grads"] + (["hp_params"] if key[1] == "bf16" else [])
            for s in moved:                    # every storage of every chosen state left the engine's device
                assert seen["empty"][s] and all(n == 0 for n in seen["empty"][s]), (rank, key, s)
                assert seen["devices"][s] == {torch.device("cpu")}, (rank, key, s)
            assert seen["named"] == [0] * len(seen["named"]), (rank, key)
            assert seen["guarded"] == ["engine.forward()", "engine.step()"], (rank, key)
            assert seen["empty"]["contiguous_grad_buffer"] == [] and seen["same"] and seen["back"], (rank, key)
        kept = out["kept"]
        assert all(kept["optim_states"]) and all(kept["hp_params"]), rank
        assert kept["lp_params"] == [False] * len(kept["lp_params"]) != [], rank
        assert out["errs"] == ["NVMe offload is not supported for offloading states.",
                               "Moving states across devices is not supported for offloaded parameters.",
                               "'ZeroAdam' object has no attribute 'offload_states'"]


if __name__ == "__main__":
    pytest.main([__file__, "-q"])
