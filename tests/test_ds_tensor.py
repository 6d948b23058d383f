"""ZeRO-3 `ds_tensor` with storage under the runner (engine/z3_ds_tensor.py), against DeepSpeed 0.19.8.

    python -m pytest -q tests/test_ds_tensor.py            (2 ranks, ringzero against torch in one process)
    python -m pytest -q -m slow tests/test_ds_tensor.py    (against DeepSpeed 0.19.8 too: ~25 s)

A model whose modules hold one parameter each (numel 15 and 12 over N = 2: rank 1's partition of the
first ends in padding). Every rank writes its ds_tensor partitions (`.data =` for two, an in-place
`mul_` for the third, with rank-dependent values), then trains two steps with engine.backward /
engine.step, one more with engine.optimizer.zero_grad / step. Recorded on every rank: each output,
get_fp32_grad_partitions(), safe_get_local_fp32_param after the writes, each ds_tensor after each
step, each full parameter (GatheredParameters).
DeepSpeed's run and ringzero's agree within 1e-6 of each tensor's largest element (fp32: the first
forward and backward bit for bit; after that the gradient reductions round in another order, ringzero
summing and dividing at the step, a few ulp that Adam carries: measured ≤ 5e-7): a write reaches
forward and backward but not the fp32 master, from which the step recomputes the partition. A module holding two parameters (a Linear with bias)
gets the refusal on every rank under ringzero, naming why and which parameters have storage; a
ds_tensor used while offload_states holds the parameters on the host is refused (its storage is freed).
A frozen parameter's ds_tensor write (fp32) reaches every forward and lasts through steps (no master
recomputes it), against one-process torch. GatheredParameters(modifier_rank) of another module keeps an
earlier write out of the master (bf16 and fp32). A checkpoint saved between a write and the step holds the unwritten fp32 master in ringzero's files
and DeepSpeed's (read back by load_checkpoint and by zero_to_fp32), as DeepSpeed saves its fp32 partition.
fp32: a write through a list argument (torch._foreach_mul_) or through a `ds_tensor.data` handle held past
a step reaches the partition, not the master. fp32 with nvme or cpu optimizer offload: a modifier_rank edit
of a unit whose ds_tensor was written survives the step, and a write on another unit stays out of its
master (against one-process torch Adam, within 1e-6 of the largest element, as above).
"""
import importlib.util

import pytest
import torch
import torch.nn as nn

pytestmark = pytest.mark.skipif(importlib.util.find_spec("deepspeed") is None, reason="needs DeepSpeed")

