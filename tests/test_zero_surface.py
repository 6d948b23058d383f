"""The engine surface real DeepSpeed clients call: client optimizer objects and schedulers, the
config's Lion/SGD/Adagrad and WarmupCosineLR/OneCycle, initialize(training_data=, args=), the
engine's DeepSpeed attributes.

References: one-process torch optimizers on the same data (the sharded update must equal the
unsharded one: 1e-6 absolute over 3 steps of a small MLP, the rounding of a different summation
order of the gradient), DeepSpeed's own lr_schedules and DeepSpeedDataLoader classes (exact),
and Lion's update written from the paper (1e-7)."""
import copy
import types

import numpy as np
import pytest
import torch
import torch.nn as nn

from zero_from_scratch.engine.dataloader import DeepSpeedDataLoader, RepeatingLoader
from zero_from_scratch.engine import lr_schedules as ours
from zero_from_scratch.engine.optimizers import DeepSpeedCPUAdam, FusedLion, lion_step_

BATCH = 4   # per rank


def _model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 3))


def _data(step, rank):
    g = torch.Generator().manual_seed(100 * step + rank)
    return torch.randn(BATCH, 6, generator=g), torch.randn(BATCH, 3, generator=g)


CLIENTS = {   # name -> (torch class, kwargs, config extras)
    "AdamW": (torch.optim.AdamW, dict(lr=1e-2, weight_decay=0.1), {}),
    "Adam": (torch.optim.Adam, dict(lr=1e-2, weight_decay=0.1, betas=(0.8, 0.99)), {}),
    "SGD": (torch.optim.SGD, dict(lr=5e-2, momentum=0.9, nesterov=True, weight_decay=0.01),
            {"zero_allow_untested_optimizer": True}),
    "Adagrad": (torch.optim.Adagrad, dict(lr=5e-2, lr_decay=0.1, weight_decay=0.01, initial_accumulator_value=0.1), {}),
    # DeepSpeed's classes (the runner serves them as deepspeed.ops.*): their one-process step() is the reference
    "FusedLion": (FusedLion, dict(lr=1e-2, betas=(0.9, 0.99), weight_decay=0.1), {}),
    "DeepSpeedCPUAdam": (DeepSpeedCPUAdam, dict(lr=1e-2, weight_decay=0.1, bias_correction=False, adamw_mode=False), {}),
}


def _full(engine):
    with engine.gathered_parameters(list(engine.module.parameters())):
        return {n: p.detach().clone() for n, p in engine.module.named_parameters()}


def _reference(make_opt, steps, world, sched=None):
    """One process, the whole batch (both ranks' data): what ZeRO must reproduce."""
    m = _model()
    opt = make_opt(m.parameters())
    s = sched(opt) if sched else None
    for t in range(steps):
        xs, ys = zip(*[_data(t, r) for r in range(world)])
        nn.functional.mse_loss(m(torch.cat(xs)), torch.cat(ys)).backward()
        opt.step()
        opt.zero_grad()
        if s:
            s.step()
    return {n: p.detach().clone() for n, p in m.named_parameters()}


def _train(engine, steps, rank):
    for t in range(steps):
        x, y = _data(t, rank)
        engine.backward(nn.functional.mse_loss(engine(x), y))
        engine.step()
    return _full(engine)


def _maxdiff(a, b):
    return max(float((a[k] - b[k]).abs().max()) for k in a)


