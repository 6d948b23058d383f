"""ZeRO-3 specifics: a tiny DistilBERT equals the single-process model, parameters are empty
outside forward, gathered_parameters(modifier_rank=) edits reach every shard, and a module run a
different number of times on different ranks is an error naming the module, not a hang."""
import pytest
import torch
import torch.nn as nn

import zero_from_scratch
from zero_from_scratch import ZeroDivergenceError  # noqa: F401 (the public name must resolve)
from zero_from_scratch.engine.models import tiny_distilbert

CFG = {"train_micro_batch_size_per_gpu": 2, "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "weight_decay": 0.01}},
       "gradient_clipping": 1.0, "zero_optimization": {"stage": 3}}
# Per-module gather mechanics need every module partitioned: DeepSpeed's default persistence
# threshold (1e5 elements) would keep these tiny modules gathered for the whole step.
PARTITION_ALL = {**CFG, "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0}}


def tiny_bert(seed=0):
    return tiny_distilbert(vocab=100, hidden=64, max_positions=32, seed=seed)


def batch(step, rank):
    g = torch.Generator().manual_seed(100 * step + rank)
    return {"input_ids": torch.randint(0, 100, (2, 12), generator=g), "labels": torch.randint(0, 2, (2,), generator=g)}


def _bert(rank, world, stage):
    model = tiny_bert()
    engine, *_ = zero_from_scratch.initialize(model=model, model_parameters=model.parameters(),
                                              config={**CFG, "zero_optimization": {"stage": stage}})
    empty = all(p.numel() == 0 for p in model.parameters()) if stage == 3 else None
    losses = []
    for step in range(10):
        loss = engine(**batch(step, rank)).loss
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    with engine.gathered_parameters(model.parameters()):
        final = {n: p.detach().tolist() for n, p in model.named_parameters()}
    return losses, empty, final


def test_tiny_distilbert_stage3_equals_single_process(spawn):
    world = 2
    res = spawn(_bert, world, args=(3,))
    model = tiny_bert()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.01, foreach=False)
    ref = {r: [] for r in range(world)}
    for step in range(10):
        opt.zero_grad()
        for r in range(world):
            loss = model(**batch(step, r)).loss
            (loss / world).backward()
            ref[r].append(loss.item())
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
    for r, (losses, empty, final) in enumerate(res):
        assert empty, "stage 3 must leave parameters empty outside forward"
        # fp32 summation order only (see test_zero_parity.py). Weights: Adam divides m by sqrt(v), so an
        # element whose gradient is at rounding level (~1e-9, e.g. a bias whose gradient cancels) can move by
        # up to lr = 1e-2 per step either way; atol 1e-4 (1% of one step) still catches any real bug.
        torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref[r]), rtol=1e-5, atol=1e-5)
        for n, p in model.named_parameters():
            torch.testing.assert_close(torch.tensor(final[n]), p.detach(), rtol=1e-4, atol=1e-4,
                                       msg=lambda m: f"rank {r} {n}: {m}")


def _modify(rank, world):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 6), nn.ReLU(), nn.Linear(6, 2))
    engine, *_ = zero_from_scratch.initialize(model=model, config=CFG)
    shape_outside = tuple(model[0].weight.shape)
    with engine.gathered_parameters([model[0].weight], modifier_rank=1):
        shape_inside = tuple(model[0].weight.shape)
        if rank == 1:
            model[0].weight.data.fill_(0.5)      # only rank 1's edit should survive
        else:
            model[0].weight.data.fill_(-9.0)
    out = engine(torch.ones(1, 4))               # forward gathers the edited shards
    with engine.gathered_parameters(model[0].weight):
        w = model[0].weight.detach().clone()
    return shape_outside, shape_inside, w.tolist(), out.shape[-1]


def test_gathered_parameters_modifier_rank(spawn):
    for shape_out, shape_in, w, _ in spawn(_modify, 3):
        assert shape_out == (0,) and shape_in == (6, 4)
        assert torch.equal(torch.tensor(w), torch.full((6, 4), 0.5))


class Branchy(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(4, 4), nn.Linear(4, 4)

    def forward(self, x, times):
        for _ in range(times):
            x = self.a(x)
        return self.b(x).sum()


def _diverge(rank, world, impl):
    torch.manual_seed(0)
    engine, *_ = zero_from_scratch.initialize(model=Branchy(), config=PARTITION_ALL, comm_impl=impl)
    loss = engine(torch.ones(2, 4), times=1 if rank == 0 else 2)   # rank 1 runs `a` twice
    engine.backward(loss)
    return "no error"


@pytest.mark.parametrize("impl", ["primitives", "torch"])   # tag in the handshake / separate check round
def test_divergent_module_calls_raise_naming_the_module(spawn, impl):
    res = spawn(_diverge, 2, args=(impl,), allow_fail=True)
    assert all(status == "error" for status, _ in res), res
    for status, tb in res:
        assert "ZeroDivergenceError" in tb and "'a'" in tb and "'b'" in tb and "call #" in tb


def _freed_between_forward_and_backward(rank, world):
    """Every buffer gathered for forward must be back in the engine's pool before backward starts,
    nothing else holding it (autograd saves a reference to the unit, not the tensor: a buffer
    something kept would leave the pool as `escaped`), and backward must still see the weights."""
    import gc

    from torch.multiprocessing.reductions import StorageWeakRef   # a weak reference to the bytes
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 32), nn.LayerNorm(32), nn.Linear(32, 1))
    engine, *_ = zero_from_scratch.initialize(model=m, model_parameters=m.parameters(), config=PARTITION_ALL)
    st, refs, saved_as_refs = engine.stage, [], []
    gather, pack = st._gather, st.saved.pack

    def spy_gather(u, kind, label):
        gather(u, kind, label)
        if kind == "forward":
            refs.append(StorageWeakRef(st.full_of[u.index].untyped_storage()))
    st._gather = spy_gather
    st.saved.pack = lambda t: (lambda r: (saved_as_refs.append(isinstance(r, tuple)), r)[1])(pack(t))
    x = torch.randn(2, 16, generator=torch.Generator().manual_seed(1)).requires_grad_()  # so W.t() is saved
    loss = engine(x).sum()
    gc.collect()
    alive = st.units_pool.in_use + st.units_pool.escaped   # bytes handed out, buffers something kept
    engine.backward(loss)                       # must still find every weight it saved
    engine.step()
    return len(refs), alive, sum(saved_as_refs)


