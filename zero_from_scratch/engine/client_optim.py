"""Which optimizer the ZeRO engine steps on its shards: the config's "optimizer" section, or a
client optimizer object / callable passed to initialize(optimizer=...), as deepspeed.initialize.

    engine, opt, _, _ = zero_from_scratch.initialize(model=m, optimizer=torch.optim.AdamW(m.parameters(), lr=1e-3),
                                                     config={"train_batch_size": 8, "zero_optimization": {"stage": 2}})

Config types (DeepSpeed 0.19.8's _configure_basic_optimizer): "Adam"/"AdamW"/"Lion"/"Adagrad" in any
letter case (DeepSpeed lower-cases its own names); any other name is getattr(torch.optim, name),
of which "SGD" is served here. Client objects: torch.optim.Adam/AdamW/SGD/Adagrad and this
package's FusedAdam/DeepSpeedCPUAdam/FusedLion/DeepSpeedCPULion (optimizers.py; the runner serves
them as deepspeed.ops.*); a callable is called with the parameters first, as DeepSpeed does. The
sharded optimizer SHARES the client's `param_groups` list (DeepSpeed steps the client object
itself on its fp32 partitions), so a scheduler built on the client object drives the engine.
Empty groups are dropped from that list, as DeepSpeed drops them. At ZeRO stages 1-3 an
optimizer outside DeepSpeed's ZERO_SUPPORTED_OPTIMIZERS (SGD) needs
"zero_allow_untested_optimizer": true, as DeepSpeed asserts. At stage 0 in fp32 initialize hands back
the client's own object (or the class DeepSpeed builds from the config), bound to the engine
(serve_basic). Cost: a walk over the groups.
"""
from __future__ import annotations

import types
from dataclasses import dataclass, field

import torch

from zero_from_scratch.engine import optimizers as O
from zero_from_scratch.engine.precision import wrapper_first_step

# DeepSpeed lower-cases these names; anything else is looked up in torch.optim as spelled
DS_NAMES = {"adam": "Adam", "adamw": "AdamW", "lion": "Lion", "adagrad": "Adagrad"}
TORCH_NAMES = {"SGD": "SGD"}
DEFAULTS = {   # each class's own defaults, which DeepSpeed's config inherits for absent params
    "Adam": {"lr": 1e-3, "betas": (0.9, 0.999), "eps": 1e-8, "weight_decay": 0.0},
    "Lion": {"lr": 1e-3, "betas": (0.9, 0.999), "weight_decay": 0.0},
    "SGD": {"lr": 1e-3, "momentum": 0.0, "dampening": 0.0, "weight_decay": 0.0, "nesterov": False, "maximize": False},
    "Adagrad": {"lr": 1e-2, "lr_decay": 0.0, "weight_decay": 0.0, "initial_accumulator_value": 0.0, "eps": 1e-10,
                "maximize": False},
}
ADAM_KEYS = ["lr", "betas", "eps", "weight_decay", "torch_adam", "adam_w_mode", "bias_correction"]
SAME_MATHS = {"foreach", "fused", "differentiable", "capturable", "set_grad_none"}   # implementation choices
UNTESTED = {"SGD"}   # not in DeepSpeed's ZERO_SUPPORTED_OPTIMIZERS (runtime/zero/utils.py)


def _bad(key, value, allowed):
    return ValueError(f"config key {key!r} = {value!r} is invalid; allowed: {allowed}")


class ZeRORuntimeException(ValueError):
    """DeepSpeed's ZeRO refusal (runtime/zero/utils.py), raised where it raises it; deepspeed.runtime.zero.utils serves it."""