def _clients(rank, world):
    import zero_from_scratch
    out = {}
    lam = lambda opt: torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1 + s))   # noqa: E731
    for stage in (0, 1, 2, 3):
        for name, (cls, kw, extra) in CLIENTS.items():
            m = _model()
            opt = cls(m.parameters(), **kw)
            cfg = {"train_batch_size": BATCH * world, "gradient_clipping": 0.0, "zero_optimization": {"stage": stage},
                   **extra}
            sched = lam if name == "AdamW" else None          # accelerate's form: a callable of the optimizer
            e, eo, _, es = zero_from_scratch.initialize(model=m, optimizer=opt, lr_scheduler=sched, config=cfg)
            assert eo.param_groups is opt.param_groups        # the client's groups drive the shards
            assert (eo is opt) == (stage == 0)                # stage 0 in fp32: DeepSpeed hands back the client's
            got = _train(e, 3, rank)
            ref = _reference(lambda p: cls(p, **kw), 3, world, sched)
            out[stage, name] = _maxdiff(got, ref)
            if name == "AdamW":
                out[stage, "lr"] = opt.param_groups[0]["lr"]
    # stage 0: the script steps the object it got back itself; its state is the engine's
    m = _model()
    e, opt, _, _ = zero_from_scratch.initialize(model=m, optimizer=torch.optim.AdamW(m.parameters(), lr=1e-2),
                                                config={"train_batch_size": BATCH * world})
    for t in range(3):
        x, y = _data(t, rank)
        e.backward(nn.functional.mse_loss(e(x), y))
        opt.step()
        opt.zero_grad()
    out[0, "own step"] = _maxdiff(_full(e), _reference(lambda p: torch.optim.AdamW(p, lr=1e-2), 3, world))
    w = m[0].weight
    out[0, "state"] = (float(opt.state[w]["step"]), opt.state[w]["exp_avg"].shape == w.shape)
    return out


def _config_optimizers(rank, world):
    import zero_from_scratch
    out = _clients(rank, world)
    cases = {"Lion": ({"lr": 1e-2, "betas": [0.9, 0.99], "weight_decay": 0.1},
                      lambda p: FusedLion(p, lr=1e-2, betas=(0.9, 0.99), weight_decay=0.1)),
             "SGD": ({"lr": 5e-2, "momentum": 0.9, "dampening": 0.1},
                     lambda p: torch.optim.SGD(p, lr=5e-2, momentum=0.9, dampening=0.1)),
             "Adagrad": ({"lr": 5e-2, "eps": 1e-8}, lambda p: torch.optim.Adagrad(p, lr=5e-2, eps=1e-8))}
    for stage in (2, 3):
        for name, (params, ref_opt) in cases.items():
            cfg = {"train_batch_size": BATCH * world, "gradient_clipping": 0.0, "zero_optimization": {"stage": stage},
                   "optimizer": {"type": name, "params": params}, "zero_allow_untested_optimizer": True}
            m = _model()
            e, *_ = zero_from_scratch.initialize(model=m, config=cfg)
            out[stage, name] = _maxdiff(_train(e, 3, rank), _reference(ref_opt, 3, world))
    # refusals, each naming the thing refused
    msgs = []
    for bad in (lambda m: torch.optim.RMSprop(m.parameters()),
                lambda m: torch.optim.SGD(m.parameters(), lr=0.1)):        # SGD at stage 1 without the flag
        m = _model()
        try:
            zero_from_scratch.initialize(model=m, optimizer=bad(m), config={"train_batch_size": BATCH * world,
                                                                             "zero_optimization": {"stage": 1}})
        except (NotImplementedError, ValueError) as err:
            msgs.append(str(err))
    return out, msgs, _safe(rank, world)


def test_client_and_config_optimizers_and_safe_api_equal_one_process_torch(spawn):
    (res, msgs, safe), _ = spawn(_config_optimizers, 2)     # one spawn for the four stages
    for stage in (0, 1, 2, 3):
        assert res[stage, "lr"] == pytest.approx(1e-2 / 4)   # LambdaLR stepped once per optimizer step (3)
    assert res.pop((0, "state")) == (3.0, True)
    for k, d in res.items():
        assert k[1] == "lr" or d < 1e-6, (k, d)
    assert "torch.optim.rmsprop.RMSprop" in msgs[0] and "zero_allow_untested_optimizer" in msgs[1]
    for stage in (0, 1, 2, 3):       # safe_get_*/safe_set_* (_safe below) against the same one-process torch
        assert safe[stage] < 1e-6, (stage, safe[stage])
        assert safe[stage, "frozen"] is None           # not the engine's: None, as DeepSpeed's


