"""DeepSpeed's MoE layer under the runner, against the real DeepSpeed 0.19.8 (CPU, gloo).

    python -m pytest -q tests/test_moe.py                 (refusals; ep_size 2 = ep_size 1; 2 ranks: seconds)
    python -m pytest -q -m slow tests/test_moe.py         (+ the script under torchrun twice, 2 and 4 ranks; the gates)

The same script (SCRIPT) runs under `torchrun` with the installed DeepSpeed and under `torchrun -m
zero_from_scratch.as_deepspeed`: two MoE layers of 4 experts (k=1 with Random Token Selection and Gumbel
"RSample" noise, over capacity so tokens drop; k=2 with second-expert sampling, a residual MLP and no
token drop, whose capacity is MAX-reduced over the expert-parallel group) between dense layers, loss =
cross-entropy + 0.01·Σ l_aux, DeepSpeed's default clipping (1.0), ZeRO 0/1/2 in fp32 (and ZeRO-2 in
bf16 on 2 ranks), 3 optimizer steps of gradient accumulation 2, then one eval forward
(eval_capacity_factor). Every rank writes its losses, l_aux, exp_counts and final parameters; the two
runs are compared rank by rank. The gates draw from torch's generator, reseeded per rank after
initialize, so the routing must be identical. Tolerances: in each test's docstring.
"""
import os

import pytest
import torch

from primitives.launch import free_port
from tests.conftest import run_cmd
from zero_from_scratch.as_deepspeed import finder

SCRIPT = r'''
import os, sys
import torch
served = type(sys.modules.get("deepspeed")).__name__ == "ServedModule"
if not served:
    from zero_from_scratch.engine.real_deepspeed import prepare_deepspeed
    prepare_deepspeed()
import deepspeed
import deepspeed.comm as dist
from deepspeed.moe.layer import MoE
from deepspeed.utils import safe_get_full_fp32_param

out, eps, with_bf16 = sys.argv[1], [int(e) for e in sys.argv[2].split(",")], sys.argv[3] == "bf16"
z0_bf16 = with_bf16 or sys.argv[3] == "z0_bf16"         # ZeRO-0 bf16 only (its first step's norm)
deepspeed.init_distributed(dist_backend="gloo")
rank = dist.get_rank()
H, E = 16, 4


class Net(torch.nn.Module):
    def __init__(self, ep):
        super().__init__()
        expert = torch.nn.Sequential(torch.nn.Linear(H, H), torch.nn.ReLU(), torch.nn.Linear(H, H))
        self.linear1 = torch.nn.Linear(H, H)
        self.moe_1 = MoE(H, expert, num_experts=E, ep_size=ep, k=1, use_rts=True, noisy_gate_policy="RSample",
                         capacity_factor=1.0, eval_capacity_factor=2.0, min_capacity=2)
        self.linear2 = torch.nn.Linear(H, H)
        self.moe_2 = MoE(H, expert, num_experts=E, ep_size=ep, k=2, use_residual=True, drop_tokens=False)
        self.linear3 = torch.nn.Linear(H, 5)

    def forward(self, x, y):
        h, l1, c1 = self.moe_1(self.linear1(x))
        h, l2, c2 = self.moe_2(self.linear2(h))
        logits = self.linear3(h).mean(1)
        return torch.nn.functional.cross_entropy(logits, y) + 0.01 * (l1 + l2), (l1, l2), (c1, c2)


def run(ep, stage, bf16, client=False, clip=0.0):
    torch.manual_seed(42)
    model = Net(ep)
    cfg = {"train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 2,
           "zero_optimization": {"stage": stage, "contiguous_gradients": True},
           "optimizer": {"type": "Adam", "params": {"lr": 1e-2, "torch_adam": True}},
           "zero_force_ds_cpu_optimizer": False, "bf16": {"enabled": bf16}, "gradient_clipping": clip}
    if client:    # DeepSpeed's ZeRO-0 reduces each expert parameter over its group, whatever its optimizer group
        opt = dict(optimizer=torch.optim.Adam(model.parameters(), lr=1e-2))
    else:
        opt = dict(model_parameters=model.parameters())
    engine, *_ = deepspeed.initialize(model=model, config=cfg, **opt)
    torch.manual_seed(1000 + rank)                      # the gates' draws: the same stream on both sides
    g = torch.Generator().manual_seed(rank)
    dt = torch.bfloat16 if bf16 else torch.float32
    rec = {"loss": [], "l_aux": [], "counts": [], "norm": [], "groups": [len(engine.optimizer.param_groups)]}
    for i in range(6):
        x, y = torch.randn(4, 8, H, generator=g).to(dt), torch.randint(0, 5, (4,), generator=g)
        loss, aux, counts = engine(x, y)
        engine.backward(loss)
        engine.step()
        if i % 2:                                       # an optimizer step (gradient accumulation 2)
            rec["norm"].append(engine.get_global_grad_norm())
        rec["loss"].append(loss.item())
        rec["l_aux"].append([a.item() for a in aux])
        rec["counts"].append([c.tolist() for c in counts])
    engine.eval()
    with torch.no_grad():
        loss, aux, counts = engine(torch.randn(4, 8, H, generator=g).to(dt), torch.randint(0, 5, (4,), generator=g))
    rec["eval"] = [loss.item(), [a.item() for a in aux], [c.tolist() for c in counts]]
    rec["params"] = {n: p.detach().float().clone() for n, p in engine.module.named_parameters()}
    if stage > 0:                     # an expert's fp32 master, gathered as the safe API gathers it
        rec["safe"] = safe_get_full_fp32_param(engine.module.moe_1.deepspeed_moe.experts.deepspeed_experts[1][2].weight)
    engine.destroy()
    return rec


cases = [(0, False), (1, False), (2, False)] + [(0, True)] * z0_bf16 + [(2, True)] * with_bf16
res = {f"ep{e}_z{s}{'_bf16' if b else ''}": run(e, s, b) for e in eps for s, b in cases}
res.update({f"ep{e}_z{s}{'_bf16' if b else ''}_clip": run(e, s, b, clip=0.05) for e in eps
            for s, b in [(0, False), (2, False)] + [(0, True)] * z0_bf16})
res.update({f"ep{e}_z0_client": run(e, 0, False, client=True) for e in eps})
torch.save(res, os.path.join(out, f"rank{rank}.pt"))
'''


