"""DeepSpeed's MoE layer under the runner, against the real DeepSpeed 0.19.8 (CPU, gloo).

    python -m pytest -q tests/test_moe.py                 (refusals and the layer in one process: seconds)
    python -m pytest -q -m slow tests/test_moe.py         (+ one script, 2 ranks, under torchrun twice)

The same script (SCRIPT) runs under `torchrun` with the installed DeepSpeed and under `torchrun -m
zero_from_scratch.as_deepspeed`: two MoE layers (k=1 with Random Token Selection and Gumbel "RSample"
noise, over capacity so tokens drop; k=2 with second-expert sampling, a residual MLP and no token
drop) between dense layers, loss = cross-entropy + 0.01·Σ l_aux, ZeRO 0/1/2 in fp32 and ZeRO-2 in
bf16, 3 optimizer steps of gradient accumulation 2, then one eval forward (eval_capacity_factor).
Every rank writes its losses, l_aux, exp_counts and final parameters; the two runs are compared rank
by rank. The gate's random draws come from torch's generator (reseeded per rank after initialize), so
routing and exp_counts must be identical; fp32 values within 1e-6 (the reduction sums 2 ranks and
Adam divides by √v: the two implementations' order of operations differs by a few ulps per step,
and 3 steps of Adam at lr 1e-2 keep that below 1e-6); bf16 within one bf16 ulp of the weights (4e-3
relative) since a bf16 rounding flip of one weight moves it by that much.
"""
import os

import pytest
import torch

from primitives.launch import free_port
from tests.conftest import run_cmd

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

out, ep = sys.argv[1], int(sys.argv[2])
deepspeed.init_distributed(dist_backend="gloo")
rank = dist.get_rank()
H, E = 16, 4


class Net(torch.nn.Module):
    def __init__(self):
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


def run(stage, bf16):
    torch.manual_seed(42)
    model = Net()
    cfg = {"train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 2,
           "zero_optimization": {"stage": stage, "contiguous_gradients": True},
           "optimizer": {"type": "Adam", "params": {"lr": 1e-2, "torch_adam": True}},
           "zero_force_ds_cpu_optimizer": False, "bf16": {"enabled": bf16}}
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=cfg)
    torch.manual_seed(1000 + rank)                      # the gates' draws: the same stream on both sides
    g = torch.Generator().manual_seed(rank)
    dt = torch.bfloat16 if bf16 else torch.float32
    rec = {"loss": [], "l_aux": [], "counts": [], "groups": [len(engine.optimizer.param_groups)]}
    for _ in range(6):
        x, y = torch.randn(4, 8, H, generator=g).to(dt), torch.randint(0, 5, (4,), generator=g)
        loss, aux, counts = engine(x, y)
        engine.backward(loss)
        engine.step()
        rec["loss"].append(loss.item())
        rec["l_aux"].append([a.item() for a in aux])
        rec["counts"].append([c.tolist() for c in counts])
    engine.eval()
    with torch.no_grad():
        loss, aux, counts = engine(torch.randn(4, 8, H, generator=g).to(dt), torch.randint(0, 5, (4,), generator=g))
    rec["eval"] = [loss.item(), [a.item() for a in aux], [c.tolist() for c in counts]]
    rec["params"] = {n: p.detach().float().clone() for n, p in engine.module.named_parameters()}
    engine.destroy()
    return rec


res = {f"z{s}{'_bf16' if b else ''}": run(s, b) for s, b in ((0, False), (1, False), (2, False), (2, True))}
torch.save(res, os.path.join(out, f"rank{rank}.pt"))
'''


def _run_both(tmp_path, world, ep):
    script = tmp_path / "moe_script.py"
    script.write_text(SCRIPT)
    got = {}
    for side, runner in (("deepspeed", ""), ("ringzero", "-m zero_from_scratch.as_deepspeed ")):
        out = tmp_path / side
        out.mkdir()
        run_cmd(f"torchrun --nproc_per_node {world} --master_port {free_port()} {runner}{script} {out} {ep}",
                timeout=600, env={"OMP_NUM_THREADS": "1", "DS_ACCELERATOR": "cpu"})
        got[side] = [torch.load(out / f"rank{r}.pt") for r in range(world)]
    return got


@pytest.mark.slow
@pytest.mark.deepspeed
def test_moe_training_equals_deepspeed_2_ranks_ep1(tmp_path):
    pytest.importorskip("deepspeed")
    got = _run_both(tmp_path, 2, 1)
    worst = {}
    for rank, (ds, rz) in enumerate(zip(got["deepspeed"], got["ringzero"])):
        for case, want in ds.items():
            have, tol = rz[case], (4e-3 if "bf16" in case else 1e-6)
            assert have["groups"] == want["groups"], case             # dense-params + ep_size_1 groups
            assert have["counts"] == want["counts"], (case, rank)     # identical routing
            assert have["eval"][2] == want["eval"][2], (case, rank)
            assert have["loss"] == pytest.approx(want["loss"], rel=tol, abs=tol), (case, rank)
            assert have["l_aux"] == pytest.approx(want["l_aux"], rel=tol, abs=tol), (case, rank)
            for n, w in want["params"].items():
                d = (have["params"][n] - w).abs().max().item()
                worst[case] = max(worst.get(case, 0.0), d)
                assert d <= tol * max(1.0, w.abs().max().item()), (case, rank, n, d)
    print("max |Δparam| per case:", {k: f"{v:.1e}" for k, v in worst.items()})
