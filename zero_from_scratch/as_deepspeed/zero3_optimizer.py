"""DeepSpeed's ZeRO-3 optimizer names a test reads, on ringzero's engine.optimizer at stage 3.

    python -m zero_from_scratch.as_deepspeed train.py --deepspeed_config ds.json
    (quirks.expose_torch_optimizer installs them after initialize)

  isinstance(engine.optimizer, DeepSpeedZeroOptimizer_Stage3)   true at stage 3 (runtime/zero/stage3.py's
                                  class); the class itself is never built here: DeepSpeed would wrap the client
                                  optimizer over its own fp32 partitions, ringzero's optimizer steps its shards
  engine.optimizer._get_norm_groups()   per parameter group, the L2 norm of the averaged gradient over every
                                  rank (fp16: before unscaling, as DeepSpeed's), read when called, so after
                                  safe_set_local_grad too; every rank calls it (it gathers)
  engine.optimizer._global_grad_norm    the norm the last step measured (engine.get_global_grad_norm())
  the stage's gathered units          a new buffer per gather, as DeepSpeed's (engine/z3_per_gather.py)
Cost: _get_norm_groups gathers each parameter's full gradient (safe_get_full_grad): an inspection call,
not a training one; the rest nothing.
"""
from __future__ import annotations

import weakref

import torch

from zero_from_scratch.as_deepspeed.finder import NotServedError, message
from zero_from_scratch.engine import z3_per_gather
from zero_from_scratch.engine.safe_api import safe_get_full_grad


class _Stage3Check(type):
    def __instancecheck__(cls, obj) -> bool:
        return type.__instancecheck__(cls, obj) or getattr(obj, "_ringzero_zero3", False) is True


class DeepSpeedZeroOptimizer_Stage3(metaclass=_Stage3Check):
    """isinstance(engine.optimizer, DeepSpeedZeroOptimizer_Stage3) at stage 3; building one is refused."""

    def __init__(self, *args, **kwargs):
        raise NotServedError(message("deepspeed.runtime.zero.stage3.DeepSpeedZeroOptimizer_Stage3(...)",
                                     "wrap the client optimizer, stepping fp32 partitions laid out its way",
                                     "deepspeed.initialize at stage 3: engine.optimizer steps ringzero's shards"))


def norm_groups(engine) -> list[torch.Tensor]:
    out = []
    for names in engine.group_names:
        sq = torch.zeros((), dtype=torch.float32, device=engine.device)
        for n in names:
            g = safe_get_full_grad(engine.params_by_name[n])
            if g is not None:
                sq += g.float().pow(2).sum()
        out.append(sq.sqrt())
    return out


_WITH_NORM: dict = {}


def _with_norm(cls):
    """cls with DeepSpeed's _global_grad_norm read from the engine (a subclass: isinstance(cls) still holds)."""
    if cls not in _WITH_NORM:
        _WITH_NORM[cls] = type(cls.__name__, (cls,), {
            "__module__": cls.__module__, "__doc__": cls.__doc__,
            "_global_grad_norm": property(lambda self: self._ringzero_engine()._global_grad_norm)})
    return _WITH_NORM[cls]


def install(engine) -> None:
    if engine.stage_id != 3:
        return
    z3_per_gather.allocate_per_gather(engine.stage)     # DeepSpeed's buffers: one per gather
    opt, ref = engine.optimizer, weakref.ref(engine)
    opt._ringzero_zero3, opt._ringzero_engine = True, ref
    opt._get_norm_groups = lambda: norm_groups(ref())
    opt.__class__ = _with_norm(type(opt))
