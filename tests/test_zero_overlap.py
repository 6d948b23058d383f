"""overlap_comm, contiguous_gradients, reduce_scatter and the stage3_* keys: each changes what it
should (when collectives run, how many, how much is gathered at once) and NOTHING else — every
variant's losses and final parameters are bit-identical to the plain run on the same ranks
(the reductions are the same sums of the same buffers; only their timing or count changes).

    python -m pytest -q tests/test_zero_overlap.py

Two spawns of 2 ranks (stages 0-2, then stage 3), ~6 variants each, 3 optimizer steps with
gradient accumulation 2. Parity with real DeepSpeed with overlap_comm on both sides is in
tests/test_zero_ds_parity.py.
"""
import pytest
import torch
import torch.nn as nn
from primitives.launch import spawn as _spawn

import zero_from_scratch
from zero_from_scratch.engine.config import load_config
from zero_from_scratch.engine.zero_keys import ZERO_KEYS
from zero_from_scratch.engine.params import param_device

STEPS, GAS = 3, 2


def mlp():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 32), nn.LayerNorm(32), nn.GELU(), nn.Linear(32, 32), nn.GELU(),
                         nn.Linear(32, 32), nn.GELU(), nn.Linear(32, 4))     # units: 288, 64, 1056, 1056, 132