def test_lion_step_is_the_papers_update_with_fused_lions_zero_rule():
    g0 = torch.Generator().manual_seed(0)
    p, m = torch.randn(1000, generator=g0), torch.randn(1000, generator=g0) * 0.1
    g = torch.randn(1000, generator=g0)
    g[:10], m[:10] = 0.0, 0.0                         # c == 0: FusedLion's kernel adds +lr (c > 0 ? -lr : lr)
    lr, b1, b2, wd = 1e-2, 0.9, 0.99, 0.1
    pn, mn, gn = p.double().numpy(), m.double().numpy(), g.double().numpy()
    c = b1 * mn + (1 - b1) * gn
    want_p = pn * (1 - lr * wd) - lr * np.where(c > 0, 1.0, -1.0)
    want_m = b2 * mn + (1 - b2) * gn
    lion_step_(p, g, m, lr, b1, b2, wd)
    np.testing.assert_allclose(p.numpy(), want_p, rtol=2e-7, atol=1e-7)   # one float32 rounding
    np.testing.assert_allclose(m.numpy(), want_m, rtol=0, atol=1e-7)
    assert torch.all(p[:10] > torch.from_numpy(pn[:10]).float() * (1 - lr * wd))   # moved by +lr


# ----------------------------------------------------------------------------- schedules vs DeepSpeed
def _ds_schedules():
    pytest.importorskip("deepspeed")
    from parity.zero.sides import prepare_deepspeed
    prepare_deepspeed()
    from deepspeed.runtime import lr_schedules as ds
    return ds


SCHEDULES = [
    ("WarmupCosineLR", dict(total_num_steps=40, warmup_num_steps=10, warmup_min_ratio=0.1, cos_min_ratio=0.01)),
    ("WarmupCosineLR", dict(total_num_steps=30, warmup_num_steps=5, warmup_type="linear")),
    ("OneCycle", dict(cycle_min_lr=1e-3, cycle_max_lr=1e-2, cycle_first_step_size=8, cycle_second_step_size=6,
                      decay_step_size=3, decay_lr_rate=0.5, decay_mom_rate=0.1)),
    ("OneCycle", dict(cycle_min_lr=[1e-3, 2e-3], cycle_max_lr=1e-2, cycle_first_step_size=7, cycle_first_stair_count=3)),
    ("LRRangeTest", dict(lr_range_test_min_lr=1e-4, lr_range_test_step_size=5, lr_range_test_staircase=True)),
    ("WarmupDecayLR", dict(total_num_steps=30, warmup_num_steps=8, warmup_max_lr=1e-2)),
]


@pytest.mark.parametrize("name, kw", SCHEDULES)
def test_schedules_equal_deepspeeds_lr_and_momentum_sequence(name, kw):
    ds = _ds_schedules()
    assert ours.VALID_LR_SCHEDULES == ds.VALID_LR_SCHEDULES

    def run(mod):
        w = [nn.Parameter(torch.zeros(2)), nn.Parameter(torch.zeros(3))]
        opt = torch.optim.AdamW([{"params": w[:1]}, {"params": w[1:], "lr": 5e-3}], lr=1e-2)
        s = getattr(mod, name)(opt, **kw)
        seq = [[(g["lr"], tuple(g["betas"])) for g in opt.param_groups]]
        for _ in range(45):
            s.step()
            seq.append([(g["lr"], tuple(g["betas"])) for g in opt.param_groups])
        return seq, s.state_dict()
    assert run(ours) == run(ds)


# ----------------------------------------------------------------------------- the loader
class _Squares(torch.utils.data.Dataset):
    def __len__(self):
        return 11

    def __getitem__(self, i):
        return torch.tensor([i, i * i])