def _run_both(tmp_path, world, eps, bf16):
    """bf16: True (ZeRO-0 and ZeRO-2 bf16 cases too), False, or "z0_bf16" (ZeRO-0 bf16 only)."""
    script = tmp_path / "moe_script.py"
    script.write_text(SCRIPT)
    got = {}
    for side, runner in (("deepspeed", ""), ("ringzero", "-m zero_from_scratch.as_deepspeed ")):
        out = tmp_path / side
        out.mkdir()
        run_cmd(f"torchrun --nproc_per_node {world} --master_port {free_port()} {runner}{script} {out} {eps} "
                f"{'bf16' if bf16 is True else bf16 or 'fp32'}", timeout=900, env={"OMP_NUM_THREADS": "1", "DS_ACCELERATOR": "cpu"})
        got[side] = [torch.load(out / f"rank{r}.pt") for r in range(world)]
    return got


def _compare(got, tol0, ptol0, norm_tol=1e-6, z0_bf16_tol=1e-6):
    worst, norms = {}, {}
    for rank, (ds, rz) in enumerate(zip(got["deepspeed"], got["ringzero"])):
        assert rz.keys() == ds.keys()
        for case, want in ds.items():
            have = rz[case]
            # clipping: DeepSpeed's coefficient from an fp32 norm, ringzero's from a float64 one (clip.py), ulps apart
            tol, param_tol = (max(tol0, 1e-6), max(ptol0, 1e-6)) if "clip" in case else (tol0, ptol0)
            if "z0_bf16" in case:   # DeepSpeed's ZeRO-0 bf16 update (FP16_UnfusedOptimizer) differs from ringzero's
                # (= both sides' ZeRO-2 bf16) from the first step on, MoE or not: the first step's norm only
                assert have["loss"][:2] == want["loss"][:2] and have["counts"][:2] == want["counts"][:2], case
                assert have["norm"][0] == pytest.approx(want["norm"][0], rel=z0_bf16_tol, abs=0), (case, rank)
                norms[case] = max(norms.get(case, 0.0), abs(have["norm"][0] / want["norm"][0] - 1))
                continue
            assert have["groups"] == want["groups"] == [1 if "client" in case else 2], case   # dense + one "moe"
            assert have["counts"] == want["counts"] and have["eval"][2] == want["eval"][2], (case, rank)   # routing
            assert have["loss"] == pytest.approx(want["loss"], rel=0, abs=tol), (case, rank)
            flat = [x for step in have["l_aux"] for x in step]
            assert flat == pytest.approx([x for step in want["l_aux"] for x in step], rel=0, abs=tol), (case, rank)
            assert have["eval"][0] == pytest.approx(want["eval"][0], rel=0, abs=tol), (case, rank)
            assert have["eval"][1] == pytest.approx(want["eval"][1], rel=0, abs=tol), (case, rank)
            # DeepSpeed's ZeRO-0 fp32 engine keeps no norm (None; ringzero's is its clip norm): there the clip
            # cases' weights check it
            pairs = [(float(a), float(b)) for a, b in zip(have["norm"], want["norm"]) if b is not None]
            n_have, n_want = [a for a, _ in pairs], [b for _, b in pairs]
            assert n_have == pytest.approx(n_want, rel=norm_tol, abs=0), (case, rank)
            norms[case] = max([norms.get(case, 0.0)] + [abs(a / b - 1) for a, b in pairs])
            if "safe" in want:
                assert (have["safe"] - want["safe"]).abs().max().item() <= param_tol, (case, rank)
            for n, w in want["params"].items():
                d = (have["params"][n] - w).abs().max().item()
                worst[case] = max(worst.get(case, 0.0), d)
                assert d <= param_tol, (case, rank, n, d)
    print("max |Δparam| per case:", {k: f"{v:.1e}" for k, v in worst.items()})
    print("max relative Δ get_global_grad_norm per case:", {k: f"{v:.1e}" for k, v in norms.items()})


