"""Tensor-parallel building blocks against one process (no transformers needed): the f/g and
sequence-parallel operators, the layers with uneven splits, the vocab-parallel cross-entropy,
an MLP stack after 5 AdamW steps, Ulysses attention, and bad input on every rank.

Tolerance 1e-5 (fp32): the parallel and the single-process computations differ only in the
order of floating-point sums (~1e-7 relative here); any wrong shard or missing/doubled
reduction is O(1).
"""
import copy
import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import primitives as P

TOL = 1e-5


def reference_attention(x, q, k, v, o, n_heads, key_mask=None):
    """The same attention on the whole sequence, one process: what UlyssesAttention must equal."""
    b, s, h = x.shape
    d = h // n_heads
    heads = lambda t: t.view(b, s, n_heads, d).transpose(1, 2)  # noqa: E731
    scores = heads(q(x)) @ heads(k(x)).transpose(-1, -2) / math.sqrt(d)
    if key_mask is not None:
        scores = scores.masked_fill(~key_mask[:, None, None, :], torch.finfo(scores.dtype).min)
    return o((scores.softmax(-1) @ heads(v(x))).transpose(1, 2).reshape(b, s, h))


def _close(errs, what, a, b):
    d = (a.detach().double() - b.detach().double()).abs().max().item() if a.numel() else 0.0
    if not d <= TOL or a.shape != b.shape:
        errs.append(f"rank {P.get_comm().rank}: {what}: max diff {d:.3g}, shapes {tuple(a.shape)} vs {tuple(b.shape)}")


def _layers(rank, n):
    import tensor_parallel as tp
    from tensor_parallel.comm import gather_seq, scatter_seq, split_seq
    from tensor_parallel.engine.ulysses import UlyssesAttention
    from tensor_parallel.engine.uneven import gather_last_dim, scatter_last_dim
    comm = P.get_comm()
    errs = []
    g = torch.Generator().manual_seed(0)
    x = torch.randn(2, 6, 7, generator=g)                    # same on every rank (seeded)
    w = torch.randn(2, 6, 11, generator=g)                   # a fixed upstream gradient

    # f then g: y = g(f(x)·A_r) summed over ranks == x·Σ A_r; ∂/∂x via f's all-reduce
    xs, xr = x.clone().requires_grad_(), x.clone().requires_grad_()
    A = torch.randn(n, 7, 11, generator=g)
    tp.reduce_from_tp(tp.copy_to_tp(xs, comm) @ A[rank], comm).mul(w).sum().backward()
    (xr @ A.sum(0)).mul(w).sum().backward()
    _close(errs, "f/g grad", xs.grad, xr.grad)

    # ColumnParallelLinear, its output gathered → plain; RowParallelLinear from a replicated input
    lin1, lin2 = nn.Linear(7, 13), nn.Linear(13, 11)         # 13 outputs: uneven at n = 2, 3
    ref = nn.Sequential(copy.deepcopy(lin1), copy.deepcopy(lin2))
    col, row = tp.ColumnParallelLinear(lin1, comm), tp.RowParallelLinear(lin2, comm)
    xs, xr = x.clone().requires_grad_(), x.clone().requires_grad_()
    ys, yr = row(scatter_last_dim(gather_last_dim(col(xs), 13, comm), 13, comm)), ref(xr)
    _close(errs, "column(gather)→row(scatter) forward", ys, yr)
    ys.mul(w).sum().backward()
    yr.mul(w).sum().backward()
    _close(errs, "input grad", xs.grad, xr.grad)
    lo, hi = col.bounds
    _close(errs, "column weight grad", col.weight.grad, ref[0].weight.grad[lo:hi])
    lo, hi = row.bounds
    _close(errs, "row weight grad", row.weight.grad, ref[1].weight.grad[:, lo:hi])
    _close(errs, "row bias grad", row.bias.grad, ref[1].bias.grad)

    # sequence-parallel operators: split → gather == identity; reduce-scatter of a sum
    seq = x.clone().requires_grad_()
    part = split_seq(seq, comm)
    gathered = gather_seq(part * (rank + 1), comm)                  # rank r scales its slice
    scat = scatter_seq(gathered, comm)                              # Σ_r gathered, my slice
    scat.sum().backward()
    full = torch.cat([c * (r + 1) for r, c in enumerate(x.chunk(n, 1))], 1) * n
    _close(errs, "gather/scatter_seq forward", scat, full.chunk(n, 1)[rank])

    # VocabParallelEmbedding vs nn.Embedding (padding_idx kept), vocab 23 (uneven)
    emb = nn.Embedding(23, 5, padding_idx=3)
    remb = copy.deepcopy(emb)
    vemb = tp.VocabParallelEmbedding(emb, comm)
    ids = torch.randint(0, 23, (4, 9), generator=g)
    ids[0, :3] = 3
    ws = torch.randn(4, 9, 5, generator=g)
    ve, re = vemb(ids), remb(ids)
    _close(errs, "vocab embedding forward", ve, re)
    ve.mul(ws).sum().backward()
    re.mul(ws).sum().backward()
    _close(errs, "vocab embedding grad", vemb.weight.grad, remb.weight.grad[vemb.vocab_start:vemb.vocab_end])

    # vocab-parallel cross-entropy vs F.cross_entropy on the full logits
    logits = torch.randn(4, 9, 23, generator=g) * 3
    target = torch.randint(0, 23, (4, 9), generator=g)
    lp = logits[..., vemb.vocab_start:vemb.vocab_end].clone().requires_grad_()
    lf = logits.clone().requires_grad_()
    ls = tp.vocab_parallel_cross_entropy(lp, target, 23, comm)
    lr = F.cross_entropy(lf.view(-1, 23), target.view(-1))
    _close(errs, "vocab-parallel cross-entropy", ls, lr)
    ls.backward()
    lr.backward()
    _close(errs, "vocab-parallel cross-entropy grad", lp.grad, lf.grad[..., vemb.vocab_start:vemb.vocab_end])

    # Ulysses attention on s/N positions vs full attention (4 heads: N = 2 only divides them)
    if 4 % n == 0:
        h, s = 8, 4 * n
        q, k, v, o = (nn.Linear(h, h) for _ in range(4))
        ua = UlyssesAttention(q, k, v, o, 4)
        xf = torch.randn(2, s, h, generator=g)
        wf = torch.randn(2, s, h, generator=g)
        mask = torch.ones(2, s, dtype=torch.bool)
        mask[1, -2:] = False
        xl = xf.chunk(n, 1)[rank].clone().requires_grad_()
        xr = xf.clone().requires_grad_()
        yl, yr = ua(xl, mask), reference_attention(xr, q, k, v, o, 4, mask)
        _close(errs, "ulysses forward", yl, yr.chunk(n, 1)[rank])
        yl.mul(wf.chunk(n, 1)[rank]).sum().backward()
        yr.mul(wf).sum().backward()
        _close(errs, "ulysses input grad", xl.grad, xr.grad.chunk(n, 1)[rank])
        for name, m in (("q", q), ("k", k), ("v", v), ("o", o)):
            _close(errs, f"ulysses {name} weight grad", getattr(ua, name).weight.grad, m.weight.grad)
    return errs


