"""`ds_tensor` of a ZeRO-3 parameter: DeepSpeed's partition, with storage where the layouts agree.

    engine, *_ = deepspeed.initialize(model=model, config={... "zero_optimization": {"stage": 3}})
    p.ds_tensor.data = torch.full_like(p.ds_tensor.data, 2.0)   # this rank's partition, as in DeepSpeed
    engine(x)                                                   # the all-gather reads what was written

DeepSpeed pads each parameter to a multiple of N and keeps elements [r·s, (r+1)·s), s = ⌈numel/N⌉,
in rank r's `ds_tensor`. The engine's unit is one module's parameters of one param group, padded to
a multiple of N as one flat buffer and split the same way (sharding.py): for a parameter alone in
its unit (offset 0, unit padding = the parameter's padding) this rank's shard of the unit IS that
partition, element for element. There `ds_tensor` is a view of the engine's working shard
(`stage.param_shard(u)`, the model dtype, what every all-gather reads): reading it reads the
partition, and a write changes what the next gather brings, as DeepSpeed's does. A frozen
parameter alone in its module has the same view of its frozen unit's shard (frozen.py), which no
optimizer step recomputes, so a write there lasts, as in DeepSpeed. Elsewhere (a parameter sharing
its unit, offload_param's moved shards) it keeps DeepSpeed's shape without storage
(partition_shape.py), and any use of its values raises saying why and which parameters do have storage.

What a write changes, DeepSpeed 0.19.8's way (partition_parameters.py, stage3.py): the 16-bit
partition the gathers read, not the fp32 master the optimizer holds; the step recomputes the
partition from the master, so the write lasts until the next optimizer step. In bf16/fp16 the
working shard is not the master, so nothing more is needed. In fp32 the engine keeps no separate
master (precision.py; with offload_optimizer "nvme" the shard is still the master): the first use
of a parameter's ds_tensor values (any argument of a torch call, nested ones included, and any
tensor sharing its storage: `.data`, a view, slice, reshape or detach, each itself such a view, so a
handle held past a step is tracked too) keeps a copy of its shard aside, and the step puts it back
before the update (`restore_masters`), so the write reaches forward and backward but not the
optimizer, as in DeepSpeed; safe_get_*_fp32_param and checkpoint saves read the kept copy
(`master_of`), as DeepSpeed's read and save its fp32 partition. A load drops the kept copies. With
offload_optimizer "cpu" the host master is apart and the step rewrites the shard from it, so the
copy, kept and put back all the same, changes nothing.
`p.ds_tensor.data = t` copies t into the partition (DeepSpeed rebinds ds_tensor to t, then to its
flat buffer at the step: the same values reach the gathers); a t of another shape, dtype or device
would need storage the engine does not gather from, so it is refused rather than dropped.
Rebinding the attribute itself, `p.ds_tensor = t`, is refused at the parameter's next gather
(check_bound, on the rank that rebound it; the other ranks wait in the gather until its timeout):
DeepSpeed would gather t from then on, ringzero gathers the engine's shard. Not tracked: storage reached outside torch (`.numpy()`, `untyped_storage()`).
Cost: per torch call on a ds_tensor or a view of it, two walks of its arguments and one storage
compare per tensor output; per all-gather, one attribute check per parameter of the unit; in fp32,
one shard copy (⌈numel/N⌉ elements) per parameter whose ds_tensor is used, held until the next step.
"""
from __future__ import annotations

import weakref

import torch
import torch.utils._pytree

from zero_from_scratch.engine.partition_shape import _METADATA, PartitionShape


