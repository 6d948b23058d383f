"""offload_optimizer {"device": "cpu"} (zero_from_scratch/engine/offload.py, HostOptimizerStates).

    python -m pytest -q tests/test_recipes_offload_cpu.py

* cpu offload vs no offload, same data, N = 2, stages 1-3: bit-identical losses, gradient norms and
  final parameters (offload moves bytes, not maths); the Adam states and master live in the
  offload's host buffers; bytes moved per step = b·(local shard elements) each way. A checkpoint
  saved mid-run and loaded into a fresh offloaded engine continues bit-identically (the fp32 host
  master follows the loaded parameters). The model is on the CPU here, so the copies are host →
  host: the same code path as for a GPU model.
* against real DeepSpeed's cpu offload (DeepSpeed with "torch_adam", so no JIT build), stages 1-3,
  with the DeepSpeed-parity tolerances (parity.zero.compare.Tolerance): `slow` (about 1 min).
* a CUDA model at world size 1 (skipped without CUDA): states pinned on the host, parameters on
  the GPU, the run equal to the GPU run without offload within 1e-5 (the Adam step runs on the
  CPU there, whose rounding may differ from the GPU's in the last bit).
"""
import pytest
import torch

import zero_from_scratch
from zero_from_scratch.engine.models import TinyMLP


