"""The pipeline engine's optimizer: torch Adam/AdamW as DeepSpeed configures them, or Lion.

    (used by PipelineEngine; config "optimizer": {"type": "AdamW" | "Adam" | "Lion", "params": {...}})

Lion (Chen et al. 2023, "Symbolic Discovery of Optimization Algorithms"), DeepSpeed's "Lion" type
(its FusedLion / DeepSpeedCPULion, csrc/lion): with c = β1·m + (1 − β1)·g,
    p ← p·(1 − lr·λ) − lr·sign(c),    m ← β2·m + (1 − β2)·g
The update has one home, zero_from_scratch/engine/optimizers.py::lion_step_ (the ZeRO engine's,
DeepSpeed's kernel); Lion here is the torch Optimizer around it that a stage's parameters need.
DeepSpeed's defaults: betas (0.9, 0.999), weight_decay 0. One state tensor (m) per parameter:
4Ψ bytes in fp32 where Adam keeps 8Ψ. Cost per step: a few elementwise passes over Ψ_stage.
"""
from __future__ import annotations

import torch

from zero_from_scratch.engine.optimizers import lion_step_

LION_KEYS = {"lr", "betas", "weight_decay"}


class Lion(torch.optim.Optimizer):
    def __init__(self, params, lr: float = 1e-3, betas=(0.9, 0.999), weight_decay: float = 0.0):
        if lr < 0 or not all(0 <= b < 1 for b in betas) or weight_decay < 0:
            raise ValueError(f"Lion: lr={lr}, betas={betas}, weight_decay={weight_decay}: need lr >= 0, betas in "
                             "[0, 1), weight_decay >= 0")
        super().__init__(params, dict(lr=lr, betas=tuple(betas), weight_decay=weight_decay))

    @torch.no_grad()
    def step(self, closure=None):
        loss = closure() if closure is not None else None
        for group in self.param_groups:
            lr, (b1, b2), wd = group["lr"], group["betas"], group["weight_decay"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                st = self.state[p]
                if not st:
                    st["exp_avg"] = torch.zeros_like(p)
                lion_step_(p, p.grad, st["exp_avg"], lr, b1, b2, wd)
        return loss


def parse_lion(section: dict) -> dict:
    """The Lion section's params as Lion's keyword arguments; an unknown key is an error naming it."""
    params = dict(section.get("params", {}) or {})
    params.pop("torch_adam", None)
    bad = set(params) - LION_KEYS
    if bad:
        raise ValueError(f"config keys {sorted('optimizer.params.' + k for k in bad)} are not Lion's; "
                         f"allowed: {sorted(LION_KEYS)}")
    return {"lr": float(params.get("lr", 1e-3)), "betas": tuple(params.get("betas", (0.9, 0.999))),
            "weight_decay": float(params.get("weight_decay", 0.0))}


def build_optimizer(cfg, stage_params: list, model_parameters, rank: int):
    """The optimizer over model_parameters (each must be one of this stage's), or over every
    trainable parameter of the stage when model_parameters is None."""
    params = stage_params
    if model_parameters is not None:
        given = list(model_parameters)
        if given and isinstance(given[0], dict):
            raise ValueError(f"rank {rank}: model_parameters as parameter groups (dicts) are not supported by the "
                             "pipeline engine; pass a list of parameters")
        ids = {id(p) for p in stage_params}
        foreign = [tuple(p.shape) for p in given if id(p) not in ids]
        if foreign:
            raise ValueError(f"rank {rank}: model_parameters holds {len(foreign)} tensor(s) (shapes {foreign[:3]}) that "
                             "are not trainable parameters of this rank's stage; pass "
                             "[p for p in model.parameters() if p.requires_grad] taken on this rank")
        params = given
    if getattr(cfg, "lion", None) is not None:
        return Lion(params, **cfg.lion)
    o = cfg.run.optimizer
    if o.type == "SGD":              # DeepSpeed's basic optimizer for it: torch.optim.SGD(params, **config params)
        return torch.optim.SGD(params, **o.params)
    if o.type not in ("Adam", "AdamW") or not o.bias_correction:   # the ZeRO engine's config reader accepts more
        raise ValueError(f"rank {rank}: optimizer {o.type!r}" + ("" if o.bias_correction else " with bias_correction "
                         "false") + " is not served by the pipeline engine (DeepSpeed's would build it on the stage's "
                         "parameters); allowed: Adam, AdamW (bias-corrected), Lion or SGD")
    opt_cls = torch.optim.AdamW if o.adam_w_mode else torch.optim.Adam
    return opt_cls(params, lr=o.lr, betas=o.betas, eps=o.eps, weight_decay=o.weight_decay)


def engine_optimizer(e, model_parameters):
    """The engine's optimizer: ZeRO-1's over this replica's shard, the fp32 masters' (bf16/fp16),
    or the stage's parameters' (fp32)."""
    if e.zero1 is not None:
        given = None if model_parameters is None else {id(p) for p in model_parameters}
        if given is not None and given != {id(p) for p in e.params}:
            raise ValueError(f"rank {e.rank}: with zero_optimization.stage 1 model_parameters must be every trainable "
                             "parameter of the stage (the shard layout covers them all); pass None or all of them")
        return e.zero1.optimizer
    if e.mixed is not None:
        return build_optimizer(e.cfg, e.mixed.master, e.mixed.masters_for(model_parameters), e.rank)
    return build_optimizer(e.cfg, e.params, model_parameters, e.rank)