class PartitionView(torch.Tensor):
    """ds_tensor over this rank's shard of a one-parameter unit (see the module docstring)."""

    @staticmethod
    def over(shard: torch.Tensor, stage, u) -> "PartitionView":
        t = torch.Tensor._make_subclass(PartitionView, shard)      # shares the shard's storage
        t.ds_numel = shard.numel()
        t._ds_owner = (weakref.ref(stage), u)
        return t

    def _touched(self) -> None:
        with torch._C.DisableTorchFunctionSubclass():   # offload_states frees the storage: torch would read freed memory
            gone = self.untyped_storage().nbytes() < (self.storage_offset() + self.numel()) * self.element_size()
        if gone:
            raise NotImplementedError("ds_tensor used while engine.offload_states() holds the parameters (lp_params) on "
                                      "the host: DeepSpeed's ds_tensor would be that host copy; call "
                                      "engine.reload_states() first")
        stage, u = self._ds_owner[0](), self._ds_owner[1]
        if stage is not None:
            kept_masters(stage).keep(u)

    def __deepcopy__(self, memo):       # copy.deepcopy(model) after initialize: a plain copy of the values
        out = self._plain().clone()
        if hasattr(self, "ds_numel"):
            out.ds_numel = self.ds_numel
        return out

    def __reduce_ex__(self, protocol):
        return self._plain().clone().__reduce_ex__(protocol)

    def _plain(self) -> torch.Tensor:
        with torch._C.DisableTorchFunctionSubclass():
            return self.view_as(self)

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        raw = getattr(func, "__name__", "")
        name = getattr(getattr(func, "__self__", None), "__name__", raw) if raw in ("__get__", "__set__") else raw
        if name in _METADATA and raw != "__set__":
            with torch._C.DisableTorchFunctionSubclass():
                return func(*args, **(kwargs or {}))
        # any use may alias the storage: keep the master first; nested too (torch._foreach_mul_([ds_tensor], 2))
        for a in torch.utils._pytree.tree_flatten((args, kwargs))[0]:
            if isinstance(a, PartitionView):
                a._touched()
        if (raw, name) == ("__set__", "data"):
            return args[0]._assign(args[1])
        with torch._C.DisableTorchFunctionSubclass():
            out = func(*args, **(kwargs or {}))
            views = [a for a in torch.utils._pytree.tree_flatten((args, kwargs))[0] if isinstance(a, PartitionView)]
            out = torch.utils._pytree.tree_map_only(torch.Tensor, lambda t: _aliased(t, views), out)
        if (raw, name) == ("__get__", "data"):
            out.ds_numel = args[0].ds_numel
        return out

    def _assign(self, value) -> None:
        """`ds_tensor.data = value`: into the partition the gathers read (DeepSpeed's rebinding, by value)."""
        with torch._C.DisableTorchFunctionSubclass():
            want = (tuple(self.shape), self.dtype, str(self.device))
            got = (tuple(value.shape), value.dtype, str(value.device)) if isinstance(value, torch.Tensor) else value
            if got != want:
                raise NotImplementedError(
                    f"ds_tensor.data = {got}: ringzero's ds_tensor is a view of the engine's shard, which its "
                    f"all-gather reads, so only a tensor of the partition's shape, dtype and device {want} can be "
                    "written into it; DeepSpeed would gather the new tensor as it is")
            with torch.no_grad():
                self.copy_(value)


def _aliased(out: torch.Tensor, views: list) -> torch.Tensor:
    """An output sharing a ds_tensor's storage (`.data`, a view, slice, reshape, detach) is a PartitionView
    of the same owner, so a write through it, even one held past a step, keeps the master aside first."""
    if isinstance(out, PartitionView) or out.layout is not torch.strided or out.is_meta:   # to_sparse(): no storage
        return out
    ptr = out.untyped_storage().data_ptr()
    if ptr == 0:
        return out
    for v in views:
        if ptr == v.untyped_storage().data_ptr():
            t = torch.Tensor._make_subclass(PartitionView, out)
            t._ds_owner = v._ds_owner
            return t
    return out


def bind(p, t) -> None:
    """zero_partition.adopt: the engine's ds_tensor on p, remembered so that a rebinding is seen (check_bound)."""
    p.ds_tensor = p._ds_bound = t


def check_bound(params: dict, u) -> None:
    """Before each all-gather of unit u (stage3.py): `p.ds_tensor = t` refused, on the rank that rebound it.
    Only there: a rank that did not rebind enters the all-gather and waits until the collective timeout."""
    for s in u.slots:
        d = params[s.name].__dict__
        if "_ds_bound" in d and d.get("ds_tensor") is not d["_ds_bound"]:
            raise NotImplementedError(
                f"{s.name}.ds_tensor was rebound (p.ds_tensor = t): DeepSpeed's all-gathers would read t from then on "
                "while its optimizer steps the partition it holds, so the parameter would stay t; ringzero gathers the "
                "engine's shard, which a rebinding does not reach: write into it instead (p.ds_tensor.copy_(t) or "
                "p.ds_tensor.data = t), or edit p inside deepspeed.zero.GatheredParameters([p], modifier_rank=0)")