def test_gathered_weights_are_freed_between_forward_and_backward(spawn):
    for n_gathered, alive, n_refs in spawn(_freed_between_forward_and_backward, 2):
        assert n_gathered == 4                  # four modules own parameters (GELU has none)
        assert alive == 0, f"gathered buffers not back in the pool after forward ({alive})"
        assert n_refs >= 3                      # the Linear weights were saved by reference


def test_pool_reuses_a_buffer_only_when_nothing_else_holds_it():
    """engine/pools.py without processes: a buffer given back is handed out again; one that a view
    still sees leaves the pool (escaped) and the next take allocates, so two owners never share bytes."""
    from zero_from_scratch.engine.pools import Pool
    p = Pool("test", torch.float32, torch.device("cpu"))
    a = p.take(8)
    a.fill_(1.0)
    p.give(a)
    assert p.take(8) is a and p.allocs == 1 and p.held == 32
    view = a[2:4]
    p.give(a)
    b = p.take(8)
    assert b is not a and p.escaped == 1 and p.allocs == 2
    b.fill_(2.0)
    assert view.tolist() == [1.0, 1.0]          # the kept view's bytes are untouched
    assert p.take(4).numel() == 4 and p.allocs == 3   # sizes are exact: no buffer of 8 serves 4


def _pooled_steps(rank, world):
    torch.manual_seed(0)
    m = nn.Sequential(*[nn.Linear(32, 32) for _ in range(6)])
    cfg = {**CFG, "zero_optimization": {"stage": 3, "overlap_comm": True, "stage3_param_persistence_threshold": 0,
                                        "stage3_max_live_parameters": 3000, "stage3_prefetch_bucket_size": 3000}}
    engine, *_ = zero_from_scratch.initialize(model=m, model_parameters=m.parameters(), config=cfg)
    allocs, losses = [], []
    for step in range(4):
        x = torch.randn(2, 32, generator=torch.Generator().manual_seed(10 * step + rank))
        loss = engine(x).pow(2).mean()
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
        allocs.append(engine.stage.units_pool.allocs)
    return allocs, engine.stage.units_pool.report(), losses


def test_gathered_units_come_from_a_pool_that_stops_growing(spawn):
    """After the first step (which records the trace) each step allocates the same few buffers and
    every other gather reuses one (the pool is emptied after backward: the engine's allocator
    setting returns them to the system, allocator.py), nothing escaped, and the pool holds no more
    than the live bound allows (3000 elements → two units of 1056)."""
    for allocs, rep, _ in spawn(_pooled_steps, 2):
        assert allocs[1] - allocs[0] == allocs[2] - allocs[1] == allocs[3] - allocs[2] <= 3, allocs
        assert rep["escaped"] == 0 and rep["takes"] > 4 * rep["allocations"], rep
        assert rep["held_bytes"] <= 2 * 4 * 1056 + 4 * 1056, rep   # two live + one demand beyond the cap


class _TiedLM(nn.Module):
    """An embedding whose weight is also the output layer's (T5's, GPT's tying): two modules, one leaf."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.emb, self.mid, self.head = nn.Embedding(50, 16), nn.Linear(16, 16), nn.Linear(16, 50, bias=False)
        self.head.weight = self.emb.weight

    def forward(self, ids):
        return self.head(torch.tanh(self.mid(self.emb(ids)))).view(-1, 50)


def _tied_batch(step, rank):
    g = torch.Generator().manual_seed(10 * step + rank)
    return torch.randint(0, 50, (2, 6), generator=g), torch.randint(0, 50, (12,), generator=g)


def _tied(rank, world):
    model = _TiedLM()
    engine, *_ = zero_from_scratch.initialize(model=model, config=PARTITION_ALL)
    losses = []
    for step in range(4):
        ids, y = _tied_batch(step, rank)
        loss = nn.functional.cross_entropy(engine(ids), y)
        engine.backward(loss)
        kept = [p.grad for p in model.parameters()]
        engine.step()
        losses.append(loss.item())
    return losses, engine.stage.tied is not None, all(g is None for g in kept), model.head.weight is model.emb.weight


def test_tied_parameter_gradient_goes_to_the_bucket_use_by_use(spawn):
    """Each use's gradient is added to the unit's bucket by tied.py's alias (autograd keeps no sum of
    its own); the training equals one process's on the same batches (fp32 summation order only)."""
    world = 2
    res = spawn(_tied, world)
    model = _TiedLM()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.01, foreach=False)
    ref = {r: [] for r in range(world)}
    for step in range(4):
        opt.zero_grad()
        for r in range(world):
            ids, y = _tied_batch(step, r)
            loss = nn.functional.cross_entropy(model(ids), y)
            (loss / world).backward()
            ref[r].append(loss.item())
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
    for r, (losses, tied, no_grads, still_tied) in enumerate(res):
        assert tied and no_grads and still_tied
        torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref[r]), rtol=1e-5, atol=1e-5)
