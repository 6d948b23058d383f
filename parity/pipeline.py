"""Parity: our pipeline engine vs one process vs DeepSpeed's pipeline engine, step by step.

    python -m parity.pipeline --pp 2 --schedule 1f1b --steps 3
    python -m parity.pipeline --pp 2 --dp 2 --schedule interleaved --virtual-stages 2 --deepspeed

Every side trains the same GPT-style layer list (pipeline_parallel/engine/model.py, seed_layers: layer i
is built after torch.manual_seed(1234 + i), wherever it is built) on the same micro-batches:
replica d of step t reads micro-batches (t, d, 0 … m−1) of a seeded token stream. The reference
is one process running the layers in order, loss = mean over the dp·m micro-batches, global-norm
clipping, torch AdamW. Returned per side: the per-step losses and every parameter at the end,
named "<layer index>.<name>" (tied modules: "tied.<key>.<name>"); the last "loss" is an
eval_batch on unseen micro-batches after training.

Why not bit-identical: gradient accumulation adds micro-batch gradients in schedule order (GPipe,
1F1B and the reference all add 0, 1, …, m−1, but as separate backward passes into .grad, where the
reference sums the losses first), and the dp mean is an all-reduce then ÷ dp. Each is one rounding
per element (≈ 6e-8 relative in fp32); AdamW's update is ≲ lr per step whatever the gradient's
scale, so after S steps parameters differ by ≲ S·lr·1e-6 — the 1e-5 tolerance is ≥ 10× that and
≥ 100× below the effect of a real bug (a missing ÷ m moves every update by up to lr).
The DeepSpeed side builds its engine with pipeline_parallel/engine/deepspeed_engine.py.
"""
from __future__ import annotations

import argparse

import torch
import torch.nn as nn
from rich.table import Table

from pipeline_parallel.engine.model import gpt_layers, lm_loss
from pipeline_parallel.engine.deepspeed_engine import deepspeed_engine
from pipeline_parallel.engine.module import LayerSpec, PipelineModule, TiedLayerSpec
from pipeline_parallel.engine.ds_pipe import initialize
from primitives.launch import spawn
from primitives.log import console

VOCAB, DIM, SEQ = 97, 32, 16


def reference_model(layers: list, base_seed: int = 1234) -> nn.Module:
    """The same layers in one process, built with the same per-layer seeds (seed_layers=True)."""
    built, tied, fns = [], {}, []
    for i, spec in enumerate(layers):
        if isinstance(spec, TiedLayerSpec):
            if spec.key not in tied:
                torch.manual_seed(base_seed + i)
                tied[spec.key] = spec.build()
            built.append(tied[spec.key])
            fns.append(spec.forward_fn)
        elif isinstance(spec, LayerSpec):
            torch.manual_seed(base_seed + i)
            built.append(spec.build())
            fns.append(None)
        else:
            built.append(spec)
            fns.append(None)

    class Sequential(nn.Module):
        def __init__(self):
            super().__init__()
            self.layers = nn.ModuleList([m for m in built if isinstance(m, nn.Module)])

        def forward(self, x):
            for m, fn in zip(built, fns):
                x = fn(m, x) if fn is not None else m(x)
            return x

    return Sequential()


def make_layers(n_layers: int = 4):
    return gpt_layers(vocab=VOCAB, dim=DIM, n_layers=n_layers, heads=2, max_len=SEQ)


def micro_batch(step: int, replica: int, mb: int, b: int):
    g = torch.Generator().manual_seed(100_003 * step + 1_009 * replica + mb)
    ids = torch.randint(0, VOCAB, (b, SEQ + 1), generator=g)
    return ids[:, :-1].contiguous(), ids[:, 1:].contiguous()


def data_iter(step: int, replica: int, m: int, b: int, extra: int = 0):
    return iter([micro_batch(step, replica, i, b) for i in range(m + extra)])


def ds_config(b: int, m: int, clip: float, lr: float = 3e-3, schedule: str | None = None, v: int = 1,
              clip_norm: str = "global") -> dict:
    cfg = {"train_micro_batch_size_per_gpu": b, "gradient_accumulation_steps": m, "steps_per_print": 10 ** 9,
           "optimizer": {"type": "AdamW", "params": {"lr": lr, "weight_decay": 0.01, "torch_adam": True}},
           "gradient_clipping": clip}
    if schedule:
        cfg["pipeline"] = {"schedule": schedule, "virtual_stages": v, "clip_norm": clip_norm}
    return cfg