@pytest.mark.parametrize("drop_last", [False, True])
def test_loader_equals_deepspeeds(drop_last):
    _ds_schedules()
    from deepspeed.runtime.dataloader import DeepSpeedDataLoader as DS
    for rank in (0, 1):
        kw = dict(dataset=_Squares(), batch_size=3, pin_memory=False, local_rank=rank, tput_timer=None,
                  num_local_io_workers=0, data_parallel_world_size=2, data_parallel_rank=rank,
                  dataloader_drop_last=drop_last)
        a, b = DeepSpeedDataLoader(**kw), DS(**kw)
        assert len(a) == len(b)
        for _epoch in range(2):      # neither calls set_epoch: the same order every epoch
            assert [x.tolist() for x in a] == [x.tolist() for x in b]
    rep = RepeatingLoader([1, 2, 3])
    assert [next(rep) for _ in range(7)] == [1, 2, 3, 1, 2, 3, 1]


# ----------------------------------------------------------------------------- the engine's attributes
def _surface(rank, world, cfg_path, save_dir):
    import zero_from_scratch
    m = _model()
    args = types.SimpleNamespace(deepspeed_config=cfg_path, local_rank=rank)
    e, opt, loader, _ = zero_from_scratch.initialize(args=args, model=m, model_parameters=m.parameters(),
                                                     training_data=_Squares())
    out = {"ranks": (e.global_rank, e.local_rank, e.world_size, str(e.device)), "len": len(loader),
           "first": next(iter(loader)).tolist(), "forwarded": e.append.__self__ is m}   # nn.Sequential's, via the engine
    # the client sets the boundary: micro-batch 1 of gas 2 steps at once
    e.set_gradient_accumulation_boundary(is_boundary=True)
    x, y = _data(0, rank)
    before = _full(e)
    applied = [e.was_step_applied()]                 # DeepSpeed's: False before any step
    e.backward(nn.functional.mse_loss(e(x), y))
    e.step()
    out["stepped"] = e.global_steps == 1 and _maxdiff(before, _full(e)) > 0
    applied.append(e.was_step_applied())
    opt.param_groups[0]["lr"] = 0.0          # a client's write takes effect at the next step: weights stay
    before = _full(e)
    # scale_wrt_gas=False: the loss is not divided by gradient_accumulation_steps (grad norm doubles)
    norms = []
    for scale in (True, False):
        e.backward(nn.functional.mse_loss(e(x), y), scale_wrt_gas=scale)
        e.step()
        norms.append(e.get_global_grad_norm())
    out["norm_ratio"] = norms[1] / norms[0]
    out["frozen"] = _maxdiff(before, _full(e)) == 0
    out["overflow"], out["cur_scale"] = opt.overflow, opt.cur_scale
    e.set_gradient_accumulation_boundary(is_boundary=False)     # a micro-step inside the window: no update
    e.backward(nn.functional.mse_loss(e(x), y))
    e.step()
    out["applied"] = applied + [e.was_step_applied()]
    e.destroy()
    # fp16: the optimizer's overflow / cur_scale / loss_scale as accelerate and DeepSpeedExamples read them
    m = nn.Linear(4, 2)
    cfg = {"train_micro_batch_size_per_gpu": 2, "zero_optimization": {"stage": 2},
           "fp16": {"enabled": True, "initial_scale_power": 8, "hysteresis": 1}}
    e, opt, _, _ = zero_from_scratch.initialize(model=m, model_parameters=m.parameters(), config=cfg)
    scale0 = opt.cur_scale
    x = torch.ones(2, 4, dtype=torch.float16) * (1e4 if rank == 1 else 1.0)   # rank 1's gradients overflow
    e.backward(e(x).float().pow(2).sum())
    e.step()
    out["fp16"] = (scale0, opt.overflow, opt.loss_scale, e.was_step_applied())
    out["save16"] = _save16(rank, world, save_dir)
    return out