CFG = {"train_micro_batch_size_per_gpu": 1, "optimizer": {"type": "Adam", "params": {"lr": 0.01}},
       "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0}}


X = torch.linspace(0.5, 1.5, 15).view(3, 5)    # no element near 0: Adam's step there would hang on rounding


class Scale(nn.Module):
    def __init__(self, shape, v):
        super().__init__()
        self.weight = nn.Parameter(torch.full(shape, v))

    def forward(self, x):
        return self.weight * x


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b = Scale((3, 5), 0.5), Scale((3, 5), -1.0)
        self.c = nn.Linear(5, 4, bias=False)
        with torch.no_grad():
            self.c.weight.copy_(torch.arange(20.0).view(4, 5) / 10)

    def forward(self, x):
        return self.c(self.b(self.a(x)))


def _record(rank, world, engine_name):
    from tests.ds_unit.harness import import_deepspeed
    ds = import_deepspeed(engine_name)
    torch.manual_seed(0)
    model = Net()
    engine, *_ = ds.initialize(model=model, model_parameters=model.parameters(), config=CFG)
    ws = [model.a.weight, model.b.weight, model.c.weight]
    out = {"numel": [w.ds_tensor.numel() for w in ws]}
    ws[0].ds_tensor.data = torch.full_like(ws[0].ds_tensor.data, 2.0 + rank)
    ws[1].ds_tensor.data = torch.arange(ws[1].ds_tensor.numel(), dtype=torch.float32) * (rank + 1)
    ws[2].ds_tensor.mul_(-3.0)
    out["hp"] = [ds.utils.safe_get_local_fp32_param(w).clone() for w in ws]   # fp32 partitions: not written
    x = X
    for it in range(3):
        y = engine(x)
        out[f"y{it}"] = y.detach().clone()
        engine.backward((y * y).sum())
        out[f"g{it}"] = [g.clone() for g in engine.optimizer.get_fp32_grad_partitions()[0].values()]
        if it < 2:
            engine.step()
        else:
            engine.optimizer.zero_grad()
            engine.backward((engine(x) ** 3).sum())
            out["g_after_zero_grad"] = [g.clone() for g in engine.optimizer.get_fp32_grad_partitions()[0].values()]
            engine.optimizer.step()
        out[f"part{it}"] = [w.ds_tensor.clone() for w in ws]
        with ds.zero.GatheredParameters(ws):
            out[f"full{it}"] = [w.detach().clone() for w in ws]
    return out


def _shared(rank, world):
    from tests.ds_unit.harness import import_deepspeed
    ds = import_deepspeed("ringzero")
    model = nn.Sequential(nn.Linear(4, 4), Scale((3,), 1.0))
    engine, *_ = ds.initialize(model=model, model_parameters=model.parameters(), config=CFG)
    got = []
    for p in (model[0].weight, model[0].bias):
        with pytest.raises(NotImplementedError) as e:
            p.ds_tensor.data
        got.append(str(e.value))
    w = model[1].weight
    w.ds_tensor.fill_(3.0)                                 # alone in its module: storage, no refusal
    from deepspeed.runtime.zero.offload_config import OffloadStateTypeEnum
    engine.offload_states(include=[OffloadStateTypeEnum.lp_params])   # the shard's storage leaves: refused, not read
    with pytest.raises(NotImplementedError, match="reload_states"):
        w.ds_tensor.clone()
    engine.reload_states()
    assert torch.equal(w.ds_tensor, torch.full((2,), 3.0))
    return got, p.ds_tensor.numel()


def _saved(rank, world, engine_name, d):
    """Write ds_tensors, save (ringzero's files and DeepSpeed's), load into a fresh engine: the fp32 masters."""
    from tests.ds_unit.harness import import_deepspeed
    ds = import_deepspeed(engine_name)
    model = Net()
    engine, *_ = ds.initialize(model=model, model_parameters=model.parameters(), config=CFG)
    model.a.weight.ds_tensor.data = torch.full_like(model.a.weight.ds_tensor.data, 7.0)
    model.c.weight.ds_tensor.mul_(-3.0)
    engine.save_checkpoint(d, tag="t")
    fresh = Net()
    with torch.no_grad():
        for w in fresh.parameters():
            w.fill_(9.0)                           # nothing of the saved values survives a load that drops them
    engine2, *_ = ds.initialize(model=fresh, model_parameters=fresh.parameters(), config=CFG)
    engine2.load_checkpoint(d, tag="t")
    out = {"hp": [ds.utils.safe_get_local_fp32_param(w).clone() for w in fresh.parameters()]}
    if rank == 0:
        from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint
        out["ds_files"] = {k: v.clone() for k, v in get_fp32_state_dict_from_zero_checkpoint(d, tag="t").items()}
    return out


def _edited(rank, world, bf16):
    """A ds_tensor write on a, then GatheredParameters(b, modifier_rank=0) edits b: the fp32 masters."""
    from tests.ds_unit.harness import import_deepspeed
    ds = import_deepspeed("ringzero")
    model = Net()
    cfg = {**CFG, "bf16": {"enabled": True}} if bf16 else CFG
    engine, *_ = ds.initialize(model=model, model_parameters=model.parameters(), config=cfg)
    model.a.weight.ds_tensor.fill_(7.0)
    with ds.zero.GatheredParameters([model.b.weight], modifier_rank=0):
        if rank == 0:
            model.b.weight.data.fill_(5.0)
    hp = [ds.utils.safe_get_local_fp32_param(w).clone() for w in (model.a.weight, model.b.weight)]
    return hp, model.a.weight.ds_tensor.float().clone()


def _frozen(rank, world):
    """Net with a frozen: a ds_tensor write there reaches every forward, across steps (fp32: not restored)."""
    from tests.ds_unit.harness import import_deepspeed
    ds = import_deepspeed("ringzero")
    model = Net()
    model.b.weight.requires_grad_(False)
    engine, *_ = ds.initialize(model=model, model_parameters=[p for p in model.parameters() if p.requires_grad],
                               config=CFG)
    model.b.weight.ds_tensor.data = torch.full_like(model.b.weight.ds_tensor.data, 2.0 + rank)
    ys = []
    for _ in range(2):
        y = engine(X)
        ys.append(y.detach().clone())
        engine.backward((y * y).sum())
        engine.step()
    with ds.zero.GatheredParameters([model.b.weight]):
        full = model.b.weight.detach().clone()
    return ys, full, model.b.weight.ds_tensor.clone()


def _flat(v):
    return [t for x in (v if isinstance(v, list) else [v]) for t in [x.reshape(-1)]]


def _reference(x):
    """One process: the full weights the ranks' writes assemble, their output and gradient, and one Adam step
    from the weights as initialized (the fp32 master the write did not touch)."""
    torch.manual_seed(0)
    net = Net()
    ws = [net.a.weight, net.b.weight, net.c.weight]
    start = [w.detach().clone() for w in ws]
    with torch.no_grad():
        ws[0].copy_(torch.tensor([2.0] * 8 + [3.0] * 7).view(3, 5))
        ws[1].copy_(torch.cat([torch.arange(8.0), torch.arange(7.0) * 2]).view(3, 5))
        ws[2].mul_(-3.0)
    y = net(x)
    (y * y).sum().backward()
    grads = [w.grad.clone() for w in ws]
    with torch.no_grad():
        for w, s in zip(ws, start):
            w.copy_(s)
    torch.optim.Adam(ws, lr=CFG["optimizer"]["params"]["lr"]).step()
    return y.detach(), grads, [w.detach() for w in ws]


def test_writes_reach_the_gather_and_not_the_master(spawn):
    y, grads, stepped = _reference(X)
    for r, got in enumerate(spawn(_record, 2, args=("ringzero",))):
        assert torch.equal(got["y0"], y)
        for hp, w in zip(got["hp"], Net().parameters()):       # as initialized (Net's weights do not use the seed)
            s = hp.numel()
            assert torch.equal(hp, torch.nn.functional.pad(w.detach().reshape(-1), (0, 2 * s - w.numel()))[r * s:(r + 1) * s])
        for g, part, w, full in zip(grads, got["g0"], stepped, got["full0"]):
            s = part.numel()
            mine = torch.nn.functional.pad(g.reshape(-1), (0, 2 * s - g.numel()))[r * s:(r + 1) * s]
            assert torch.allclose(part, mine, rtol=1e-6, atol=0)
            assert (full - w).abs().max() <= 1e-6 * w.abs().max()


@pytest.mark.slow
def test_ds_tensor_writes_train_as_deepspeeds(spawn):
    ours = spawn(_record, 2, args=("ringzero",))
    theirs = spawn(_record, 2, args=("deepspeed",), timeout=300.0)
    for r in range(2):
        assert ours[r]["numel"] == theirs[r]["numel"] == [8, 8, 10]
        assert sorted(ours[r]) == sorted(theirs[r])
        for k in theirs[r]:
            if k == "numel":
                continue
            for a, b in zip(_flat(ours[r][k]), _flat(theirs[r][k]), strict=True):
                assert a.dtype == b.dtype and a.shape == b.shape, (r, k)
                assert (a - b).abs().max() <= 1e-6 * b.abs().max(), (r, k, (a - b).abs().max())
    plain = Net()(X)     # the writes changed the first forward
    assert not torch.allclose(ours[0]["y0"], plain)


def test_checkpoint_between_a_write_and_the_step_saves_the_unwritten_master(spawn, tmp_path):
    init = dict(Net().named_parameters())       # the fp32 masters as DeepSpeed keeps them: a write does not reach them
    got = spawn(_saved, 2, args=("ringzero", str(tmp_path)))
    for r in range(2):                          # ringzero's own files, loaded into a fresh engine
        for hp, w in zip(got[r]["hp"], init.values()):
            s = hp.numel()
            assert torch.equal(hp, torch.nn.functional.pad(w.detach().reshape(-1), (0, 2 * s - w.numel()))[r * s:(r + 1) * s])
    assert sorted(got[0]["ds_files"]) == sorted(init)      # DeepSpeed's files, read by zero_to_fp32
    for k, w in init.items():
        assert torch.equal(got[0]["ds_files"][k], w.detach()), k


@pytest.mark.parametrize("bf16", [True, False])
def test_gathered_parameters_refresh_only_the_edited_units_master(spawn, bf16):
    """DeepSpeed keeps a ds_tensor write out of its fp32 master; a modifier_rank edit of another module
    must not carry it in (ringzero refreshes the edited unit's master only: z3_ds_tensor.refresh_units)."""
    a = Net().a.weight.detach().reshape(-1)
    for r, (hp, part) in enumerate(spawn(_edited, 2, args=(bf16,))):
        s = hp[0].numel()
        assert torch.equal(part, torch.full((s,), 7.0))                       # the write reaches the gathers
        assert torch.equal(hp[0], torch.nn.functional.pad(a, (0, 2 * s - a.numel()))[r * s:(r + 1) * s])
        assert torch.equal(hp[1][:15 - r * s], torch.full((min(s, 15 - r * s),), 5.0))   # the edit: ringzero's


def test_frozen_parameter_ds_tensor_writes_last(spawn):
    b = torch.tensor([2.0] * 8 + [3.0] * 7).view(3, 5)     # rank 0's partition, then rank 1's
    torch.manual_seed(0)
    net = Net()
    with torch.no_grad():
        net.b.weight.copy_(b)
    y0 = net(X)                                  # the first forward: the initial a, c and the written b
    for r, (ys, full, part) in enumerate(spawn(_frozen, 2)):
        assert torch.equal(ys[0], y0)
        assert torch.equal(full, b) and torch.equal(part, torch.full((8,), 2.0 + r))   # after two steps
        assert not torch.equal(ys[1], y0)        # a and c trained, b's write still in


def test_shared_module_and_offloaded_states_are_refused_on_every_rank(spawn):
    for got, numel in spawn(_shared, 2):
        assert numel == 2
        for msg in got:
            assert "shares its unit (module '0')" in msg and "have ds_tensor with storage, e.g. ['1.weight']" in msg


def _leaks(rank, world):
    """fp32: writes through a list argument and through a `.data` handle held past a step stay out of the master."""
    from tests.ds_unit.harness import import_deepspeed
    ds = import_deepspeed("ringzero")
    model = Net()
    engine, *_ = ds.initialize(model=model, model_parameters=model.parameters(), config=CFG)
    a, c = model.a.weight, model.c.weight
    hp0 = [ds.utils.safe_get_local_fp32_param(w).clone() for w in (a, c)]   # reads the master, uses no ds_tensor
    torch._foreach_mul_([a.ds_tensor], 2.0)        # the ds_tensor only inside a list
    out = {"hp0": hp0, "foreach": (ds.utils.safe_get_local_fp32_param(a).clone(), a.ds_tensor.clone())}
    d = c.ds_tensor.data
    engine.backward(engine(X).sum())
    engine.step()                                  # restores a's master and drops every kept copy
    hp1 = ds.utils.safe_get_local_fp32_param(c).clone()
    d.mul_(-3.0)                                   # through the handle taken before the step
    out["data"] = (hp1, ds.utils.safe_get_local_fp32_param(c).clone(), c.ds_tensor.clone())
    return out


def test_nested_and_data_handle_writes_stay_out_of_the_fp32_master(spawn):
    for got in spawn(_leaks, 2):
        hp_a, part_a = got["foreach"]
        assert torch.equal(part_a, 2 * got["hp0"][0])           # the write reaches the partition
        assert torch.equal(hp_a, got["hp0"][0])                 # not the master
        hp1, hp2, part_c = got["data"]
        assert torch.equal(part_c, -3 * hp1)                    # the handle writes the partition
        assert torch.equal(hp2, hp1)                            # not the master


def _offload_edit(rank, world, device, d):
    """fp32, optimizer offload: writes on a and b, a modifier_rank edit of a, a step."""
    from tests.ds_unit.harness import import_deepspeed
    ds = import_deepspeed("ringzero")
    model = Net()
    off = {"device": device, **({"nvme_path": d} if device == "nvme" else {})}
    cfg = {**CFG, "zero_optimization": {**CFG["zero_optimization"], "offload_optimizer": off}}
    engine, *_ = ds.initialize(model=model, model_parameters=model.parameters(), config=cfg)
    model.a.weight.ds_tensor.fill_(7.0)
    model.b.weight.ds_tensor.fill_(9.0)
    with ds.zero.GatheredParameters([model.a.weight], modifier_rank=0):
        if rank == 0:
            model.a.weight.data.fill_(5.0)
    engine.backward(engine(X).sum())
    engine.step()
    with ds.zero.GatheredParameters(list(model.parameters())):
        return [w.detach().clone() for w in model.parameters()]


@pytest.mark.parametrize("device", ["nvme", "cpu"])
def test_modifier_rank_edit_of_a_written_unit_survives_the_step_with_optimizer_offload(spawn, tmp_path, device):
    """The edit of a reaches the master (nvme: the shard is the master, its kept copy dropped); the write on
    b reaches the forward only (cpu: the edit refreshes a's host master, not b's)."""
    net = Net()                                    # one process: the forward after the edit and the writes
    start = [w.detach().clone() for w in net.parameters()]
    with torch.no_grad():
        net.a.weight.fill_(5.0)
        net.b.weight.fill_(9.0)
    net(X).sum().backward()
    with torch.no_grad():
        net.b.weight.copy_(start[1])               # b's master: not written; a's: the edit
    torch.optim.Adam(net.parameters(), lr=CFG["optimizer"]["params"]["lr"]).step()
    for got in spawn(_offload_edit, 2, args=(device, str(tmp_path))):
        for a, b in zip(got, net.parameters(), strict=True):
            assert (a - b).abs().max() <= 1e-6 * b.abs().max(), (a, b)