@dataclass
class OptimizerConfig:
    type: str = "AdamW"            # Adam | AdamW | Lion | SGD | Adagrad
    lr: float = 1e-3
    betas: tuple = (0.9, 0.999)
    eps: float = 1e-8
    weight_decay: float = 0.0
    adam_w_mode: bool = True       # decoupled weight decay (DeepSpeed's default for both Adam types)
    bias_correction: bool = True   # FusedAdam's/DeepSpeedCPUAdam's: false = no 1/(1-β^t) on m and v
    params: dict = field(default_factory=dict)   # Lion/SGD/Adagrad: the class's keyword arguments

    def __post_init__(self):
        canon = DS_NAMES.get(str(self.type).lower()) or TORCH_NAMES.get(self.type)
        if canon is None:
            raise _bad("optimizer.type", self.type, ["Adam", "AdamW", "Lion", "Adagrad", "(any letter case)", "SGD"])
        self.type = canon
        if canon in ("Adam", "AdamW"):   # another class's argument: torch/Fused Adam would raise TypeError
            extra = {k for d in DEFAULTS.values() for k in d} - set(DEFAULTS["Adam"]) - {"maximize"}
            if extra & set(self.params):
                raise _bad("optimizer.params", sorted(extra & set(self.params)), f"Adam's arguments {ADAM_KEYS}")
        else:
            extra = set(self.params) - set(DEFAULTS[canon]) - SAME_MATHS
            if extra:   # DeepSpeed passes them to the class, whose constructor raises TypeError
                raise _bad("optimizer.params", sorted(extra), f"{canon}'s own arguments {sorted(DEFAULTS[canon])}")
            self.params = {**DEFAULTS[canon], **{k: v for k, v in self.params.items() if k not in SAME_MATHS}}
            self.lr, self.weight_decay = self.params["lr"], self.params["weight_decay"]
            self.betas = tuple(self.params.get("betas", self.betas))
            self.eps = self.params.get("eps", self.eps)
        if not (isinstance(self.lr, (int, float)) and self.lr >= 0):
            raise _bad("optimizer.params.lr", self.lr, "a number >= 0")
        if len(self.betas) != 2 or not all(0 <= b < 1 for b in self.betas):
            raise _bad("optimizer.params.betas", self.betas, "two numbers in [0, 1)")
        if not self.eps > 0:
            raise _bad("optimizer.params.eps", self.eps, "a number > 0")
        if self.weight_decay < 0:
            raise _bad("optimizer.params.weight_decay", self.weight_decay, "a number >= 0")
        self.betas = tuple(float(b) for b in self.betas)
        if "betas" in self.params:
            self.params["betas"] = self.betas

    @property
    def kind(self) -> str:
        return "Adam" if self.type in ("Adam", "AdamW") else self.type

    def hyper(self) -> dict:
        """The per-group hyper-parameters every group starts from (model_parameters may override)."""
        if self.kind != "Adam":
            return dict(self.params)
        base = {"lr": self.lr, "betas": self.betas, "eps": self.eps, "weight_decay": self.weight_decay}
        if not self.bias_correction:   # FusedAdam keeps it per group too (optim.py reads it)
            base["bias_correction"] = False
        return base


def resolve_client(client, model_parameters, module):
    """A client optimizer object, or the result of calling a client callable with the parameters."""
    if client is None or isinstance(client, torch.optim.Optimizer):
        return client
    if callable(client):
        params = list(model_parameters) if model_parameters is not None else \
            [p for p in module.parameters() if p.requires_grad]
        out = client(params)
        if not isinstance(out, torch.optim.Optimizer):
            raise TypeError(f"initialize(optimizer=callable): the callable returned {type(out).__name__}, not a "
                            "torch.optim.Optimizer (DeepSpeed calls it with model_parameters and wraps the result)")
        return out
    raise TypeError(f"initialize(optimizer=...) must be a torch.optim.Optimizer or a callable, got {type(client).__name__}")