def test_engine_surface_attributes(spawn, tmp_path):
    import json
    cfg = tmp_path / "ds.json"
    cfg.write_text(json.dumps({"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 2,
                               "zero_optimization": {"stage": 2}, "gradient_clipping": 0.0,
                               "optimizer": {"type": "SGD", "params": {"lr": 0.1}},
                               "zero_allow_untested_optimizer": True}))
    res = spawn(_surface, 2, args=(str(cfg), str(tmp_path)))
    sampler = [list(torch.utils.data.DistributedSampler(_Squares(), 2, r)) for r in (0, 1)]
    for r, out in enumerate(res):
        assert out["ranks"] == (r, r, 2, "cpu")
        assert out["len"] == 3 and out["first"] == [[i, i * i] for i in sampler[r][:2]]
        assert out["forwarded"] and out["stepped"] and out["frozen"]
        assert out["norm_ratio"] == pytest.approx(2.0, rel=1e-6)
        assert out["overflow"] is False and out["cur_scale"] == 1.0
        assert out["applied"] == [False, True, False]
        assert out["fp16"] == (2.0 ** 8, True, 2.0 ** 7, False)     # skipped on every rank, scale halved
    # save_16bit_model: stage 2 saves; stage 3 without stage3_gather_16bit_weights_on_model_save saves nothing
    # (False), with it saves rank 0's gathered weights (_save16)
    assert res[0]["save16"] == [True, False, True]
    # deepspeed.utils.zero_to_fp32's functions on that ZeRO-3 bf16 checkpoint: DeepSpeed's files (fp32 masters,
    # buffers, the frozen bias gathered from both ranks' fragments) give what our own manifest gives
    from zero_from_scratch.engine import zero_to_fp32 as F
    from zero_from_scratch.engine.checkpoint_read import consolidate
    ck = str(tmp_path / "ckpt")
    ref = consolidate(ck)
    got = F.get_fp32_state_dict_from_zero_checkpoint(ck)
    assert sorted(got) == sorted(ref) and all(torch.equal(got[k], ref[k].float()) for k in ref)
    assert "2.bias" not in F.get_fp32_state_dict_from_zero_checkpoint(ck, exclude_frozen_parameters=True)
    m = F.load_state_dict_from_zero_checkpoint(_model(), ck)
    assert all(torch.equal(p, ref[n]) for n, p in m.state_dict().items())
    F.convert_zero_checkpoint_to_fp32_state_dict(ck, str(tmp_path / "out"))
    assert torch.load(tmp_path / "out" / "pytorch_model.bin").keys() == got.keys()


@pytest.mark.slow
def test_initialize_starts_torch_distributed_when_nobody_did(tmp_path):
    """deepspeed.initialize → init_distributed: a plain `python script.py` becomes a world of one."""
    import subprocess
    import sys
    script = tmp_path / "s.py"
    script.write_text("import os, torch, torch.distributed as dist, zero_from_scratch\n"
                      "for k in ('RANK', 'WORLD_SIZE', 'LOCAL_RANK'): os.environ.pop(k, None)\n"
                      "m = torch.nn.Linear(2, 2)\n"
                      "e, *_ = zero_from_scratch.initialize(model=m, config={'train_batch_size': 2})\n"
                      "print(dist.is_initialized(), dist.get_world_size(), e.world_size, e.local_rank)\n")
    r = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]
    assert r.stdout.split()[-4:] == ["True", "1", "1", "0"]


# ----------------------------------------------------------------------------- safe_get_* / safe_set_*
def _safe(rank, world):
    import zero_from_scratch
    from zero_from_scratch.engine import safe_api as S
    out = {}
    for stage in (0, 1, 2, 3):
        m, ref = _model(), _model()
        opt = torch.optim.AdamW(m.parameters(), lr=1e-2, weight_decay=0.0)
        ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2, weight_decay=0.0)
        cfg = {"train_batch_size": BATCH * world, "gradient_clipping": 0.0, "zero_optimization": {"stage": stage}}
        e, *_ = zero_from_scratch.initialize(model=m, optimizer=opt, config=cfg)
        pairs = list(zip(m.parameters(), ref.parameters()))
        diffs = []
        for t in range(2):
            x, y = _data(t, rank)
            e.backward(nn.functional.mse_loss(e(x), y))
            xs, ys = zip(*[_data(t, r) for r in range(world)])
            nn.functional.mse_loss(ref(torch.cat(xs)), torch.cat(ys)).backward()
            diffs += [float((S.safe_get_full_grad(p) - q.grad).abs().max()) for p, q in pairs]
            if t == 1:      # set a weight and a state between backward and step: the step starts from them
                w, wr = pairs[0]
                new = torch.linspace(-1, 1, wr.numel()).view(wr.shape)
                S.safe_set_full_fp32_param(w, new)
                S.safe_set_full_optimizer_state(w, torch.full_like(new, 0.01), "exp_avg")
                with torch.no_grad():
                    wr.copy_(new)
                ref_opt.state[wr]["exp_avg"].fill_(0.01)
                diffs.append(float((S.safe_get_full_fp32_param(w) - new).abs().max()))
            e.step()
            ref_opt.step()
            ref_opt.zero_grad()
            diffs += [float((S.safe_get_full_fp32_param(p) - q).abs().max()) for p, q in pairs]
            for k in ("exp_avg", "exp_avg_sq"):
                diffs += [float((S.safe_get_full_optimizer_state(p, k) - ref_opt.state[q][k]).abs().max())
                          for p, q in pairs]
        out[stage] = max(diffs)
        out[stage, "frozen"] = S.safe_get_full_fp32_param(nn.Parameter(torch.zeros(2)))
    return out