def _train(rank, zero: dict):
    model = mlp()
    cfg = {"train_micro_batch_size_per_gpu": 3, "gradient_accumulation_steps": GAS, "gradient_clipping": 1.0,
           "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "weight_decay": 0.1}}, "zero_optimization": zero}
    engine, *_ = zero_from_scratch.initialize(model=model, model_parameters=model.parameters(), config=cfg)
    st = engine.stage
    marks = []                                      # comm-clock time each backward ended
    after = st.after_backward

    def spy(boundary):
        marks.append(1e3 * (__import__("time").perf_counter() - engine.comm.t0))
        after(boundary)
    st.after_backward = spy
    g = torch.Generator().manual_seed(rank)
    losses, allocs = [], []
    for _ in range(STEPS * GAS):
        x, y = torch.randn(3, 8, generator=g), torch.randn(3, 4, generator=g)
        loss = (engine(x) - y).pow(2).mean()
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
        allocs.append(getattr(getattr(st, "pool", None), "allocs", None))
    rep = engine.comm_report(print_table=False)
    with torch.no_grad():                          # an eval pass keeps nothing gathered for a backward
        engine(torch.randn(3, 8, generator=g))
    after_eval = sorted(getattr(st, "full_of", {}))
    with engine.gathered_parameters(list(model.parameters())):
        params = {n: p.detach().clone() for n, p in model.named_parameters()}
    return {"losses": losses, "params": params, "rows": {r["purpose"]: r for r in rep["rows"]},
            "overlap": rep["overlap"], "stats": rep.get("stage3"), "allocs": allocs,
            "pool": getattr(getattr(st, "pool", None), "size", None), "backward_end_ms": marks[-1],
            "after_eval": after_eval, "largest_unit": max(u.padded for u in engine.layout.units), "units": len(engine.layout.units)}


def _variants(rank, world, variants):
    return [_train(rank, z) for z in variants]


def _same_bits(a, b, what):
    assert a["losses"] == b["losses"], f"{what}: losses differ"
    for n in a["params"]:
        assert torch.equal(a["params"][n], b["params"][n]), f"{what}: parameter {n} differs"


S12 = [{"stage": s, "reduce_bucket_size": 1100, **extra} for s in (0, 1, 2)
       for extra in ({}, {"overlap_comm": True})] + [
    {"stage": 2, "reduce_bucket_size": 1100, "contiguous_gradients": False},
    {"stage": 2, "reduce_bucket_size": 1100, "overlap_comm": True, "contiguous_gradients": False},
    {"stage": 2, "reduce_bucket_size": 1100, "reduce_scatter": False},
    {"stage": 1, "reduce_bucket_size": 1100, "reduce_scatter": False, "overlap_comm": True}]


@pytest.fixture(scope="module")
def stages012():
    return _spawn(_variants, 2, args=(S12,), timeout=180.0)   # module scope: the shared fixture is per test


def test_overlap_comm_stages_0_1_2_same_bits_launched_during_backward(stages012):
    for rank_res in stages012:
        for i in range(0, 6, 2):
            plain, over = rank_res[i], rank_res[i + 1]
            _same_bits(plain, over, f"stage {S12[i]['stage']} overlap_comm")
            # buckets of ≤ 1100 elements, reduced once per step (stages 0-1) or per micro-batch (2)
            per_step = over["units"] * (GAS if S12[i]["stage"] == 2 else 1)
            assert plain["overlap"] == [] and len(over["overlap"]) == per_step and over["units"] >= 3
            # launched from the gradient hooks, i.e. before backward returned, and waited after
            early = [e for e in over["overlap"] if e["launched_ms"] < over["backward_end_ms"]]
            assert len(early) == len(over["overlap"]), over["overlap"]
            assert all(e["waited_ms"] >= e["launched_ms"] and e["exposed_ms"] >= 0 for e in over["overlap"])
            # same collectives, same bytes: only the timing moved
            for k, r in plain["rows"].items():
                assert (over["rows"][k]["calls"], over["rows"][k]["sent"]) == (r["calls"], r["sent"]), k


def test_contiguous_gradients_reuses_buffers_and_changes_nothing_else(stages012):
    for rank_res in stages012:
        contig, fresh = rank_res[4], rank_res[6]             # stage 2 plain, contiguous_gradients false
        contig_ov, fresh_ov = rank_res[5], rank_res[7]
        _same_bits(contig, fresh, "contiguous_gradients false")
        _same_bits(contig_ov, fresh_ov, "contiguous_gradients false + overlap")
        assert contig["pool"] == 1 and contig_ov["pool"] == 2       # one buffer; two with overlap (double)
        assert contig["allocs"][0] == contig["allocs"][-1] == 1      # allocated once, reused every micro-batch
        assert fresh["allocs"][-1] == fresh["units"] * STEPS * GAS               # a fresh bucket per unit per micro-batch
        for k in contig["rows"]:
            assert contig["rows"][k]["sent"] == fresh["rows"][k]["sent"]


def test_reduce_scatter_false_all_reduces_same_result(stages012):
    for rank_res in stages012:
        rs, ar = rank_res[4], rank_res[8]                    # stage 2; and stage 1 overlapped below
        _same_bits(rs, ar, "reduce_scatter false (N=2: a+b either way)")
        assert "grad all-reduce" in ar["rows"] and "grad reduce-scatter" not in ar["rows"]
        assert ar["rows"]["grad all-reduce"]["sent"] == 2 * rs["rows"]["grad reduce-scatter"]["sent"]
        _same_bits(rank_res[2], rank_res[9], "stage 1 reduce_scatter false + overlap")


S3_BASE = {"stage": 3, "stage3_param_persistence_threshold": 0, "stage3_max_reuse_distance": 0}
S3 = [S3_BASE,                                                                   # 0 textbook ZeRO-3
      {**S3_BASE, "overlap_comm": True},                                         # 1 + prefetch (default 5e7)
      {**S3_BASE, "overlap_comm": True, "stage3_prefetch_bucket_size": 0},       # 2 overlap, no prefetch
      {**S3_BASE, "overlap_comm": True, "stage3_max_live_parameters": 1200},     # 3 live cap
      {**S3_BASE, "overlap_comm": True, "stage3_max_live_parameters": 2500},     # 4 larger cap
      {**S3_BASE, "stage3_param_persistence_threshold": 300},                    # 5 small units stay
      {**S3_BASE, "stage3_max_reuse_distance": 10 ** 9},                         # 6 DeepSpeed's reuse default
      {"stage": 3, "overlap_comm": True}]                                        # 7 all DeepSpeed defaults


@pytest.fixture(scope="module")
def stage3():
    return _spawn(_variants, 2, args=(S3,), timeout=180.0)


def test_stage3_variants_same_bits(stage3):
    for rank_res in stage3:
        for i in range(1, len(S3)):
            _same_bits(rank_res[0], rank_res[i], f"stage 3 {S3[i]}")


def _gathers(r, kind):
    return r["rows"].get(f"param all-gather ({kind})", {"calls": 0})["calls"]


def test_stage3_prefetch_gathers_ahead_and_prefetch_bucket_size_zero_turns_it_off(stage3):
    for rank_res in stage3:
        plain, pre, nopre = rank_res[0], rank_res[1], rank_res[2]
        assert plain["stats"]["prefetch"] == 0 and nopre["stats"]["prefetch"] == 0
        # after the traced first micro-batch every gather but the first is a prefetch that gets used
        assert pre["stats"]["prefetch"] > 0 and pre["stats"]["prefetch_used"] == pre["stats"]["prefetch"]
        assert pre["stats"]["demand"] < plain["stats"]["demand"]
        assert {e["purpose"] for e in pre["overlap"]} >= {"param all-gather (forward)", "param all-gather (backward)"}
        for k in ("forward", "backward"):           # the same gathers, just earlier
            assert _gathers(pre, k) == _gathers(plain, k)
        # prefetching holds more at once; without it, one module (plus a parent) at a time
        assert pre["stats"]["max_live"] > plain["stats"]["max_live"]


def test_stage3_max_live_parameters_is_never_exceeded(stage3):
    for rank_res in stage3:
        cap_small, cap_big, unlimited = rank_res[3], rank_res[4], rank_res[1]
        assert cap_small["largest_unit"] <= 1200     # the cap fits any one module, so it is a hard bound
        assert cap_small["stats"]["max_live"] <= 1200
        assert cap_big["stats"]["max_live"] <= 2500
        assert cap_small["stats"]["max_live"] < cap_big["stats"]["max_live"] <= unlimited["stats"]["max_live"]
        assert cap_small["stats"]["prefetch"] < unlimited["stats"]["prefetch"]   # the cap limited prefetch


def test_stage3_persistence_threshold_keeps_small_modules_gathered(stage3):
    for rank_res in stage3:
        plain, persist = rank_res[0], rank_res[5]
        # units ≤ 300 elements (288-element first Linear, 64-element LayerNorm, 132-element last Linear):
        # gathered once per optimizer step (first forward), never in backward or the second micro-batch
        per_step = lambda r, k: _gathers(r, k)   # noqa: E731  (comm_report covers the last step)
        assert per_step(plain, "forward") == 5 * GAS and per_step(plain, "backward") == 5 * GAS
        assert per_step(persist, "forward") == 2 * GAS + 3 and per_step(persist, "backward") == 2 * GAS


def test_stage3_max_reuse_distance_keeps_forward_gathers_for_backward(stage3):
    for rank_res in stage3:
        plain, reuse = rank_res[0], rank_res[6]
        # with the trace known, every module's forward copy is reused by its backward: no backward gathers
        assert _gathers(reuse, "backward") == 0 and _gathers(reuse, "forward") == _gathers(plain, "forward")
        assert reuse["stats"]["max_live"] > plain["stats"]["max_live"]     # the price: more live at once
        assert reuse["after_eval"] == [] and rank_res[5]["after_eval"] == [0, 1, 4]   # only persistent units


def test_unknown_effect_keys_warn_at_initialise_with_what_deepspeed_would_do():
    z = {"stage": 2, "sub_group_size": 10, "allgather_partitions": False, "round_robin_gradients": True,
         "stage3_max_live_parameters": 5, "allgather_bucket_size": 8, "stage3_gather_16bit_weights_on_model_save": True}
    notes = load_config({"train_batch_size": 2, "zero_optimization": z}, 1).zero.notes
    for k in ("sub_group_size", "allgather_partitions", "round_robin_gradients", "stage3_max_live_parameters",
              "allgather_bucket_size", "stage3_gather_16bit_weights_on_model_save"):
        assert any(n.startswith(f"zero_optimization.{k} ") and "DeepSpeed" in n or "no effect" in n
                   for n in notes if k in n), (k, notes)
    z3 = {"stage": 3, "reduce_bucket_size": 100, "stage3_prefetch_bucket_size": 10}
    notes3 = load_config({"train_batch_size": 2, "zero_optimization": z3}, 1).zero.notes
    assert any("reduce_bucket_size" in n for n in notes3) and any("overlap_comm" in n for n in notes3)
    assert load_config({"train_batch_size": 2, "zero_optimization": {"stage": 2, "overlap_comm": True}}, 1).zero.notes == ()
    assert set(ZERO_KEYS) >= {"overlap_comm", "contiguous_gradients", "stage3_max_live_parameters"}
    with pytest.raises(ValueError, match="stage3_max_live_parameters"):
        load_config({"train_batch_size": 2, "zero_optimization": {"stage": 3, "stage3_max_live_parameters": -1}}, 1)


def test_mixed_devices_are_refused_naming_the_parameters():
    """A model split across devices cannot share one flat buffer: refused before anything moves
    (CPU + meta stands in for CPU + CUDA; the check is the same `p.device` comparison)."""
    m = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2))
    m[1].to("meta")
    with pytest.raises(ValueError, match=r"2 devices.*cpu: \['0.weight', '0.bias'\].*meta: \['1.weight', '1.bias'\]"):
        param_device(m)
    assert param_device(nn.Linear(2, 2)) == torch.device("cpu")


def _on_cuda(rank, world, stage):
    model = mlp().cuda()
    cfg = {"train_micro_batch_size_per_gpu": 3, "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}},
           "zero_optimization": {"stage": stage, "overlap_comm": True}}
    engine, *_ = zero_from_scratch.initialize(model=model, config=cfg)
    x = torch.randn(3, 8, device="cuda")
    for _ in range(2):
        loss = engine(x).pow(2).mean()
        engine.backward(loss)
        engine.step()
    st = engine.stage
    bufs = [*getattr(st, "flat", []), *getattr(st, "gflat", []), *getattr(st, "gshard", []),
            *getattr(st, "pshard", []), *(engine.master or []),
            *(t for s in engine.optimizer.state for t in (s["exp_avg"], s["exp_avg_sq"]))]
    return sorted({b.device.type for b in bufs}), sorted({p.device.type for p in model.parameters()}), loss.item()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("stage", [1, 2, 3])
def test_cuda_model_stays_on_cuda(spawn, stage):
    for bufs, params, loss in spawn(_on_cuda, 1, args=(stage,), backend="nccl"):   # a GPU user's backend
        assert bufs == ["cuda"] and params == ["cuda"] and loss == loss