def named_params(engine=None, ds_module=None) -> dict:
    """Every parameter this rank owns; tied copies only from their first holder."""
    out = {}
    if ds_module is not None:
        for n, p in ds_module.named_parameters():
            if not getattr(p, "ds_pipe_replicated", False):
                out[n.replace("tied_modules.", "tied.")] = p.detach().clone()
        return out
    for ch in engine.chunks:
        for n, p in ch.named_parameters():
            if not engine.tied.is_replica(p):
                out[n.replace("layers.", "", 1)] = p.detach().clone()
    return out


def reference(n_layers, dp, m, b, steps, clip, lr=3e-3, norm_layers=None):
    """One process. norm_layers: clip by the norm of these layers' gradients only (to reproduce
    DeepSpeed, whose fp32 pipeline clipping sums only model-parallel rank 0's = stage 0's norms)."""
    layers = make_layers(n_layers)
    model = reference_model(layers)
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.01)
    losses = []
    for t in range(steps):
        total = 0.0
        for d in range(dp):
            for i in range(m):
                x, y = micro_batch(t, d, i, b)
                loss = lm_loss(model(x), y) / (dp * m)
                loss.backward()
                total += float(loss.detach())
        if clip > 0 and norm_layers is None:
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        elif clip > 0:
            mods = _built(model, layers)
            sub = list({id(p): p for i in norm_layers for p in mods[i].parameters() if p.grad is not None}.values())
            norm = float(torch.stack([p.grad.norm() for p in sub]).pow(2).sum().sqrt())
            coef = clip / (norm + 1e-6)
            if coef < 1:
                for p in model.parameters():
                    if p.grad is not None:
                        p.grad.mul_(coef)
        opt.step()
        opt.zero_grad()
        losses.append(total)
    with torch.no_grad():     # eval_batch after training: mean loss over replica d's micro-batches of "step 99"
        evaluation = sum(float(lm_loss(model(x), y)) for d in range(dp) for x, y in
                         (micro_batch(99, d, i, b) for i in range(m))) / (dp * m)
    losses.append(evaluation)
    params, built = {}, _built(model, layers)
    for i, spec in enumerate(layers):
        key = getattr(spec, "key", None)
        prefix = f"tied.{key}" if key is not None else str(i)
        for n, p in built[i].named_parameters():
            params[f"{prefix}.{n}"] = p.detach().clone()
    return losses, params


def _built(model, layers):
    """Layer index -> module of the reference (tied positions share one module)."""
    mods, it, tied = {}, iter(model.layers), {}
    for i, spec in enumerate(layers):
        key = getattr(spec, "key", None)
        if key is not None and key in tied:
            mods[i] = tied[key]
            continue
        mods[i] = next(it)
        if key is not None:
            tied[key] = mods[i]
    return mods


def ours(rank, world, n_layers, pp, m, b, steps, clip, schedule, v=1, partition="parameters", ckpt=0, clip_norm="global"):
    pm = PipelineModule(make_layers(n_layers), num_stages=pp, loss_fn=lm_loss, partition_method=partition,
                        activation_checkpoint_interval=ckpt, seed_layers=True)
    engine, *_ = initialize(model=pm, config=ds_config(b, m, clip, schedule=schedule, v=v, clip_norm=clip_norm))
    losses = [float(engine.train_batch(data_iter(t, engine.dp_rank, m, b))) for t in range(steps)]
    losses.append(float(engine.eval_batch(data_iter(99, engine.dp_rank, m, b))))
    return {"losses": losses, "params": named_params(engine) if engine.dp_rank == 0 else {},
            "peak_act": engine.peak_activation_bytes, "timeline": engine.timeline, "stage": engine.stage}


def ours_many(rank, world, runs):
    """Several runs in the same processes (one spawn): each run is a kwargs dict for `ours`."""
    return [ours(rank, world, **r) for r in runs]


def deepspeed_side(rank, world, n_layers, pp, m, b, steps, clip, partition="parameters"):
    engine, net = deepspeed_engine(make_layers(n_layers), pp, lm_loss, ds_config(b, m, clip), partition)
    dp_rank = engine.grid.get_data_parallel_id()
    losses = [float(engine.train_batch(data_iter=data_iter(t, dp_rank, m, b))) for t in range(steps)]
    losses.append(float(engine.eval_batch(data_iter=data_iter(99, dp_rank, m, b))))
    return {"losses": losses, "params": named_params(ds_module=net) if dp_rank == 0 else {},
            "stage": engine.stage_id, "parts": list(net.parts)}


