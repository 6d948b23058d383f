"""Lion (Chen et al. 2023, "Symbolic Discovery of Optimization Algorithms"), DeepSpeed's `"Lion"`.

    python -c "import torch; from zero_from_scratch.engine.lion import Lion; p = torch.nn.Parameter(torch.ones(3)); p.grad = torch.ones(3); Lion([p], lr=0.1).step(); print(p)"

The update DeepSpeed's kernels compute (csrc/lion: multi_tensor_lion, cpu_lion), per element:
    c = sign(β1·m + (1−β1)·g);  p ← p·(1 − lr·wd) − lr·c;  m ← β2·m + (1−β2)·g
One state tensor (m) instead of Adam's two: 4 bytes per fp32 element, so a sharded Lion holds 4Ψ/N.
"""
from __future__ import annotations

import torch


def lion_update_(p: torch.Tensor, g: torch.Tensor, m: torch.Tensor, lr: float, betas, weight_decay: float) -> None:
    """One Lion step on p in place (p, g, m same shape, fp32; m is updated too)."""
    b1, b2 = betas
    c = m.mul(b1).add_(g, alpha=1 - b1).sign_()
    if weight_decay != 0:
        p.mul_(1 - lr * weight_decay)
    p.add_(c, alpha=-lr)
    m.mul_(b2).add_(g, alpha=1 - b2)


class Lion(torch.optim.Optimizer):
    """torch-optimizer shape (param_groups, state[p]["exp_avg"], state_dict) over lion_update_."""

    def __init__(self, params, lr: float = 1e-3, betas=(0.9, 0.999), weight_decay: float = 0.0):
        if lr < 0 or not all(0 <= b < 1 for b in betas):
            raise ValueError(f"Lion: expected lr >= 0 and 0 <= betas < 1, got lr={lr}, betas={betas}")
        super().__init__(params, dict(lr=lr, betas=tuple(betas), weight_decay=weight_decay))

    @torch.no_grad()
    def step(self, closure=None):
        loss = closure() if closure is not None else None
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                st = self.state[p]
                if not st:
                    st["step"] = 0
                    st["exp_avg"] = torch.zeros_like(p, dtype=torch.float32)
                st["step"] += 1
                lion_update_(p, p.grad.float() if p.dtype != torch.float32 else p.grad, st["exp_avg"],
                             group["lr"], group["betas"], group["weight_decay"])
        return loss
