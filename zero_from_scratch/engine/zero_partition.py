"""One parameter partitioned as deepspeed.zero.Init leaves it, and the ZeRO-3 engine adopting it.

    with zero_from_scratch.engine.zero_init.Init():  model = MyModel()    # params partitioned here
    engine, *_ = zero_from_scratch.initialize(model=model, config=cfg)   # stage 3 adopts them here

A partitioned parameter keeps DeepSpeed's attributes: `ds_id` (creation order, the same on every
rank), `ds_shape`, `ds_numel`, `ds_status` (ZeroParamStatus), `ds_tensor` (this rank's flat
shard of ⌈ds_numel/N⌉ elements, zero-padded, with its own `ds_numel`) and `ds_process_group`;
`.data` is torch.Size([0]) between uses, as DeepSpeed leaves it.
  partition   rank `src`'s full value is scattered: each rank receives only its shard,
              (N-1)/N·b·numel sent by src (DeepSpeed broadcasts the whole tensor, then slices)
  gather      all-gather of the shards into a full buffer: (N-1)/N·b·numel per rank
  release     .data ← empty; the shard stays

Adoption by the engine (ZeRO-3's `_unit_block`, then `adopt`): the engine's units are whole
modules, Init's shards are per parameter, so the two layouts do not line up; each unit is built
by gathering its parameters one at a time, keeping this rank's block and dropping the rest.
Peak: the largest unit plus its largest parameter, never the model; cost (N-1)/N·Ψ once, and no
broadcast (Init already made every rank agree). After adoption Init's shards are freed, the
parameter's `ds_tensor` is the engine's (z3_ds_tensor.py: a view of its unit shard where the
parameter is alone in its unit) and GatheredParameters goes through the engine. With
offload_param the engine allocates no Ψ/N storage: each unit's block (`unit_block`) goes straight
to the parameter store (param_offload.py), and shards Init kept in a file (init_swap.py) are read
back one parameter at a time.
"""
from __future__ import annotations

import enum
import itertools
import warnings
import weakref

import torch
import torch.distributed as dist

from zero_from_scratch.engine import z3_ds_tensor

_IDS = itertools.count()        # ds_id: every rank creates parameters in the same order


class State:
    """Init's process-wide state: one (outermost) Init patches the classes at a time."""
    depth = 0                   # nested Init contexts
    top = None                  # the outermost Init: owns the class patches and the mode
    busy = 0                    # our own tensor work (the mode lets it through)


STATE = State()


class ZeroParamStatus(enum.Enum):
    """DeepSpeed's names: AVAILABLE = full in .data, NOT_AVAILABLE = only the shard, INFLIGHT = being gathered."""
    AVAILABLE = 1
    NOT_AVAILABLE = 2
    INFLIGHT = 3


def is_zero_param(p) -> bool:
    return hasattr(p, "ds_id")


def held_by_init(p) -> bool:
    """Partitioned by Init and not (yet) adopted by an engine: Init's own shard is the truth."""
    return getattr(p, "ds_tensor", None) is not None and getattr(p, "_zero_engine", None) is None


def engine_of(p):
    ref = getattr(p, "_zero_engine", None)
    return ref() if ref is not None else None


def _world(group) -> tuple[int, int]:
    if not dist.is_initialized():
        return 0, 1
    return dist.get_rank(group), dist.get_world_size(group)


def _global(group, rank: int) -> int:
    return rank if group is None else dist.get_global_rank(group, rank)


