"""The model's parameters as initialize sees them: param groups, ZeRO-3 units, the one device, rank 0's state.

    names, hypers = param_groups(model, model_parameters, cfg.optimizer)   # per group: names, lr/betas/...
    units = module_units(model, names)         # stage 3: one unit per (module, group), registration order
    device = param_device(model)               # the one device, or a ValueError naming the parameters
    broadcast_module_state(comm, model)        # every parameter and buffer ← rank 0's

Pure bookkeeping over named_parameters(), except the broadcast: Ψ·bytes from rank 0, once per
run, streamed in chunks (never a flat copy of the model). Used by zero_engine.py and report.py.
"""
from __future__ import annotations

import torch
import torch.nn as nn

def param_groups(module: nn.Module, model_parameters, opt_cfg) -> tuple[list[list[str]], list[dict]]:
    """Names of the parameters of each group, and each group's hyper-parameters (the config
    optimizer's, client_optim.OptimizerConfig.hyper, overridden per group)."""
    name_of = {}
    for n, p in module.named_parameters():
        name_of.setdefault(id(p), n)
    base = opt_cfg.hyper()
    if model_parameters is None:
        model_parameters = [p for p in module.parameters() if p.requires_grad]
    items = list(model_parameters)
    if items and not isinstance(items[0], dict):
        items = [{"params": items}]
    names, hypers, seen = [], [], set()
    for gi, g in enumerate(items):
        if not isinstance(g, dict) or "params" not in g:
            raise TypeError(f"model_parameters group {gi} must be a dict with 'params' (like torch optimizers)")
        extra = set(g) - {"params", "name", "moe", *base}   # name, moe: DeepSpeed's group labels (moe/utils.py), kept
        if extra:
            raise ValueError(f"model_parameters group {gi} has unsupported keys {sorted(extra)}; allowed: {list(base)}")
        ns = []
        for p in g["params"]:
            if id(p) not in name_of:
                raise ValueError(f"model_parameters group {gi} holds a tensor of shape {tuple(p.shape)} that is not a "
                                 "parameter of `model`")
            if id(p) in seen:
                raise ValueError(f"parameter {name_of[id(p)]!r} appears in more than one param group")
            seen.add(id(p))
            if p.requires_grad:
                ns.append(name_of[id(p)])
        names.append(ns)
        hypers.append({**base, **{k: (tuple(v) if k == "betas" else v) for k, v in g.items() if k != "params"}})
    missing = [n for n, p in module.named_parameters() if p.requires_grad and id(p) not in seen]
    if missing:
        raise ValueError(f"trainable parameters missing from model_parameters: {missing[:5]}{'…' if len(missing) > 5 else ''}; "
                         "pass them or set requires_grad=False")
    return names, hypers


def module_units(module: nn.Module, names: list[list[str]]) -> list:
    """Stage 3 units: one per (module, param group), in module registration order."""
    group_of = {n: g for g, ns in enumerate(names) for n in ns}
    by_id = {}
    for n, p in module.named_parameters():
        by_id.setdefault(id(p), n)
    units, taken = [], set()
    for mname, m in module.named_modules():
        per_group: dict[int, list] = {}
        for p in m.parameters(recurse=False):
            n = by_id[id(p)]
            if n in group_of and n not in taken:
                taken.add(n)
                per_group.setdefault(group_of[n], []).append((n, tuple(p.shape)))
        for g in sorted(per_group):
            units.append((g, mname or "<root>", per_group[g]))
    return units


def param_device(module: nn.Module) -> torch.device:
    """The one device every parameter is on; a ValueError naming the parameters otherwise. Every
    flat buffer, shard and gradient the engine makes lives there (a CPU buffer would silently move
    a CUDA model: `p.data = view` re-homes the parameter)."""
    by_dev: dict = {}
    for n, p in module.named_parameters():
        by_dev.setdefault(p.device, []).append(n)
    if len(by_dev) > 1:
        listed = "; ".join(f"{d}: {ns[:4]}{' …' if len(ns) > 4 else ''} ({len(ns)})" for d, ns in by_dev.items())
        rank = f"rank {torch.distributed.get_rank()}: " if torch.distributed.is_initialized() else ""
        raise ValueError(f"{rank}initialize(model=...) has parameters on {len(by_dev)} devices ({listed}); ZeRO "
                         "shards one flat buffer per group, so every parameter must be on one device: "
                         "call model.to(device) first")
    if by_dev and next(iter(by_dev)).type == "meta":
        raise ValueError("initialize(model=...) has parameters on the 'meta' device (no data to shard); "
                         "materialise the model first (model.to_empty(device=...) and load weights)")
    return next(iter(by_dev), torch.device("cpu"))


BROADCAST_CHUNK = 1 << 20      # elements packed into one broadcast of small tensors (4 MiB of fp32)


def broadcast_module_state(comm, module: nn.Module) -> None:
    """Every parameter (frozen ones included) and buffer ← rank 0's, as deepspeed.initialize and
    torch DDP do, so ranks that built the model with different seeds still train one model.
    Ψ·bytes from rank 0 (ring/tree forwarding), streamed: a contiguous tensor of ≥ BROADCAST_CHUNK
    elements is broadcast in place, smaller ones are packed, per dtype, into buffers of ≤
    BROADCAST_CHUNK elements, so it adds one chunk to the host memory, not a flat copy of the model."""
    if comm.size == 1:
        return
    by_dtype: dict = {}
    for t in [*module.parameters(), *module.buffers()]:
        if t.numel():                                      # zero.Init's parameters are empty here
            by_dtype.setdefault(t.dtype, []).append(t)

    def packed(ts: list) -> None:
        flat = torch.cat([t.detach().reshape(-1) for t in ts])
        comm.broadcast(flat, 0, purpose="init broadcast")
        off = 0
        for t in ts:
            t.copy_(flat[off:off + t.numel()].view_as(t))
            off += t.numel()

    with torch.no_grad():
        for ts in by_dtype.values():
            pack, n = [], 0
            for t in ts:
                if t.numel() >= BROADCAST_CHUNK and t.is_contiguous():
                    comm.broadcast(t.detach().view(-1), 0, purpose="init broadcast")
                    continue
                if pack and n + t.numel() > BROADCAST_CHUNK:
                    packed(pack)
                    pack, n = [], 0
                pack.append(t)
                n += t.numel()
            if pack:
                packed(pack)
    comm.usage.pop("init broadcast", None)   # once per run: not a per-step cost in comm_report
