"""The optimizers the ZeRO engine steps on its shards, beyond Adam: Lion, SGD, Adagrad; and
DeepSpeed's optimizer classes (FusedAdam, DeepSpeedCPUAdam, FusedLion, DeepSpeedCPULion) as
client objects that initialize(optimizer=...) recognises.

    python -m pytest tests/test_zero_surface.py -k optim

Each update is elementwise, so a rank steps its shard (a chunk of it at a time) with no
communication, and the result equals the unsharded optimizer's (sharded_adam in optim.py is the
textbook's). Per parameter element the states are (fp32, on the shard's device):
  Adam/AdamW   exp_avg, exp_avg_sq   (optim.py::ShardedAdam, torch's single-tensor expression)
  Lion         exp_avg               (lion_step_: DeepSpeed's FusedLion kernel, multi_tensor_lion.cu)
  SGD          momentum_buffer       (sgd_step_: torch.optim.SGD's single-tensor path)
  Adagrad      sum                   (adagrad_step_: torch.optim.Adagrad's single-tensor path)
The hyper-parameters are read from `param_groups[g]` at every step, so a client (the HF
Trainer's scheduler, a torch LambdaLR) writing `param_groups[g]["lr"]` changes the next step.
The sharded optimizers share that list with a client optimizer object (client_optim.py).
"""
from __future__ import annotations

import torch

from zero_from_scratch.optim import ShardedAdam


def lion_step_(param, grad, exp_avg, lr: float, beta1: float, beta2: float, weight_decay: float) -> None:
    """Lion (Chen et al., arXiv 2302.06675) in place, as DeepSpeed's FusedLion kernel writes it
    (csrc/lion/multi_tensor_lion.cu): c = β1·m + (1-β1)·g; p ← p·(1 - lr·wd) + (c > 0 ? -lr : +lr);
    m ← β2·m + (1-β2)·g. Quirk kept: c == 0 (no gradient, no momentum) moves p by +lr."""
    c = exp_avg.mul(beta1).add_(grad, alpha=1 - beta1)
    if weight_decay != 0:
        param.mul_(1 - lr * weight_decay)
    param.add_(torch.where(c > 0, -lr, lr).to(param.dtype))
    exp_avg.mul_(beta2).add_(grad, alpha=1 - beta2)


def sgd_step_(param, grad, buf, step: int, lr: float, momentum=0.0, dampening=0.0, weight_decay=0.0,
              nesterov=False, maximize=False) -> None:
    """torch.optim.SGD, one tensor: the momentum buffer starts as the first gradient (step 1)."""
    if maximize:
        grad = -grad
    if weight_decay != 0:
        grad = grad.add(param, alpha=weight_decay)
    if momentum != 0:
        if step == 1:
            buf.copy_(grad)
        else:
            buf.mul_(momentum).add_(grad, alpha=1 - dampening)
        grad = grad.add(buf, alpha=momentum) if nesterov else buf
    param.add_(grad, alpha=-lr)


def adagrad_step_(param, grad, state_sum, step: int, lr: float, lr_decay=0.0, weight_decay=0.0, eps=1e-10,
                  maximize=False) -> None:
    """torch.optim.Adagrad, one tensor: clr = lr / (1 + (t-1)·lr_decay); Σ += g²; p -= clr·g/(√Σ + eps)."""
    if maximize:
        grad = -grad
    if weight_decay != 0:
        grad = grad.add(param, alpha=weight_decay)
    clr = lr / (1 + (step - 1) * lr_decay)
    state_sum.addcmul_(grad, grad, value=1)
    param.addcdiv_(grad, state_sum.sqrt().add_(eps), value=-clr)


class GroupStates(list):
    """An optimizer's `state`: one dict per parameter group (its step and its states over the rank's
    shard), also readable as a mapping group → state, the way clients walk DeepSpeed's ZeRO optimizer's
    `state` (its base optimizer's, keyed by each group's fp32 partition): keys(), values(), items()."""

    def keys(self):
        return range(len(self))

    def values(self):
        return list(self)

    def items(self):
        return list(enumerate(self))


