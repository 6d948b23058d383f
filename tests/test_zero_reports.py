"""memory_report and comm_report: measured from the actual tensors / primitives' ledger, equal
to the formulas exactly (with Ψ replaced by the padded count P; P - Ψ < N per unit)."""
import pytest
import torch
import torch.nn as nn

import zero_from_scratch


def _reports(rank, world, stage, bf16):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(7, 5), nn.LayerNorm(5), nn.Linear(5, 3))   # Ψ = 40+10+18 = 68
    # the textbook ZeRO-3 (every module gathered in forward AND backward): no persistent modules,
    # nothing kept from forward for backward (DeepSpeed's defaults do both; see test_zero_overlap.py)
    z = {"stage": stage, **({"stage3_param_persistence_threshold": 0, "stage3_max_reuse_distance": 0} if stage == 3 else {})}
    cfg = {"train_micro_batch_size_per_gpu": 2, "zero_optimization": z, "bf16": {"enabled": bf16}}
    engine, *_ = zero_from_scratch.initialize(model=model, config=cfg)
    for _ in range(2):
        loss = engine(torch.randn(2, 7, dtype=engine.dtype)).float().pow(2).mean()
        engine.backward(loss)
        engine.step()
    return engine.memory_report(print_table=rank == 0), engine.comm_report(print_table=rank == 0)


@pytest.mark.parametrize("stage,world,bf16", [(0, 2, False), (1, 3, False), (2, 3, True), (3, 3, False), (3, 2, True)])
def test_reports_equal_formulas(spawn, stage, world, bf16):
    psi, b = 68, (2 if bf16 else 4)
    for mem, com in spawn(_reports, world, args=(stage, bf16)):
        assert mem["psi"] == psi
        P = mem["padded_psi"]
        # independent expectation: the paper's table written out here, at the padded count
        sh = P / world
        expect = {"params": b * (sh if stage == 3 else P), "grads": b * (sh if stage >= 2 else P),
                  "master": (4 * (sh if stage >= 1 else P)) if bf16 else 0, "optimizer": 8 * (sh if stage >= 1 else P)}
        assert mem["measured"] == expect
        assert 0 <= P - psi < world * (3 if stage == 3 else 1)     # ≤ N-1 padding per unit
        if stage == 0:
            assert P == psi
        # communication: every data collective's measured bytes equal the ring formula, in total 2 or 3 (N-1)/N·b·P
        k = 3 if stage == 3 else 2
        assert com["data_sent"] == k * (world - 1) * b * P // world
        assert com["paper_at_padded"] == k * (world - 1) * b * P / world
        for r in com["rows"]:
            if r["purpose"] not in ("grad-norm all-reduce", "divergence check"):
                assert r["sent"] == r["ring_formula"], r


def test_working_set_is_the_held_parts_plus_the_larger_phase(tmp_path):
    """report.working_set for ZeRO-Infinity (no processes): no model state left in memory, and the
    peak is what stays held plus the larger of the backward's and the step's parts, not their sum."""
    from zero_from_scratch.engine import report
    from zero_from_scratch.engine.config import load_config
    lay = report.layouts(report.build("mlp"), 2)[3]
    off = {"device": "nvme", "nvme_path": str(tmp_path)}
    cfg = load_config({"train_batch_size": 4, "zero_optimization": {
        "stage": 3, "offload_param": {**off, "max_in_cpu": 0}, "offload_optimizer": off}}, 2)
    ws = report.working_set(cfg, lay, 2, activations=10 ** 6)
    assert ws["parameter shards"] == ws["gradient shards"] == ws["optimizer states"] == 0, ws
    phases = report.BACKWARD_ONLY + report.STEP_ONLY
    held = sum(v for k, v in ws.items() if k not in phases + ("total",))
    bwd, step = (sum(ws[k] for k in ks) for ks in (report.BACKWARD_ONLY, report.STEP_ONLY))
    assert bwd > 0 and step > 0 and ws["total"] == held + max(bwd, step) < held + bwd + step, ws