def test_layers_operators_cross_entropy_ulysses(spawn):
    for n in (2, 3):
        errs = [e for r in spawn(_layers, n) for e in r]
        assert not errs, "\n".join(errs)


def _mlp(rank, n):
    """A plain MLP stack, parallelized in place, vs itself unsharded: 5 AdamW steps."""
    import tensor_parallel as tp
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 17), nn.GELU(), nn.Linear(17, 9), nn.ReLU(), nn.Linear(9, 10),
                          nn.Tanh(), nn.Linear(10, 6), nn.Linear(6, 3))
    ref = copy.deepcopy(model)
    tp.parallelize(model)
    opt, ropt = (torch.optim.AdamW(m.parameters(), lr=1e-2) for m in (model, ref))
    errs = []
    for step in range(5):
        g = torch.Generator().manual_seed(step)
        x, y = torch.randn(8, 6, generator=g), torch.randint(0, 3, (8,), generator=g)
        for m, o in ((model, opt), (ref, ropt)):
            F.cross_entropy(m(x), y).backward()
            o.step()
            o.zero_grad()
    full, rsd = tp.gather_state_dict(model), ref.state_dict()
    for k in rsd:
        _close(errs, f"MLP {k} after 5 steps", full[k], rsd[k])
    local, whole = tp.sharded_numel(model)
    return errs, local, whole


def test_mlp_stack_after_5_adamw_steps(spawn):
    res = spawn(_mlp, 3)
    errs = [e for r in res for e in r[0]]
    assert not errs, "\n".join(errs)
    assert sum(r[1] for r in res) < 3 * res[0][2], "sharding saved no parameters"


def _bad(rank, n):
    import torch.distributed as dist

    import tensor_parallel as tp
    from primitives.mesh import Mesh
    out = []
    sub = dist.new_group([0, 1])

    def catch(label, fn, words):
        try:
            fn()
            out.append((label, "no error", words))
        except Exception as e:
            out.append((label, f"{type(e).__name__}: {e}", words))
    catch("unknown model", lambda: tp.parallelize(nn.LSTM(3, 3)), ["'LSTM'", "no tensor-parallel plan"])
    catch("MLP with a conv", lambda: tp.parallelize(nn.Sequential(nn.Linear(3, 4), nn.Conv1d(4, 4, 1), nn.Linear(4, 2))),
          ["'1'", "Conv1d"])
    catch("MLP with SP", lambda: tp.parallelize(nn.Sequential(nn.Linear(3, 4), nn.Linear(4, 2)), sequence_parallel=True),
          ["sequence_parallel=True"])
    catch("too few outputs", lambda: tp.ColumnParallelLinear(nn.Linear(3, n - 1), P.get_comm()), [f"tp={n}", "at least one"])
    catch("mesh does not factor", lambda: Mesh.build(dp=2, tp=2), ["does not factor", f"world size {n}"])
    if rank == 2:     # not a member of `sub`
        catch("model outside its group", lambda: tp.parallelize(nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4)), sub),
              ["parallelize", "not a member"])
    return out


def test_bad_input_clear_error_on_every_rank(spawn):
    problems = []
    for rank, rows in enumerate(spawn(_bad, 3)):
        for label, msg, words in rows:
            missing = [w for w in [f"rank {rank}"] + words if w not in msg]
            if missing:
                problems.append(f"[{label}] rank {rank}: {msg} (missing {missing})")
    assert not problems, "\n".join(problems)


@pytest.mark.slow
def test_demo_runs_under_torchrun():
    """dp = 2 × tp = 2 on the offline DistilBERT: the mesh, the loss and the per-rank table."""
    from conftest import run_cmd
    from primitives.launch import free_port
    r = run_cmd(f"torchrun --standalone --master_port {free_port()} --nproc_per_node 4 classification/parallel/train.py "
                "--dp 2 --tp 2 --steps 2 --eval-samples 16", timeout=900)
    assert "mesh dp=2 × pp=1 × tp=2" in r.stdout and "step    1  loss" in r.stdout and "TP bytes sent/step" in r.stdout