class KeptMasters:
    """fp32 without optimizer offload: master shards kept aside at a ds_tensor use, put back at the step."""

    def __init__(self, stage):
        self.stage, self.kept = stage, {}

    def keep(self, u) -> None:
        e = self.stage.e
        if getattr(e, "master", 0) is None and u.index not in self.kept and u.index < len(e.layout.units):
            # the shard is the master (precision.py); a frozen unit (numbered after the layout's) has none
            self.kept[u.index] = self.stage.param_shard(u).clone()

    def restore(self) -> None:
        for i, master in self.kept.items():
            self.stage.param_shard(self.stage.unit(i)).copy_(master)
        self.kept.clear()


def kept_masters(stage) -> KeptMasters:
    if not hasattr(stage, "ds_kept"):
        stage.ds_kept = KeptMasters(stage)
    return stage.ds_kept


def restore_masters(engine) -> None:
    """At the optimizer step, before the update (step.py): fp32 masters as the optimizer holds them."""
    kept = getattr(engine.stage, "ds_kept", None)
    if kept is not None:
        kept.restore()


def master_of(engine, u) -> torch.Tensor:
    """fp32 without optimizer offload: u's master shard, the kept copy while a ds_tensor use holds one (safe_api.py,
    checkpoint.py, checkpoint_ds.py)."""
    kept = getattr(engine.stage, "ds_kept", None)
    return kept.kept[u.index] if kept is not None and u.index in kept.kept else engine.stage.param_shard(u)


def drop_kept(stage) -> None:
    """After a step or a load (stage3.py after_step / after_load): the shards are the masters again."""
    kept = getattr(stage, "ds_kept", None)
    if kept is not None:
        kept.kept.clear()


def refresh_units(engine, units) -> None:
    """GatheredParameters(modifier_rank=...) exit: the edited `units`' masters follow their shards, and
    only theirs, so a ds_tensor write elsewhere stays out of the master. DeepSpeed 0.19.8's exit
    re-partitions into the 16-bit ds_tensor only (partition_parameters.py, has_been_updated=True) and
    its step overwrites that from the untouched fp32 partition (DeepSpeed issue #2424); ringzero keeps
    the edit through the step, the one difference, limited to the gathered units. fp32: the
    shard is the master, so a kept copy of an edited unit is dropped rather than restored at the
    step; in every branch, since fp32 with nvme optimizer offload also keeps copies (its shard is the
    master). offload_optimizer "cpu": the edited units' host masters follow. "nvme": the master file
    is rewritten whole (offload.py write_master; bf16/fp16 only, fp32's shard is its master)."""
    kept = getattr(engine.stage, "ds_kept", None)
    for u in units if kept is not None else ():
        kept.kept.pop(u.index, None)
    if engine.offload is not None and not hasattr(engine.offload, "adopt"):   # nvme
        return engine.refresh_master()
    masters = engine.offload.master if engine.offload is not None else engine.master if engine.mixed else None
    for u in units if masters is not None else ():
        masters[u.group][u.local_offset:u.local_offset + u.shard].copy_(engine.stage.param_shard(u))


def partitions(engine, units, params: dict, stage=None) -> dict:
    """{name: ds_tensor} for `units`' parameters: a PartitionView where the parameter is alone in its unit
    and `stage` (the ZeRO-3 stage holding the shards in memory) is given, else a PartitionShape saying why."""
    world = engine.comm.size
    alone = [u for u in units if len(u.slots) == 1]
    out, names = {}, [u.slots[0].name for u in alone]
    with_storage = (f"{len(names)} parameter(s) alone in their module (per param group) have ds_tensor with "
                    f"storage, e.g. {names[:3]}" if stage is not None and names
                    else "a trained parameter alone in its module (per param group) has ds_tensor with storage, "
                    "without offload_param")
    for u in units:
        for s in u.slots:
            dtype = params[s.name].dtype
            if stage is not None and len(u.slots) == 1:
                out[s.name] = PartitionView.over(stage.param_shard(u), stage, u)
                continue
            if stage is None:
                why = (f"offload_param keeps this rank's shard of {s.name!r} on the host or in a file, read into "
                       "each all-gather's buffer" if getattr(engine.config, "offload_param", None) is not None else
                       f"{s.name!r} is frozen (requires_grad=False): its shard lives with the frozen units (frozen.py)")
            else:
                others = [o.name for o in u.slots if o.name != s.name]
                why = (f"{s.name!r} shares its unit (module {u.tag!r}) with {len(others)} other parameter(s) "
                       f"{others[:3]}, split N ways as one flat buffer, so no block of it is {s.name!r}'s partition")
            out[s.name] = PartitionShape.of(s.numel, world, dtype, why=f"{why}; {with_storage}")
    return out