def _cfg(stage, bf16, off, sub=50):
    z = {"stage": stage, "sub_group_size": sub}
    if off:
        z["offload_optimizer"] = {"device": off}
    return {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 2, "steps_per_print": 10 ** 9,
            "gradient_clipping": 0.5, "bf16": {"enabled": bf16}, "zero_optimization": z,
            "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "weight_decay": 0.1}}}


def _batch(rank, step, micro, device="cpu"):
    g = torch.Generator().manual_seed(1000 * rank + 10 * step + micro)
    return {"x": torch.randn(2, 13, generator=g).to(device), "labels": torch.randint(0, 3, (2,), generator=g).to(device)}


def _engine(cfg, device="cpu"):
    torch.manual_seed(0)
    model = TinyMLP().to(device)     # odd sizes: uneven shards; sub_group_size 50 < a shard: chunks
    return model, zero_from_scratch.initialize(model=model, config=cfg)[0]


def _run(rank, engine, model, steps, first=0, save=None, device="cpu"):
    rec = []
    for step in range(first, steps):
        for micro in range(2):
            loss = engine(**_batch(rank, step, micro, device)).loss
            engine.backward(loss)
            engine.step()
            rec.append(loss.item())
        rec.append(engine.get_global_grad_norm())
        if save and step == 0:
            engine.save_checkpoint(save, tag="s1")
    with engine.gathered_parameters(model.parameters()):
        params = {n: p.detach().float().cpu().clone() for n, p in model.named_parameters()}
    return rec, params


def _compare(rank, world, ckpt, cases):
    out = {}
    for stage, bf16 in cases:
        model0, engine0 = _engine(_cfg(stage, bf16, None))
        plain = _run(rank, engine0, model0, 3)
        model, engine = _engine(_cfg(stage, bf16, "cpu"))
        off = _run(rank, engine, model, 3, save=f"{ckpt}/s{stage}{bf16}")
        rep = engine.memory_report(print_table=False)["offload"]
        local = sum(engine.layout.group_local)
        states = [t for s in engine.optimizer.state for t in (s["exp_avg"], s["exp_avg_sq"])]
        where = {"states_in_host_buffers": all(t.device.type == "cpu" for t in states + engine.offload.master),
                 "numel_ok": sum(t.numel() for t in engine.offload.master) == local,
                 "bytes": (rep["bytes_down_per_step"], rep["bytes_up_per_step"], local * engine.dtype.itemsize)}
        model2, engine2 = _engine(_cfg(stage, bf16, "cpu"))   # resumes after step 0, in a fresh engine
        engine2.load_checkpoint(f"{ckpt}/s{stage}{bf16}", tag="s1")
        resumed = _run(rank, engine2, model2, 3, first=1)
        out[stage, bf16] = plain, off, where, resumed
    return out


@pytest.mark.parametrize("cases", [pytest.param([(2, True), (3, False)], id="zero2-bf16+zero3-fp32"),
                                   pytest.param([(1, False), (1, True), (2, False), (3, True)], id="rest",
                                                marks=pytest.mark.slow)])
def test_cpu_offload_is_bit_identical_to_no_offload(spawn, tmp_path, cases):
    res = spawn(_compare, 2, args=(str(tmp_path), cases), timeout=600.0)
    for r, runs in enumerate(res):
        for (stage, bf16), (plain, off, where, resumed) in runs.items():
            what = f"rank {r} ZeRO-{stage} {'bf16' if bf16 else 'fp32'}"
            assert off[0] == plain[0], f"{what}: losses/norms {off[0]} vs {plain[0]}"
            assert all(torch.equal(off[1][n], plain[1][n]) for n in plain[1]), f"{what}: parameters"
            assert where["states_in_host_buffers"] and where["numel_ok"], what
            down, up, want = where["bytes"]
            assert down == up == want > 0, f"{what}: bytes moved per step {down}/{up}, expected {want}"
            assert resumed[0] == off[0][3:], f"{what}: resumed run {resumed[0]} vs {off[0][3:]}"
            assert all(torch.equal(resumed[1][n], off[1][n]) for n in off[1]), f"{what}: resumed parameters"


@pytest.mark.slow
@pytest.mark.deepspeed
def test_cpu_offload_matches_deepspeed_cpu_offload():
    pytest.importorskip("deepspeed")
    from parity.zero.ds_parity import make_config, run_parities
    from parity.zero.harness import Job
    pairs = []
    for stage in (1, 2, 3):
        c = make_config(stage)
        c["zero_optimization"]["offload_optimizer"] = {"device": "cpu"}
        pairs.append((Job("deepspeed", "mlp", c, 4), Job("ours", "mlp", c, 4)))
    res = run_parities(pairs, 2)
    bad = [f"ZeRO-{s}: " + "; ".join(r.failures) for s, r in zip((1, 2, 3), res) if not r.ok]
    assert not bad, "\n".join(bad)


def _cuda(rank, world):
    out = {}
    for off in (None, "cpu"):
        model, engine = _engine(_cfg(2, False, off), "cuda")
        rec, params = _run(rank, engine, model, 3, device="cuda")
        out[off] = rec, params
        if off:
            st = engine.optimizer.state[0]
            out["where"] = (next(model.parameters()).device.type, st["exp_avg"].device.type,
                            st["exp_avg"].is_pinned(), engine.offload.master[0].is_pinned(),
                            engine.memory_report(print_table=False)["offload"])
    return out


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_cpu_offload_of_a_cuda_model(spawn):
    res = spawn(_cuda, 1, backend="nccl")[0]   # a GPU user's backend
    dev, state_dev, pinned_state, pinned_master, rep = res["where"]
    assert (dev, state_dev, pinned_state, pinned_master) == ("cuda", "cpu", True, True)
    assert rep["bytes_down_per_step"] > 0 and rep["bytes_down_per_step"] == rep["bytes_up_per_step"]
    assert res["cpu"][0] == pytest.approx(res[None][0], rel=1e-5, abs=1e-6)
    for n, p in res[None][1].items():
        torch.testing.assert_close(res["cpu"][1][n], p, rtol=1e-5, atol=1e-5, msg=n)


def _nvme_cuda(rank, world, path):
    zero_from_scratch.initialize(model=TinyMLP().cuda(), config={**_cfg(2, False, None), "zero_optimization": {
        "stage": 2, "offload_optimizer": {"device": "nvme", "nvme_path": path}}})


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_nvme_offload_of_a_cuda_model_is_refused(spawn, tmp_path):
    (status, value), = spawn(_nvme_cuda, 1, args=(str(tmp_path),), allow_fail=True)
    assert status == "error" and "rank 0: zero_optimization.offload_optimizer {'device': 'nvme'}" in value, value
