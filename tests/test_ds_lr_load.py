"""WarmupLR / WarmupDecayLR after load_state_dict under the runner, against DeepSpeed 0.19.8's classes.

    python -m pytest -q tests/test_ds_lr_load.py          # ~5 s (imports DeepSpeed)

Three steps, save the scheduler's state, load it into a fresh scheduler over a fresh optimizer: DeepSpeed's
get_last_lr() and the group's lr keep their construction values until the next step (its load_state_dict
sets only last_batch_iteration); the runner's engine scheduler (quirks.lr_on_load) does the same, and the
next step gives both the same lr (exact: the same arithmetic, warmup_gamma). ringzero's own scheduler sets
the loaded step's lr at once.
"""
import types

import pytest
import torch

from zero_from_scratch.as_deepspeed import quirks
from zero_from_scratch.engine import lr_schedules as rz

KW = {"warmup_min_lr": 0.01, "warmup_max_lr": 0.1, "warmup_num_steps": 10}


def _opt():
    return torch.optim.SGD([torch.nn.Parameter(torch.zeros(2))], lr=0.5)


def _run(cls, decay, fix=None):
    kw = {**KW, "total_num_steps": 20} if decay else KW
    s = cls(_opt(), **kw)
    for _ in range(3):
        s.step()
    sd = s.state_dict()
    t = cls(_opt(), **kw)
    if fix:
        fix(types.SimpleNamespace(lr_scheduler=t))
    t.load_state_dict(sd)
    after_load = (list(t.get_last_lr()), t.optimizer.param_groups[0]["lr"])
    t.step()
    return after_load, list(t.get_last_lr())


@pytest.mark.parametrize("decay", [False, True])
def test_get_last_lr_after_load_follows_deepspeed(decay):
    from zero_from_scratch.engine.real_deepspeed import prepare_deepspeed
    ds = prepare_deepspeed().runtime.lr_schedules
    name = "WarmupDecayLR" if decay else "WarmupLR"
    want = _run(getattr(ds, name), decay)
    assert want[0] == ([0.01], 0.01)                       # DeepSpeed: still the construction lr
    assert _run(getattr(rz, name), decay, quirks.lr_on_load) == want
    own = _run(getattr(rz, name), decay)                   # ringzero's own: the loaded step's lr at once
    assert own[0][0] != [0.01] and own[1] == want[1]