def client_kind(opt) -> tuple[str, bool]:
    """(sharded kind, adam_w_mode) of a client optimizer object; an unknown type is refused naming it."""
    d = opt.defaults
    if d.get("amsgrad") or (d.get("maximize") and isinstance(opt, (torch.optim.Adam, torch.optim.AdamW))):
        raise NotImplementedError(f"initialize(optimizer={type(opt).__name__}(amsgrad/maximize=True)) is not "
                                  "implemented on the shards; DeepSpeed would step it as given. Use the defaults")
    if isinstance(opt, O.FusedAdam):
        return "Adam", opt.adam_w_mode
    if isinstance(opt, (torch.optim.AdamW, torch.optim.Adam)):
        modes = {bool(g.get("decoupled_weight_decay", isinstance(opt, torch.optim.AdamW))) for g in opt.param_groups}
        if len(modes) > 1:
            raise NotImplementedError("initialize(optimizer=Adam): groups that mix decoupled_weight_decay are not "
                                      "implemented; DeepSpeed would step each as given. Use one setting")
        return "Adam", modes.pop() if modes else True
    for cls, kind in ((O.FusedLion, "Lion"), (torch.optim.SGD, "SGD"), (torch.optim.Adagrad, "Adagrad")):
        if isinstance(opt, cls):
            return kind, True
    raise NotImplementedError(
        f"initialize(optimizer={type(opt).__module__}.{type(opt).__name__}): this optimizer type is not implemented "
        "on ZeRO shards here; DeepSpeed would wrap it in its ZeRO optimizer. Supported: torch.optim.Adam/AdamW/SGD/"
        "Adagrad, FusedAdam, DeepSpeedCPUAdam, FusedLion, DeepSpeedCPULion, or the config's \"optimizer\" section")


def check_untested(kind_name: str, stage: int, allow: bool, rank: int) -> None:
    if stage > 0 and kind_name in UNTESTED and not allow:
        raise ValueError(f"rank {rank}: optimizer {kind_name} at ZeRO stage {stage}: DeepSpeed asserts 'You are using "
                         "an untested ZeRO Optimizer. Please add <\"zero_allow_untested_optimizer\": true> in the "
                         "configuration file to use it.'; add that key (the update here is torch's, on the shards)")


def client_groups(opt, module) -> list[dict]:
    """The client's param_groups with empty groups dropped in place (DeepSpeed does the same);
    each group's parameters must be parameters of `module`."""
    opt.param_groups[:] = [g for g in opt.param_groups if len(g["params"]) != 0]
    return opt.param_groups


def build(kind: str, groups: list[dict], local_numels: list[int], adam_w_mode: bool, shared: bool):
    """The sharded optimizer; `shared`: param_groups IS the client's list (same dicts)."""
    opt = O.ZeroAdam(groups, local_numels, adam_w_mode) if kind == "Adam" else O.SHARDED[kind](groups, local_numels)
    if shared:
        opt.param_groups = groups
        for g, st in zip(groups, opt.state):      # torch's keys the update reads, with the class defaults
            for k, v in DEFAULTS[kind].items():
                g.setdefault(k, v)
    return opt


SURFACE_KEYS = {"zero_allow_untested_optimizer": False, "zero_force_ds_cpu_optimizer": True,
                "dataloader_drop_last": False}


def surface_keys(raw: dict) -> dict:
    """The top-level keys initialize's client-object paths read, with DeepSpeed's defaults; and
    zero_optimization's 16-bit save flag (either name, with or without the stage3_ prefix)."""
    z = raw.get("zero_optimization")
    z = z if isinstance(z, dict) else {}
    g16 = any(z.get(p + k) for p in ("stage3_", "") for k in ("gather_16bit_weights_on_model_save",
                                                             "gather_fp16_weights_on_model_save"))
    return {**{k: bool(raw.get(k, d)) for k, d in SURFACE_KEYS.items()}, "gather_16bit_on_save": g16}


class _Names:
    """param_groups() with no hyper-parameters: only the names (a client's groups carry their own)."""
    @staticmethod
    def hyper() -> dict:
        return {}