def partition(p: torch.nn.Parameter, group=None, src: int = 0, dtype=None, swap=None) -> None:
    """p.data (full, on every rank) → each rank's shard of rank src's value; .data ← empty.
    A parameter seen for the first time gets DeepSpeed's attributes. With `swap` (or a swap the
    parameter already has: init_swap.py) the shard goes to its file and ds_tensor stays empty."""
    rank, n = _world(group)
    full = p.data
    if dtype is not None and full.is_floating_point():
        full = full.to(dtype)
    numel = full.numel()
    shard = -(-numel // n)
    if not is_zero_param(p):
        p.ds_id = next(_IDS)
        p.ds_process_group = group
        p.ds_persist = False
        p.ds_active_sub_modules = set()
        p.is_external_param = False          # DeepSpeed's: True once registered as a dangling parameter
        p.all_gather_coalesced = all_gather_coalesced
    p.ds_shape, p.ds_numel = full.shape, numel
    out = torch.empty(shard, dtype=full.dtype, device=full.device)
    if n == 1:
        out.copy_(full.reshape(-1))
    else:
        chunks = None
        if rank == src:                      # a padded copy only when N does not divide numel
            flat = full.reshape(-1)
            if shard * n != numel or not flat.is_contiguous():
                flat = torch.zeros(shard * n, dtype=full.dtype, device=full.device)
                flat[:numel].copy_(full.reshape(-1))
            chunks = list(flat.chunk(n))
        dist.scatter(out, chunks, src=_global(group, src), group=group)
    out.ds_numel = shard
    swap = swap or getattr(p, "ds_swap", None)
    if swap is not None:
        swap.put(p, out)
    else:
        p.ds_tensor = out
    release(p)


def gather(p: torch.nn.Parameter) -> torch.Tensor:
    """The full value of an Init-held parameter from every rank's shard (all ranks call it)."""
    swap, group = getattr(p, "ds_swap", None), p.ds_process_group
    s = swap.get(p) if swap is not None else p.ds_tensor
    _, n = _world(group)
    if n == 1:
        return s[:p.ds_numel].view(p.ds_shape).clone()
    full = torch.empty(s.numel() * n, dtype=s.dtype, device=s.device)
    dist.all_gather_single(full, s, group=group)
    return full[:p.ds_numel].view(p.ds_shape)


def fetch(p: torch.nn.Parameter) -> None:
    """Install the full value in .data (status AVAILABLE)."""
    p.ds_status = ZeroParamStatus.INFLIGHT
    p.data = gather(p)
    p.ds_status = ZeroParamStatus.AVAILABLE


class _Done:
    """DeepSpeed's all-gather handle, the gather already complete."""

    def wait(self, handle_dependency: bool = True) -> None:
        return None


class MultipleAllGatherHandles:
    """DeepSpeed's handle over several all-gathers (partition_parameters.py): wait() waits on each,
    handing handle_dependency on by keyword (a handle's wait may take it keyword-only or as **kwargs)."""

    def __init__(self, handles):
        self.handles = handles

    def wait(self, handle_dependency: bool = True) -> None:
        for handle in self.handles:
            handle.wait(handle_dependency=handle_dependency)


def all_gather_coalesced(params, safe_mode: bool = False, quantize: bool = False) -> _Done:
    """DeepSpeed's `param.all_gather_coalesced(params)` on Init-held parameters: each one's full value
    in .data (AVAILABLE) until released; one all-gather per parameter, done before it returns."""
    if quantize:
        raise NotImplementedError("all_gather_coalesced(quantize=True) is not supported here: "
                                  "DeepSpeed would gather ZeRO++ quantized weights")
    for p in params:
        if engine_of(p) is not None:
            raise NotImplementedError("all_gather_coalesced on a parameter the ZeRO-3 engine holds is not "
                                      "supported here: DeepSpeed would gather its own partition; "
                                      "use deepspeed.zero.GatheredParameters")
        if p.ds_status != ZeroParamStatus.AVAILABLE:
            fetch(p)
    return _Done()


def release(p: torch.nn.Parameter) -> None:
    p.data = torch.empty(0, dtype=p.ds_tensor.dtype, device=p.ds_tensor.device)
    p.ds_status = ZeroParamStatus.NOT_AVAILABLE


def true_shapes(units: list, model: torch.nn.Module) -> list:
    """Stage-3 units [(group, tag, [(name, shape)])] with Init-held parameters' shapes (ds_shape),
    not the empty .data's."""
    by_name = dict(model.named_parameters())
    return [(g, tag, [(n, tuple(by_name[n].ds_shape) if held_by_init(by_name[n]) else s) for n, s in ps])
            for g, tag, ps in units]


def release_from_other_engines(model: torch.nn.Module, rank: int) -> None:
    """Parameters another live ZeRO-3 engine partitioned (a second initialize on the same model)
    become Init-held again: each one's full value gathered through that engine, one parameter at
    a time, and this rank's shard kept (partition), so the new engine adopts them as it adopts
    zero.Init's (DeepSpeed's stage 3 likewise recognises its partitioned parameters by ds_id and
    gathers them). The old engine is then destroyed (its hooks removed): two engines hooked on one
    model would both gather its parameters and take its gradients. Cost: (N-1)/N·Ψ gathered + scattered."""
    olds = {}
    for p in model.parameters():
        if engine_of(p) is not None:
            olds.setdefault(id(engine_of(p)), engine_of(p))
    for old in olds.values():
        for p in [q for q in model.parameters() if engine_of(q) is old]:     # every rank, the same order
            with old.gathered_parameters([p]):
                full = p.data.clone()
            p.data, p._zero_engine = full, None
            p.__dict__.pop("_ds_bound", None)    # our own re-partition, not a user's rebinding (check_bound)
            partition(p, p.ds_process_group)
        old.destroy()
        if rank == 0:
            warnings.warn("initialize: the model's parameters were partitioned by another ZeRO-3 engine; this engine "
                          "adopts them and the other one is destroyed (its hooks removed)", stacklevel=4)


def refuse_below_stage3(model: torch.nn.Module, stage: int, rank: int) -> None:
    """A model built under zero.Init has empty parameters: only ZeRO-3 can adopt its shards."""
    held = [n for n, p in model.named_parameters() if held_by_init(p)]
    if held and stage != 3:
        raise ValueError(f"rank {rank}: initialize(model=...) got {len(held)} parameters partitioned by zero.Init "
                         f"(e.g. {held[0]!r}) with zero_optimization.stage={stage}; DeepSpeed builds under Init "
                         "for ZeRO-3 only: use stage 3, or build the model without Init")


def make_whole(model: torch.nn.Module, params: list) -> None:
    """Init-held `params` of `model` gathered whole on every rank and no longer ZeRO parameters (the
    runner's initialize below stage 3); an open zero.Init context leaves the model's modules as they
    are when it closes. Collective: (N-1)/N·b·numel per parameter."""
    STATE.busy += 1                              # our own gathers: Init's mode lets them through
    try:
        for p in params:
            p.data = gather(p)
            for a in [k for k in vars(p) if k.startswith("ds_")]:
                delattr(p, a)
    finally:
        STATE.busy -= 1
    top, ids = STATE.top, {id(m) for m in model.modules()}
    if top is not None:
        top.built = [r for r in top.built if id(r()) not in ids]
        top.full = [p for p in top.full if getattr(p, "_zero_owner", None) not in ids]


def value_of(p: torch.nn.Parameter) -> tuple[torch.Tensor, bool]:
    """(full value, came from Init's shards): Init-held parameters are gathered (all ranks call)."""
    if held_by_init(p):
        return gather(p), True
    return p.data, False


def unit_block(st, u) -> torch.Tensor:
    """This rank's block of unit u (a view of the full unit, freed with it): the unit assembled
    from its parameters one at a time, then their full tensors and Init's shards are dropped, so
    only one unit (+ one parameter) is ever whole. All ranks call it, in unit order."""
    full = torch.zeros(u.padded, dtype=st.dtype, device=st.dev)
    plain = False
    for s in u.slots:
        v, from_init = value_of(st.params[s.name])
        full[s.offset:s.offset + s.numel].copy_(v.reshape(-1))
        plain |= not from_init
        del v
    if st.comm.size > 1 and plain:
        st.comm.broadcast(full, 0, **st.kw("init broadcast"))
    for s in u.slots:                    # this unit's full tensors and Init shards go now, not at the end
        p = st.params[s.name]
        p.data = torch.empty(0, dtype=st.dtype, device=st.dev)
        if held_by_init(p):
            p.ds_tensor = None
            if getattr(p, "ds_swap", None) is not None:
                p.ds_swap.drop(p)        # the last one deletes Init's file (init_swap.py)
    lo, hi = u.shard_range(st.rank)
    return full[lo:hi]


def adopt(engine, units, params: dict, stage=None) -> None:
    """Mark `params` as the engine's: DeepSpeed's ds_id / ds_shape / ds_numel / ds_status on every
    one (peft and the HF Trainer read ds_shape / ds_numel), Init's shard dropped. ds_tensor: with
    `stage` (its shards in memory), a view of this rank's shard for a parameter alone in its unit,
    which is DeepSpeed's partition; else DeepSpeed's shape without values (z3_ds_tensor.py)."""
    ds_tensors = z3_ds_tensor.partitions(engine, units, params, stage)
    for u in units:
        for s in u.slots:
            p = params[s.name]
            if not is_zero_param(p):
                p.ds_id, p.ds_persist, p.ds_active_sub_modules = next(_IDS), False, set()
                p.is_external_param, p.all_gather_coalesced = False, all_gather_coalesced
            p.ds_shape, p.ds_numel = torch.Size(s.shape), s.numel
            p.ds_status = ZeroParamStatus.NOT_AVAILABLE
            p.ds_process_group = getattr(engine.comm, "group", None)
            z3_ds_tensor.bind(p, ds_tensors[s.name])   # a later p.ds_tensor = t is refused at the gather
            p._zero_engine = weakref.ref(engine)
