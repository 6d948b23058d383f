"""DeepSpeed's ZeRO-3 Linear under the runner (zero_from_scratch/as_deepspeed/z3lin_linear.py): the numbers
and what a forward keeps for backward.

    python -m pytest -q tests/test_zero3_linear.py          (2 ranks, against one process, ~10 s)

Under the runner at stage 3, F.linear is DeepSpeed's LinearFunctionForZeroStage3, which saves the weight
Parameter object itself for backward (torch's F.linear saves Wᵀ, a view of the gathered buffer). Checked:
- numbers: an MLP with 2-D and 3-D inputs, a bias-free layer and a weight read by the parent module (an
  external parameter, gathered again in backward), 3 Adam steps on 2 ranks, against one-process torch
  (torch's F.linear, torch's Adam, both ranks' data; clipping off: DeepSpeed's default clips at 1.0): losses and trained weights within 1e-6 relative
  (the same products; the reference sums the two ranks' gradients in autograd's order, the engine in its
  reduce-scatter's: last-bit differences);
- memory: after the forward, every weight buffer gathered for a Linear is freed (its storage, seen by a
  forward pre-hook, has expired) although the Parameters are saved for backward; a Linear saving
  `weight.detach()` instead (the mutation) keeps the buffer alive, and the same check sees it;
- memory_efficient_linear: false keeps torch's F.linear.
"""
import torch
import torch.nn as nn
import torch.nn.functional as F

from primitives.launch import spawn

STEPS, LR = 3, 0.05


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b, self.c = nn.Linear(6, 8), nn.Linear(8, 8, bias=False), nn.Linear(8, 2)
        self.side = nn.Linear(8, 8)

    def forward(self, x):                       # x: (batch, 3, 6): the 3-D path, then 2-D
        h = torch.tanh(self.b(torch.tanh(self.a(x))))
        h = h + F.linear(h, self.side.weight)   # a weight the parent reads: external to `side`
        return self.c(h.mean(1))


def _data(rank):
    g = torch.Generator().manual_seed(10 + rank)
    return [(torch.randn(4, 3, 6, generator=g), torch.randn(4, 2, generator=g)) for _ in range(STEPS)]


def _config(linear=True):
    return {"train_micro_batch_size_per_gpu": 4, "gradient_clipping": 0.0, "optimizer": {"type": "Adam", "params": {"lr": LR}},
            "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0, "stage3_prefetch_bucket_size": 0,
                                  "stage3_max_reuse_distance": 0, "memory_efficient_linear": linear}}   # no prefetch: it
    # would keep the weights gathered past their forward (DeepSpeed's coordinator, prefetch.py ds_order)


class _KeepsData(torch.autograd.Function):
    """The mutation: DeepSpeed's Linear saving the weight's data (a tensor on the gathered buffer)."""

    @staticmethod
    def forward(ctx, x, w, b):
        ctx.save_for_backward(x, w.detach())
        return x.matmul(w.t()) + b

    @staticmethod
    def backward(ctx, g):
        x, w = ctx.saved_tensors
        g2, x2 = g.reshape(-1, g.shape[-1]), x.reshape(-1, x.shape[-1])
        return g.matmul(w), g2.t().matmul(x2), g2.sum(0)


def _alive_after_forward(engine, model, x):
    """engine(x), and per Linear forward whether the weight buffer gathered for it is still alive after it."""
    seen = []
    handles = [m.register_forward_pre_hook(lambda m, a: seen.append(m.weight.untyped_storage()._weak_ref()))
               for m in (model.a, model.b, model.c)]      # after the engine's gather hook (registered first)
    out = engine(x)
    for h in handles:
        h.remove()
    alive = [not torch.UntypedStorage._expired(w) for w in seen]
    for w in seen:
        torch.UntypedStorage._free_weak_ref(w)
    return out, alive


def _rank(rank, world, linear):
    from tests.ds_unit.harness import import_deepspeed
    ds = import_deepspeed("ringzero")
    ds.init_distributed(dist_backend="gloo")
    from deepspeed.runtime.zero.linear import zero3_linear_wrap
    torch.manual_seed(0)
    model = Net()
    engine, *_ = ds.initialize(model=model, model_parameters=model.parameters(), config=_config(linear))
    swapped = F.linear is zero3_linear_wrap
    losses, alive = [], []
    for x, y in _data(rank):
        out, kept = _alive_after_forward(engine, model, x)
        alive += kept
        loss = F.mse_loss(out, y)
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    with ds.zero.GatheredParameters(list(model.parameters())):
        weights = {n: p.detach().clone() for n, p in model.named_parameters()}
    mutated = None
    if swapped:       # the same check on a function that keeps the gathered buffer: it must see it
        from zero_from_scratch.engine.saved import plain_saves

        def keeps(x):
            with plain_saves():
                return _KeepsData.apply(x, model.a.weight, model.a.bias)
        model.a.forward = keeps
        _, mutated = _alive_after_forward(engine, model, _data(rank)[0][0])
    return swapped, losses, weights, alive, mutated


def _rel(a, b):
    return (a - b).abs().max().item() / max(b.abs().max().item(), 1e-12)


def _reference_losses():
    torch.manual_seed(0)
    model = Net()
    opt = torch.optim.Adam(model.parameters(), lr=LR)
    per_rank = [[], []]
    for step in range(STEPS):
        batches = [_data(r)[step] for r in range(2)]
        losses = [F.mse_loss(model(x), y) for x, y in batches]
        for r in range(2):
            per_rank[r].append(losses[r].item())
        opt.zero_grad()
        (sum(losses) / 2).backward()
        opt.step()
    return model, per_rank


def test_zero3_linear_numbers_and_freed_buffers():
    ref, ref_losses = _reference_losses()
    want = dict(ref.named_parameters())
    for rank, (swapped, losses, weights, alive, mutated) in enumerate(spawn(_rank, 2, args=(True,), timeout=120)):
        assert swapped
        for got, exp in zip(losses, ref_losses[rank]):
            assert abs(got - exp) <= 1e-6 * abs(exp), (rank, losses, ref_losses[rank])
        for n, w in weights.items():
            assert _rel(w, want[n].detach()) <= 1e-6, n
        assert alive and not any(alive), alive        # every weight gathered for forward is gone after it
        assert mutated and any(mutated)               # the check sees a buffer kept by a saved tensor


def test_memory_efficient_linear_false_keeps_torch_linear():
    for swapped, losses, *_ in spawn(_rank, 2, args=(False,), timeout=120):
        assert not swapped and len(losses) == STEPS