def plan(module, model_parameters, client, cfg, rank: int, param_groups):
    """(names per group, hyper dicts per group, kind, adam_w_mode, shared) for the engine.
    `param_groups` is params.param_groups (names, and the config's hyper-parameters per group)."""
    if client is None:
        o = cfg.optimizer
        names, hypers = param_groups(module, model_parameters, o)
        kind, wmode, shared, label = o.kind, o.adam_w_mode, False, o.type
    else:
        groups = client_groups(client, module)
        kind, wmode = client_kind(client)
        names, _ = param_groups(module, [{"params": g["params"]} for g in groups], _Names)
        hypers, shared, label = groups, True, type(client).__name__
    check_untested(label if label in UNTESTED else kind, cfg.zero.stage, cfg.surface["zero_allow_untested_optimizer"],
                   rank)
    if cfg.offload_optimizer is not None:
        if kind != "Adam":
            raise NotImplementedError(f"rank {rank}: offload_optimizer with {label}: not implemented here (offload.py "
                                      "steps Adam's m and v); DeepSpeed would use its CPU Lion/Adagrad. Use Adam, or "
                                      "no offload")
        if client is not None and not isinstance(client, O.DeepSpeedCPUAdam) and cfg.surface["zero_force_ds_cpu_optimizer"]:
            raise ZeRORuntimeException(f"rank {rank}: ZeRO-Offload with a client optimizer ({label}): DeepSpeed raises "
                             "ZeRORuntimeException unless it is DeepSpeedCPUAdam or \"zero_force_ds_cpu_optimizer\": "
                             "false; set that key (the update here is Adam's either way)")
    return names, hypers, kind, wmode, shared


# ----------------------------------------------------------------------------- stage 0 in fp32
def _ds_class(cfg, groups: list[dict], w_mode: bool):
    """The object DeepSpeed 0.19.8's _configure_basic_optimizer builds from the config section."""
    o, raw = cfg.optimizer, (cfg.raw.get("optimizer") or {}).get("params") or {}
    if o.kind == "Adam":
        if raw.get("torch_adam"):
            return (torch.optim.AdamW if w_mode else torch.optim.Adam)(groups)
        return O.FusedAdam(groups, adam_w_mode=w_mode)
    return O.FusedLion(groups) if o.kind == "Lion" else getattr(torch.optim, o.type)(groups)


def serve_basic(engine, client, names: list[list[str]], w_mode: bool, client_step):
    """DeepSpeed at stage 0 in fp32 hands back its basic optimizer (engine.py _configure_optimizer:
    `self.optimizer = basic_optimizer`): the client's own object, or the class it builds from the
    config. That object is returned here too, bound to the engine: the same param_groups list as the
    sharded optimizer (one buffer per group at stage 0, every rank whole), `state[p]` views of its
    states (so they are the real ones, written in place by every step and by load_checkpoint), and
    `step()` / `zero_grad()` acting on the engine's gradients, as the object's own do on `p.grad` in
    DeepSpeed (step: step.client_step, the averaged gradients, no clipping, no scheduler; engine.step()
    clips first)."""
    sharded = engine.optimizer
    if engine.stage_id != 0 or engine.mixed or engine.offload is not None:
        wrapper_first_step(engine)      # under the runner at stage 0 in bf16/fp16: the wrapper's first step (precision.py)
        return sharded                  # DeepSpeed's ZeRO / fp16 / bf16 wrapper: the sharded optimizer
    if client is None:
        opt = _ds_class(engine.config, [{**h, "params": [engine.params_by_name[n] for n in ns]}
                                        for ns, h in zip(names, sharded.param_groups)], w_mode)
        sharded.param_groups = opt.param_groups
    else:
        opt = client
    engine.basic_steps = [torch.zeros((), dtype=torch.float32) for _ in sharded.state]
    for u in engine.layout.units:
        st = sharded.state[u.group]
        for s in u.slots:
            lo = u.local_offset + s.offset
            opt.state[engine.params_by_name[s.name]] = {
                "step": engine.basic_steps[u.group],
                **{k: st[k][lo:lo + s.numel].view(s.shape) for k in sharded.STATE}}

    def step(self, closure=None):
        loss = closure() if closure is not None else None
        client_step(engine)
        return loss

    def zero_grad(self, set_to_none: bool = True):
        engine.zero_grad()
    # bound methods: torch's LR schedulers wrap optimizer.step through its __func__
    opt.step, opt.zero_grad = types.MethodType(step, opt), types.MethodType(zero_grad, opt)
    return opt