def _save16(rank, world, d):
    import zero_from_scratch
    out = []
    for stage, flag in ((2, False), (3, False), (3, True)):
        m = _model()
        m[2].bias.requires_grad_(False)
        cfg = {"train_micro_batch_size_per_gpu": 2, "bf16": {"enabled": True},
               "zero_optimization": {"stage": stage, "stage3_gather_16bit_weights_on_model_save": flag}}
        e, *_ = zero_from_scratch.initialize(model=m, model_parameters=[p for p in m.parameters() if p.requires_grad],
                                             config=cfg)
        saved = e.save_16bit_model(d, f"s{stage}{flag}.bin")
        if flag:
            e.save_checkpoint(f"{d}/ckpt")      # ours + DeepSpeed's files (zero_to_fp32 below reads them)
        want = {k: v.to(torch.bfloat16) for k, v in _model().state_dict().items()}   # rank 0's initial weights
        if saved and rank == 0:
            got = torch.load(f"{d}/s{stage}{flag}.bin")
            out.append(sorted(got) == sorted(want) and all(torch.equal(got[k], want[k]) for k in want))
        else:
            out.append(saved)
    return out



def test_initialize_takes_deepspeeds_arguments_each_with_a_status():
    import inspect
    _ds_schedules()
    import deepspeed
    import zero_from_scratch
    from zero_from_scratch.engine.zero_keys import INITIALIZE_ARGS
    theirs = list(inspect.signature(deepspeed.initialize).parameters)
    ours = list(inspect.signature(zero_from_scratch.initialize).parameters)
    assert ours[:len(theirs)] == theirs             # the same names in the same order: positional calls agree
    assert sorted(INITIALIZE_ARGS) == sorted(theirs)


def test_throughput_timer_state_equals_deepspeeds(monkeypatch):
    """engine.tput_timer's counters and flags step for step as DeepSpeed's ThroughputTimer (its clock replaced)."""
    from types import SimpleNamespace
    from deepspeed.utils import timer as ds_timer
    from zero_from_scratch.engine import surface
    clock = iter(range(2, 2000))
    now = lambda: float(next(clock) // 2)     # each reading twice: DeepSpeed's timer, then ours, read the same
    monkeypatch.setattr(ds_timer.time, "time", now)
    ours = surface.ThroughputTimer(42)
    theirs = ds_timer.ThroughputTimer(SimpleNamespace(enabled=True, synchronized=False), 42, logging_fn=lambda *_: None)
    fields = ("initialized", "started", "start_time", "end_time", "micro_step_count", "global_step_count",
              "total_elapsed_time", "step_elapsed_time", "batch_size", "start_step")
    for i in range(14):
        for t in (theirs, ours):     # the same clock reading order: DeepSpeed's first, then ours
            t.stop(global_step=(i % 3 == 2)) if i % 2 else t.start()
        assert {f: getattr(ours, f) for f in fields} == {f: getattr(theirs, f) for f in fields}, i