@pytest.mark.slow
@pytest.mark.deepspeed
def test_moe_training_equals_deepspeed_bit_for_bit_on_2_ranks(tmp_path):
    """2 ranks, ep_size 1 (every rank holds the 4 experts) and 2 (2 per rank, the all-to-all), ZeRO 0/1/2 fp32
    and ZeRO-2 bf16: a sum of two gradients does not depend on the order, so the runs are equal bit for bit.
    get_global_grad_norm each step within 1e-6 (fp32 vs float64 sums: ~1e-7, printed). gradient_clipping 0.05
    (clipping fires: norms ~0.36) at ZeRO-0/2 fp32: 1e-6 on weights (the coefficient's last bits). ZeRO-0 bf16
    (its FP16_UnfusedOptimizer: the non-expert norm), with and without clipping: the first step's norm."""
    pytest.importorskip("deepspeed")
    _compare(_run_both(tmp_path, 2, "1,2", bf16=True), 0.0, 0.0)


@pytest.mark.slow
@pytest.mark.deepspeed
def test_moe_training_equals_deepspeed_on_4_ranks(tmp_path):
    """4 ranks, ep_size 2: experts 0-1 on ranks 0 and 2, 2-3 on ranks 1 and 3, expert gradients summed over
    {0, 2} / {1, 3} and divided by 4; and ep_size 1; fp32. The dense gradients are sums of 4 terms, added in
    gloo's order by DeepSpeed and in the ring's by ringzero: a few ulps apart, which Adam turns into ~1e-6 on
    the weights after 3 steps, as much with ep_size 1 as with 2 (the printed line): 5e-6 on the weights,
    1e-6 on losses and l_aux; the routing must be identical. Clipping (0.05): the same bounds; get_global_grad_norm
    within 1e-6 relative; ZeRO-0 bf16 (expert norms summed over the expert-parallel group {0, 1} / {2, 3}, left
    out of FP16_UnfusedOptimizer's clip norm): its first step's norm within 5e-3: a sum of 4 bf16 gradients
    rounds differently on the two sides, ep_size 1 as much as 2 (2.3e-3 and 2.1e-3 measured), so this bound
    only catches gross errors; 2 ranks checks it to 1e-6."""
    pytest.importorskip("deepspeed")
    _compare(_run_both(tmp_path, 4, "1,2", bf16="z0_bf16"), 1e-6, 5e-6, z0_bf16_tol=5e-3)