class ShardedOptimizer(torch.optim.Optimizer):
    """What every engine optimizer is (a torch Optimizer by type, so torch's LR schedulers accept
    it; torch's own __init__ and per-parameter state are not used): `param_groups` (hyper-parameters, torch's shape), `state[g]`
    (per group: "step" and one fp32 tensor per STATE key over the rank's local buffer), and
    step_group, which the engine calls once per shard chunk. Also DeepSpeed's ZeRO-optimizer
    attributes clients read: `overflow` (the last step was skipped), `cur_scale` / `loss_scale`
    (the loss scaler's), `backward(loss)` (the engine's, without the accumulation division, as
    DeepSpeedZeroOptimizer.backward)."""
    STATE: tuple = ()
    name = ""
    overflow = False
    loss_scaler = None
    engine_backward = None

    def __init__(self, groups: list[dict], local_numels: list[int]):
        self.param_groups = [dict(g) for g in groups]
        self.state = GroupStates({"step": 0, **{k: self.initial(g, k, n) for k in self.STATE}}
                                 for g, n in zip(self.param_groups, local_numels))

    def initial(self, group: dict, key: str, n: int) -> torch.Tensor:
        return torch.zeros(n, dtype=torch.float32)

    def step_group(self, g: int, master, grad, lo: int, hi: int, count: bool) -> None:
        st = self.state[g]
        if count:
            st["step"] += 1
        self.update(self.param_groups[g], st["step"], master, grad, *(st[k][lo:hi] for k in self.STATE))

    def hyper_state(self) -> list[dict]:
        return [{k: (list(v) if isinstance(v, tuple) else v) for k, v in g.items() if k not in ("params", "step")}
                for g in self.param_groups]

    def zero_grad(self, set_to_none: bool = True) -> None:   # the engine owns gradients
        pass

    def step(self, closure=None):
        raise NotImplementedError("engine.optimizer.step() is not called directly here: engine.step() steps the "
                                  "shards at the accumulation boundary (DeepSpeed's engine.step does the same)")

    def state_dict(self):
        raise NotImplementedError("engine.optimizer.state_dict(): the states are sharded; use "
                                  "engine.save_checkpoint() (DeepSpeed's ZeRO optimizer returns this rank's partition)")

    def __repr__(self) -> str:
        return f"{type(self).__name__}({len(self.param_groups)} groups, {self.name} on ZeRO shards)"

    def __getattr__(self, name):   # only for names not found: the runner's refusals say why (zero_layout.py)
        refused = self.__dict__.get("refused_names", {})
        if name in refused:
            raise refused[name]
        raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")

    @property
    def cur_scale(self) -> float:
        return self.loss_scaler.cur_scale

    loss_scale = cur_scale

    @property
    def dynamic_loss_scale(self) -> bool:
        return self.loss_scaler.dynamic

    def needs_scaler(self) -> bool:      # DeepSpeed's: a plain loss.backward() needs engine.scale(loss) first
        return self.loss_scaler.dynamic

    @property
    def leaf_parameters(self) -> dict:
        """DeepSpeed's ZeRO-3 optimizer attribute: each leaf module (leaf.py) → its trained parameters."""
        engine = getattr(self.engine_backward, "__self__", None)
        if engine is None or engine.stage_id != 3:
            raise AttributeError("leaf_parameters: DeepSpeed's ZeRO-3 optimizer has it, not this stage's")
        out = {}
        for p in engine.params_by_name.values():
            if hasattr(p, "ds_z3_leaf_module"):
                out.setdefault(p.ds_z3_leaf_module, []).append(p)
        return out

    @property
    def defaults(self) -> dict:
        return {k: v for k, v in self.param_groups[0].items() if k != "params"} if self.param_groups else {}

    def backward(self, loss, retain_graph: bool = False):
        return self.engine_backward(loss, retain_graph=retain_graph, scale_wrt_gas=False)


class ZeroAdam(ShardedAdam, ShardedOptimizer):
    """The textbook's Adam (step_group, hyper_state) first; ShardedOptimizer adds the torch and
    DeepSpeed surface."""
    STATE, name = ("exp_avg", "exp_avg_sq"), "Adam"

    def __init__(self, groups, local_numels, adam_w_mode: bool = True):
        ShardedAdam.__init__(self, groups, local_numels, adam_w_mode)
        self.state = GroupStates(self.state)


class ZeroLion(ShardedOptimizer):
    STATE, name = ("exp_avg",), "Lion"

    def update(self, hp, step, p, g, m):
        lion_step_(p, g, m, hp["lr"], *hp["betas"], hp["weight_decay"])


class ZeroSGD(ShardedOptimizer):
    STATE, name = ("momentum_buffer",), "SGD"

    def update(self, hp, step, p, g, buf):
        sgd_step_(p, g, buf, step, hp["lr"], hp["momentum"], hp["dampening"], hp["weight_decay"], hp["nesterov"],
                  hp.get("maximize", False))


