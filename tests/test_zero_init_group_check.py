"""zero.Init refuses a process group of one rank under a launcher's WORLD_SIZE > 1 (engine/group_check.py).

    python -m pytest -q tests/test_zero_init_group_check.py

DeepSpeed 0.19.8 raises this in Init.__init__, enabled or not (a size-1 group started before
init_distributed would leave every rank holding the whole model). One process, no torch.distributed
(a world of one): with WORLD_SIZE=2 in the environment Init, enabled or not, raises ringzero's message
(naming init_from_env and the uninitialised case; the runner's Init, DeepSpeed's words); with
WORLD_SIZE 1, unset or unreadable it builds. Two ranks: the default group (the world) partitions each parameter in halves,
and a group of one rank passed explicitly is taken as intended: no error, every parameter whole on
its rank, both equal to the plain constructor under the same seed (the independent reference; exact;
-m slow: the spawn costs seconds, and the world-group half is test_zero_init.py's too).
"""
import pytest
import torch
import torch.distributed as dist
import torch.nn as nn

from zero_from_scratch.engine.zero_init import GatheredParameters, Init
from zero_from_scratch.engine.group_check import contradicting_single_rank_pg_error, refuse_as_deepspeed


def _build(**kw):
    torch.manual_seed(0)
    with Init(dtype=torch.float32, **kw):
        return nn.Linear(6, 5)


def test_one_rank_world_under_a_multirank_launcher_is_refused(monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "2")
    # an earlier test in this worker may have started a one-rank group: the message names that case instead
    case = "a process group of one rank was started" if dist.is_initialized() else "not initialized"
    for enabled in (True, False):
        with pytest.raises(RuntimeError, match=rf"WORLD_SIZE=2.*{case}.*primitives.launch.init_from_env"):
            _build(enabled=enabled)
    with pytest.raises(RuntimeError, match=r"world_size=1.*WORLD_SIZE=2.*deepspeed.init_distributed"):
        refuse_as_deepspeed(None)
    assert not hasattr(nn.Linear(2, 2).weight, "ds_id")          # nothing left patched by the refused Init
    for value in ("1", "", "x"):
        monkeypatch.setenv("WORLD_SIZE", value)
        assert _build().weight.ds_tensor.numel() == 30              # a genuine world of one: whole
    monkeypatch.delenv("WORLD_SIZE")
    assert _build().weight.ds_tensor.numel() == 30
    assert contradicting_single_rank_pg_error(1, object(), {"WORLD_SIZE": "8"}) is None   # explicit group
    assert contradicting_single_rank_pg_error(8, None, {"WORLD_SIZE": "8"}) is None


def _groups(rank, world):
    own = [dist.new_group([r]) for r in range(world)][rank]      # every rank creates every group
    out = {}
    for name, kw in (("world", {}), ("own", {"data_parallel_group": own})):
        m = _build(**kw)
        with GatheredParameters(list(m.parameters())):
            out[name] = (m.weight.ds_tensor.numel(), m.weight.detach().clone(), m.bias.detach().clone())
    return out


@pytest.mark.slow
def test_two_ranks_world_partitions_and_an_explicit_one_rank_group_is_whole(spawn):
    torch.manual_seed(0)
    ref = nn.Linear(6, 5)
    for out in spawn(_groups, 2):
        assert out["world"][0] == 15 and out["own"][0] == 30
        for _, w, b in out.values():
            assert torch.equal(w, ref.weight) and torch.equal(b, ref.bias)