# ----------------------------------------------------------------------------- one process: the layer itself
def _layer_both(rank, world):
    """DeepSpeed's sharded_moe / MoE and ours on the same inputs and the same generator state."""
    from zero_from_scratch.engine.real_deepspeed import prepare_deepspeed
    prepare_deepspeed()
    import deepspeed.moe.layer as ds_layer
    import deepspeed.moe.sharded_moe as ds_moe
    from zero_from_scratch.as_deepspeed import moe, moe_gating
    out = []

    def same(f_ds, f_rz, seed=5):
        torch.manual_seed(seed)
        a = f_ds()
        torch.manual_seed(seed)
        b = f_rz()
        return a, b
    g = torch.Generator().manual_seed(1)
    logits = torch.randn(24, 6, generator=g)
    for sparse in (False, True):
        for kw in (dict(use_rts=True), dict(use_rts=False, noisy_gate_policy="RSample"), dict(drop_tokens=False)):
            out.append(same(lambda: ds_moe.top1gating(logits.clone(), 1.0, 2, sparse_routes=sparse, **kw),
                            lambda: moe_gating.top1gating(logits.clone(), 1.0, 2, sparse_routes=sparse, **kw)))
        for kw in (dict(), dict(top2_2nd_expert_sampling=False), dict(drop_tokens=False)):
            out.append(same(lambda: ds_moe.top2gating(logits.clone(), 0.5, 2, sparse_routes=sparse, **kw),
                            lambda: moe_gating.top2gating(logits.clone(), 0.5, 2, sparse_routes=sparse, **kw)))
        for kw in (dict(), dict(drop_policy="position"), dict(drop_tokens=False)):
            out.append(same(lambda: ds_moe.topkgating(logits.clone(), 3, 0.5, 2, sparse_routes=sparse, **kw),
                            lambda: moe_gating.topkgating(logits.clone(), 3, 0.5, 2, sparse_routes=sparse, **kw)))
    x = torch.randn(3, 8, 6, generator=g)
    for kw in (dict(k=1, noisy_gate_policy="Jitter"), dict(k=2, use_residual=True), dict(k=3, min_capacity=0)):
        def layer(cls):
            torch.manual_seed(0)
            m = cls(6, torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.GELU(), torch.nn.Linear(5, 6)),
                    num_experts=4, **kw)
            torch.manual_seed(9)
            y, l_aux, counts = m(x)
            (y.square().mean() + l_aux).backward()
            return [y, l_aux, counts] + [p.grad for p in m.parameters()]
        out.append(same(lambda: layer(ds_layer.MoE), lambda: layer(moe.MoE)))
    return out


@pytest.mark.slow
@pytest.mark.deepspeed
def test_gates_and_layer_equal_deepspeeds_bit_for_bit(spawn):
    """top1/top2/top-k gates (dense and sparse routes, RTS, RSample, Jitter, second-expert sampling, no
    token drop) and the whole layer forward and backward (k 1, 2, 3, residual): the same bits."""
    pytest.importorskip("deepspeed")
    for i, (ds, rz) in enumerate(spawn(_layer_both, 1)[0]):
        assert len(ds) == len(rz), i
        for a, b in zip(ds, rz):
            if torch.is_tensor(a):
                assert a.dtype == b.dtype and torch.equal(a, b), i
            else:
                assert a == b, i


# ----------------------------------------------------------------------------- refusals (2 ranks, ringzero only)
def _refusals(rank, world, folder):
    finder.install()
    import deepspeed
    from deepspeed.moe.layer import MoE
    from deepspeed.moe.sharded_moe import top1gating

    def build(ep=1):
        torch.manual_seed(0)
        return torch.nn.Sequential(torch.nn.Linear(4, 4), MoE(4, torch.nn.Linear(4, 4), num_experts=2, ep_size=ep))

    def cfg(stage, clip=0.0, **zero):
        return {"train_micro_batch_size_per_gpu": 2, "gradient_clipping": clip,
                "zero_optimization": {"stage": stage, **zero},
                "optimizer": {"type": "Adam", "params": {"lr": 1e-3, "torch_adam": True}}}

    def err(f):
        try:
            f()
        except Exception as e:      # the refusal's type and message are what the test checks
            return f"{type(e).__name__}: {e}"
        return "no error"

    def init(c, ep=1, client=False):
        m = build(ep)
        opt = dict(optimizer=torch.optim.Adam(m.parameters())) if client else dict(model_parameters=m.parameters())
        return deepspeed.initialize(model=m, config=c, **opt)[0]
    def mixed():                 # an "moe" group, and other experts of the same group_name in the dense group
        m = build(2)
        ex = [p for p in m.parameters() if getattr(p, "allreduce", True) is False]
        rest = [p for p in m.parameters() if all(p is not q for q in ex[:1])]
        groups = [{"params": rest}, {"params": ex[:1], "moe": True, "name": "ep_size_2"}]
        return deepspeed.initialize(model=m, config=cfg(1), optimizer=torch.optim.Adam(groups))
    out = {"z3": err(lambda: init(cfg(3))),
           "z2": err(lambda: init(cfg(2, contiguous_gradients=False))),
           "z1_rs": err(lambda: init({**cfg(1, reduce_scatter=False), "bf16": {"enabled": True}})),
           "z1_bf16_opt": err(lambda: init({**cfg(1, reduce_scatter=False, contiguous_gradients=False),
                                            "bf16": {"enabled": True}, "data_types": {"grad_accum_dtype": "fp32"}})),
           "client": err(lambda: init(cfg(1), client=True)),
           "mixed": err(mixed),
           "tutel": err(lambda: top1gating(torch.randn(8, 2), 1.0, 1, use_tutel=True))}
    m = build()
    e = deepspeed.initialize(model=m, config=cfg(1), model_parameters=m.parameters())[0]
    out["again"] = err(lambda: deepspeed.initialize(model=m, config=cfg(1), model_parameters=m.parameters()))
    out["groups"] = [g["name"] for g in e.optimizer.param_groups]
    m = build(2)                                   # wall_clock_breakdown reaches the layer and its gate
    deepspeed.initialize(model=m, config={**cfg(0), "wall_clock_breakdown": True}, model_parameters=m.parameters())
    m(torch.randn(2, 4, 4))
    layer = m[1].deepspeed_moe
    out["timed"] = [layer.time_moe, layer.time_falltoall, layer.time_salltoall, layer.gate.gate_time]
    out["save"] = err(lambda: e.save_checkpoint(folder))
    out["load"] = err(lambda: e.load_checkpoint(folder))
    return out