class ZeroAdagrad(ShardedOptimizer):
    STATE, name = ("sum",), "Adagrad"

    def initial(self, group, key, n):
        return torch.full((n,), float(group["initial_accumulator_value"]), dtype=torch.float32)

    def update(self, hp, step, p, g, s):
        adagrad_step_(p, g, s, step, hp["lr"], hp["lr_decay"], hp["weight_decay"], hp["eps"], hp.get("maximize", False))


SHARDED = {"Adam": ZeroAdam, "Lion": ZeroLion, "SGD": ZeroSGD, "Adagrad": ZeroAdagrad}


# ----------------------------------------------------------------------------- DeepSpeed's classes
class _OneProcess(torch.optim.Optimizer):
    """A DeepSpeed optimizer class as a client object: initialize() shards its param groups; its
    own step() (one process, no engine) applies the same update to each fp32 parameter."""
    KIND = "Adam"

    def step(self, closure=None):
        loss = closure() if closure is not None else None
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                if p.dtype != torch.float32:
                    raise TypeError(f"{type(self).__name__}.step() outside initialize() steps fp32 parameters only, "
                                    f"got {p.dtype}; pass the optimizer to initialize() for mixed precision")
                st = self.state[p]
                if "one" not in st:
                    st["one"] = self.sharded(group, p.numel())
                one = st["one"]
                one.param_groups[0] = group
                one.step_group(0, p.data.view(-1), p.grad.reshape(-1), 0, p.numel(), True)
        return loss

    def sharded(self, group: dict, n: int) -> ShardedOptimizer:
        return SHARDED[self.KIND]([group], [n])


class FusedAdam(_OneProcess):
    """deepspeed.ops.adam.FusedAdam's signature (the kernel's rounding order differs from torch's
    expression used here by about one ulp per step)."""

    def __init__(self, params, lr=1e-3, bias_correction=True, betas=(0.9, 0.999), eps=1e-8, adam_w_mode=True,
                 weight_decay=0.0, amsgrad=False, set_grad_none=True):
        if amsgrad:
            raise RuntimeError("FusedAdam does not support the AMSGrad variant.")   # DeepSpeed's own words
        super().__init__(params, dict(lr=lr, bias_correction=bias_correction, betas=betas, eps=eps,
                                      weight_decay=weight_decay))
        self.adam_w_mode = bool(adam_w_mode)

    def sharded(self, group, n):
        return ZeroAdam([group], [n], self.adam_w_mode)


class DeepSpeedCPUAdam(FusedAdam):
    """deepspeed.ops.adam.DeepSpeedCPUAdam's signature; the update is FusedAdam's."""

    def __init__(self, model_params, lr=1e-3, bias_correction=True, betas=(0.9, 0.999), eps=1e-8, weight_decay=0,
                 amsgrad=False, adamw_mode=True, fp32_optimizer_states=True):
        if amsgrad or not fp32_optimizer_states:
            raise NotImplementedError("DeepSpeedCPUAdam(amsgrad=True / fp32_optimizer_states=False) is not implemented "
                                      "here; DeepSpeed would keep AMSGrad's max or bf16 states. Use the defaults")
        super().__init__(model_params, lr, bias_correction, betas, eps, adamw_mode, weight_decay)


class FusedLion(_OneProcess):
    """deepspeed.ops.lion.FusedLion's signature and kernel maths (lion_step_)."""
    KIND = "Lion"

    def __init__(self, params, lr=1e-3, betas=(0.9, 0.999), weight_decay=0.0, set_grad_none=True):
        super().__init__(params, dict(lr=lr, betas=betas, weight_decay=weight_decay))


class DeepSpeedCPULion(FusedLion):
    """deepspeed.ops.lion.DeepSpeedCPULion's signature; the update is FusedLion's (its AVX path puts
    -lr on c == 0 where the GPU kernel puts +lr: the only difference, and only where c is exactly 0)."""

    def __init__(self, model_params, lr=1e-3, betas=(0.9, 0.999), weight_decay=0, fp32_optimizer_states=True):
        if not fp32_optimizer_states:
            raise NotImplementedError("DeepSpeedCPULion(fp32_optimizer_states=False) is not implemented here; "
                                      "DeepSpeed would keep bf16 states. Use the default")
        super().__init__(model_params, lr, betas, weight_decay)
