"""Adam/AdamW on a flat shard (ZeRO's partitioned optimizer states).

    python -m pytest tests/test_zero_units.py -k adam

Ownership: a rank holds Adam's m and v (fp32) only for the elements it owns: one contiguous
local buffer per param group (the concatenation of its shards of that group's units, see
sharding.py). Memory: 8 bytes per owned element, 8Ψ/N instead of 8Ψ. The update is elementwise,
so a shard steps without its neighbours and without any communication; the arithmetic is torch's
single-tensor Adam (`foreach=False`), so with equal gradients the result is bit-identical to
torch.optim.AdamW on the whole model.
"""
from __future__ import annotations

import torch


class ShardedAdam:
    """Adam(W) over each group's local fp32 master shard. `param_groups` holds the
    hyper-parameters (lr, betas, eps, weight_decay) like a torch optimizer, so schedulers and
    users can change them; no communication happens here."""

    def __init__(self, groups: list[dict], local_numels: list[int], adam_w_mode: bool = True):
        self.param_groups = [dict(g) for g in groups]
        self.adam_w_mode = adam_w_mode
        self.state = [{"step": 0, "exp_avg": torch.zeros(n, dtype=torch.float32),
                       "exp_avg_sq": torch.zeros(n, dtype=torch.float32)} for n in local_numels]

    def step_group(self, g: int, master: torch.Tensor, grad: torch.Tensor, lo: int, hi: int, count: bool) -> None:
        """Update master[...] (a view of elements lo:hi of group g's local buffer) with grad (fp32).
        `count` increments the group's step once per optimizer step (first unit only)."""
        hp, st = self.param_groups[g], self.state[g]
        if count:
            st["step"] += 1
        step = st["step"]
        lr, (b1, b2), eps, wd = hp["lr"], hp["betas"], hp["eps"], hp["weight_decay"]
        m, v = st["exp_avg"][lo:hi], st["exp_avg_sq"][lo:hi]
        if wd != 0:
            if self.adam_w_mode:
                master.mul_(1 - lr * wd)
            else:
                grad = grad.add(master, alpha=wd)
        m.lerp_(grad, 1 - b1)
        v.mul_(b2).addcmul_(grad, grad, value=1 - b2)
        # DeepSpeed's Adam "bias_correction": false drops the 1/(1-β^t) factors (FusedAdam, CPUAdam)
        bc1, bc2 = (1 - b1 ** step, 1 - b2 ** step) if hp.get("bias_correction", True) else (1.0, 1.0)
        denom = (v.sqrt() / (bc2 ** 0.5)).add_(eps)   # torch's exact expression
        master.addcdiv_(m, denom, value=-(lr / bc1))

    # torch-style (de)serialisation of the hyper-parameters; the tensors go through checkpoint.py
    def hyper_state(self) -> list[dict]:
        return [{k: (list(v) if isinstance(v, tuple) else v) for k, v in g.items() if k not in ("params", "step")}
                for g in self.param_groups]

    def zero_grad(self, set_to_none: bool = True) -> None:  # the engine owns gradients
        pass