def test_refusals_say_what_deepspeed_would_do(spawn, tmp_path):
    """Each refused MoE case fails at initialize / the call with DeepSpeed's own assertion, or with a one-line
    error naming what DeepSpeed would have done; nothing is written by a refused save."""
    for out in spawn(_refusals, 2, args=(str(tmp_path),)):
        assert out["z3"].startswith("AssertionError: Native DeepSpeed MoE is not supported with ZeRO Stage 3")
        assert out["z2"].startswith("AssertionError: Contiguous Gradients in ZeRO Stage 2 must be set to True for MoE")
        assert out["z1_rs"].startswith("AssertionError: Reduce Scatter in ZeRO Stage 2 must be set to True for MoE")
        assert out["z1_bf16_opt"] == "no error"        # DeepSpeed's BF16_Optimizer asserts only the "moe" group
        assert out["client"].startswith("AssertionError: The model has moe layers, but None of the param groups")
        assert "use_tutel=True is refused by ringzero: DeepSpeed would call Tutel" in out["tutel"]
        assert all(t > 0 for t in out["timed"]) and out["timed"][0] > out["timed"][3], out["timed"]   # ms
        assert out["groups"] == ["dense-params", "ep_size_1"]            # configure_moe_param_groups
        assert out["again"] == "AssertionError: Attempting to override an existing ep_group"   # DeepSpeed's too
        for verb in ("save", "load"):
            assert out[verb].startswith(f"NotImplementedError: {verb}_checkpoint of a model with MoE layers is "
                                        "refused by ringzero: DeepSpeed would write/read per-expert files")
        assert "ZeRO-1 with param group 0 mixing ['ep_size_2'] expert parameters with others (ep_size > 1) is " \
               "refused by ringzero: DeepSpeed would partition" in out["mixed"]
    assert not os.listdir(tmp_path)


# ----------------------------------------------------------------------------- ep_size 2 = ep_size 1 (2 ranks, ringzero only)
def _ep_runs(rank, world):
    finder.install()
    import deepspeed
    from deepspeed.moe.layer import MoE
    out = {}
    for ep in (1, 2):
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(8, 8), MoE(8, torch.nn.Linear(8, 8), num_experts=4, ep_size=ep,
                                                                  k=1, min_capacity=2))
        cfg = {"train_micro_batch_size_per_gpu": 2, "zero_optimization": {"stage": 2},
               "optimizer": {"type": "Adam", "params": {"lr": 1e-2, "torch_adam": True}}}
        engine = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=cfg)[0]
        torch.manual_seed(10 + rank)
        g, losses, reports = torch.Generator().manual_seed(rank), [], []
        for _ in range(3):
            h, l_aux, _ = engine(torch.randn(2, 6, 8, generator=g))
            loss = h.square().mean() + l_aux
            engine.backward(loss)
            engine.step()
            losses.append(loss.item())
            reports.append({r["purpose"]: r["calls"] for r in engine.comm_report(print_table=False)["rows"]})
        out[ep] = losses, {n: p.detach().clone() for n, p in model.named_parameters()}, reports
    return out