def merge(results) -> tuple[list, dict]:
    params = {}
    for r in results:
        params.update(r["params"])
    return results[0]["losses"], params


def max_diff(a: dict, b: dict) -> float:
    missing = set(a) ^ set(b)
    if missing:
        raise AssertionError(f"parameter names differ: {sorted(missing)[:6]}")
    return max(float((a[k] - b[k]).abs().max()) for k in a)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--pp", type=int, default=2)
    ap.add_argument("--dp", type=int, default=1)
    ap.add_argument("--schedule", default="1f1b")
    ap.add_argument("--virtual-stages", type=int, default=1)
    ap.add_argument("--micro-batches", type=int, default=4)
    ap.add_argument("--micro-batch-size", type=int, default=2)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--clip", type=float, default=0.0)
    ap.add_argument("--deepspeed", action="store_true", help="also run DeepSpeed's pipeline engine")
    ap.add_argument("--sweep", action="store_true", help="N = 2, 3, 4 stages × every schedule (+ DeepSpeed): one table")
    a = ap.parse_args(argv)
    if a.sweep:
        return sweep(a)
    world = a.pp * a.dp
    common = (a.layers, a.pp, a.micro_batches, a.micro_batch_size, a.steps, a.clip)
    ref_losses, ref_params = reference(a.layers, a.dp, a.micro_batches, a.micro_batch_size, a.steps, a.clip)
    sides = {"ours": merge(spawn(ours, world, args=common + (a.schedule, a.virtual_stages)))}
    if a.deepspeed:
        sides["deepspeed"] = merge(spawn(deepspeed_side, world, args=common, timeout=600))
    t = Table(title=f"pp={a.pp} dp={a.dp} {a.schedule} v={a.virtual_stages} m={a.micro_batches}: "
                    f"max |difference| vs one process")
    t.add_column("side")
    for s in range(a.steps):
        t.add_column(f"loss step {s}")
    t.add_column("eval loss")
    t.add_column("final parameters")
    t.add_row("one process", *[f"{x:.6f}" for x in ref_losses], "")
    for name, (losses, params) in sides.items():
        t.add_row(name, *[f"{x:.6f} ({abs(x - y):.1e})" for x, y in zip(losses, ref_losses)],
                  f"{max_diff(params, ref_params):.1e}")
    console.print(t)


def sweep(a):
    """Max |Δ| of losses and final parameters vs one process, for N = 2, 3, 4 and every schedule."""
    t = Table(title=f"parity vs one process: {a.steps} steps, clip {a.clip}, fp32, max |difference|")
    for col in ("N stages", "side", "schedule", "m", "loss", "parameters"):
        t.add_column(col)
    for pp in (2, 3, 4):
        runs = []
        for s in ("naive", "gpipe", "1f1b", "interleaved"):
            v = 2 if s == "interleaved" else 1
            m = 2 * pp if s == "interleaved" else pp + 1
            runs.append(dict(n_layers=2 * pp * v - 2 if v > 1 else 4, pp=pp, m=m, b=2, steps=a.steps,
                             clip=a.clip, schedule=s, v=v))
        out = spawn(ours_many, pp, args=(runs,), timeout=900)
        for i, r in enumerate(runs):
            rl, rp = reference(r["n_layers"], 1, r["m"], 2, a.steps, a.clip)
            losses, params = merge([o[i] for o in out])
            t.add_row(str(pp), "ours", f"{r['schedule']} v={r['v']}", str(r["m"]),
                      f"{max(abs(x - y) for x, y in zip(losses, rl)):.1e}", f"{max_diff(params, rp):.1e}")
        if a.deepspeed:
            out = spawn(deepspeed_side, pp, args=(4, pp, pp + 1, 2, a.steps, 0.0), timeout=900)
            rl, rp = reference(4, 1, pp + 1, 2, a.steps, 0.0)
            losses, params = merge(out)
            t.add_row(str(pp), "DeepSpeed", "its TrainSchedule (1F1B), no clip", str(pp + 1),
                      f"{max(abs(x - y) for x, y in zip(losses, rl)):.1e}", f"{max_diff(params, rp):.1e}")
    console.print(t)


if __name__ == "__main__":
    main()