def test_expert_parallel_equals_every_rank_holding_every_expert(spawn):
    """ep_size 2 on 2 ranks (each rank 2 of the 4 experts, tokens through the all-to-all, expert gradients not
    reduced: each expert's group is its one rank) trains as ep_size 1 (every rank all 4, gradients all-reduced):
    the same losses and, expert for expert, the same weights. The experts start as copies of one module, so
    both runs start equal; an expert's gradient is one matmul over both ranks' tokens in one run, two summed
    in the other: equal to rounding (1e-6). The experts' all-reduce is in each step's comm_report, reset per step."""
    res = spawn(_ep_runs, 2)
    for rank, out in enumerate(res):
        (l1, w1, _), (l2, w2, reports) = out[1], out[2]
        expert_row = "grad all-reduce (expert data parallel) [ep_size_2, 1 ranks]"   # in the step's report, reset
        assert [r.get(expert_row) for r in reports] == [reports[0][expert_row]] * 3 and reports[0][expert_row] > 0
        assert l2 == pytest.approx(l1, rel=1e-6), rank
        for n, w in w2.items():
            if ".deepspeed_experts." in n:          # local expert i of rank r is global expert 2r + i
                head, tail = n.split(".deepspeed_experts.")
                i, rest = tail.split(".", 1)
                n1 = f"{head}.deepspeed_experts.{2 * rank + int(i)}.{rest}"
            else:
                n1 = n
            assert torch.allclose(w, w1[n1], atol=1e-6, rtol=0), (rank, n)
    assert not torch.equal(res[0][2][1]["1.deepspeed_moe.experts.deepspeed_experts.0.weight"],
                           res[1][2][1]["1.deepspeed_moe.experts.deepspeed_experts.0.weight"])   # experts 0 and 2 differ


# ----------------------------------------------------------------------------- GatheredParameters with ep_size 2
def _gathered_edit(rank, world):
    finder.install()
    import deepspeed
    from deepspeed.moe.layer import MoE
    from deepspeed.utils import safe_get_full_fp32_param
    out = {}
    for stage in (0, 1, 2):
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(8, 8), MoE(8, torch.nn.Linear(8, 8), num_experts=4, ep_size=2))
        cfg = {"train_micro_batch_size_per_gpu": 2, "zero_optimization": {"stage": stage},
               "optimizer": {"type": "Adam", "params": {"lr": 1e-2, "torch_adam": True}}}
        engine = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=cfg)[0]
        expert = model[1].deepspeed_moe.experts.deepspeed_experts[0].weight
        with torch.no_grad():
            expert.add_(rank)                      # each rank's local expert 0 is another global expert
        before, dense0 = expert.detach().clone(), model[0].weight.detach().clone()
        for engine_api, ctx in enumerate((deepspeed.zero.GatheredParameters, engine.gathered_parameters)):
            with ctx(list(model.parameters()), modifier_rank=0):
                if rank == 0:
                    with torch.no_grad():
                        model[0].weight.fill_(1.0)
                        expert.fill_(7.0)
            fp32 = safe_get_full_fp32_param(expert) if stage > 0 else expert.detach()
            out[stage, bool(engine_api)] = (before, dense0, expert.detach().clone(), fp32.clone(),
                                            model[0].weight.detach().clone())
        engine.destroy()
    return out


def test_gathered_parameters_leaves_other_ranks_experts(spawn):
    """ep_size 2 on 2 ranks, ZeRO 0/1/2, rank 0 edits inside modifier_rank=0 (deepspeed.zero.GatheredParameters,
    then the engine's gathered_parameters). deepspeed.zero.GatheredParameters is DeepSpeed's no-op below ZeRO-3:
    each rank keeps what it wrote. The engine's broadcasts rank 0's dense edit; with either, rank 1's experts
    (other experts at the same offsets) stay as they were, in the module and (engine's) the fp32 master."""
    res = spawn(_gathered_edit, 2)
    assert len(res[0]) == len(res[1]) == 6
    for rank, out in enumerate(res):
        for (stage, engine_api), (before, dense0, after, fp32, dense) in out.items():
            edited = engine_api or rank == 0
            assert torch.equal(dense, torch.ones_like(dense) if edited else dense0), (rank, stage, engine_api)
            want = torch.full_like(before, 7.0) if rank == 0 else before
            assert torch.equal(after, want), (rank, stage, engine_api)
            if engine_api:
                assert torch.equal(fp32.to(after.dtype), want), (rank, stage, engine_api)
