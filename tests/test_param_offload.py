"""offload_param at ZeRO-3 (zero_from_scratch/engine/param_offload.py).

    python -m pytest -q tests/test_param_offload.py

* cpu, nvme (max_in_cpu 0: every shard in files) and nvme + offload_optimizer nvme (ZeRO-Infinity)
  against ZeRO-3 without offload, same data, N = 2, fp32 and bf16, 2 micro-batches per step, with
  and without prefetch (overlap_comm), after a gathered_parameters(modifier_rank=0) edit:
  bit-identical losses, gradient norms and final parameters (offload moves bytes, not maths);
  the stage holds no parameter shard (and, with offload_optimizer nvme, no gradient shard); bytes moved per step = the formula (2·GA + 1)·b·S read,
  b·S written (S = this rank's shard elements) with no reuse and no persistence.
* max_in_cpu splits the shards between host memory and the files, unit by unit.
* peak RSS (slow): ZeRO-3 fp32, an MLP of Ψ = 16.8 M: nvme parameter offload lowers the training
  peak by ≥ 0.5 × 4Ψ/N (4Ψ/N = the shards; minus ≤ buffer_count unit shards resident at a time);
  with offload_optimizer nvme too (parameters, gradients, m and v in files) by ≥ 0.6 × 16Ψ/N.
* ZeRO-Infinity (slow, ~5 min loaded): Ψ = 67 M, N = 2, built under zero.Init, parameters, gradients and
  optimizer states in files: the peak per rank over the whole run (build, initialize, 2 steps)
  ≤ 0.25 × 4Ψ above the RSS before the model existed; losses equal ZeRO-3 without offload.
* checkpoint (slow): a ZeRO-Infinity run saved mid-way resumes bit-identically in a fresh engine.
* a CUDA model (where a GPU is): cpu (pinned) and nvme parameter offload train as without.
* refusals: stage < 3, a buffer_size below a unit's shard (on every rank), unknown keys, a missing nvme_path.
"""
import os

import pytest
import torch

import zero_from_scratch
from zero_from_scratch.engine import param_offload
from zero_from_scratch.engine.config import load_config
from zero_from_scratch.engine.models import tiny_distilbert

MIB = 2 ** 20


def _cfg(bf16, poff=None, ooff=None, path="", overlap=False, **extra):
    z = {"stage": 3, "overlap_comm": overlap, "stage3_max_reuse_distance": 0, "stage3_param_persistence_threshold": 0}
    if poff:
        z["offload_param"] = {"device": poff, "nvme_path": os.path.join(path, "p"), "max_in_cpu": 0, **extra}
    if ooff:
        z["offload_optimizer"] = {"device": ooff, "nvme_path": os.path.join(path, "o")}
        z["sub_group_size"] = 300                        # the step streams chunk after chunk
    return {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 2, "steps_per_print": 10 ** 9,
            "gradient_clipping": 0.5, "bf16": {"enabled": bf16}, "zero_optimization": z,
            "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "weight_decay": 0.1}}}


def _train(rank, cfg, steps=2):
    torch.manual_seed(0)
    model = tiny_distilbert()
    engine, *_ = zero_from_scratch.initialize(model=model, config=cfg)
    w = model.distilbert.embeddings.word_embeddings.weight
    with engine.gathered_parameters([w], modifier_rank=0):
        if rank == 0:
            w.data.mul_(0.5)                         # an edit every rank's shard must receive
    g, rec, moved = torch.Generator().manual_seed(rank), [], []
    poff = engine.stage.poff
    for _ in range(steps):
        before = (poff.bytes_read, poff.bytes_written) if poff else (0, 0)
        for _ in range(2):
            loss = engine(input_ids=torch.randint(1, 101, (2, 10), generator=g),
                          labels=torch.randint(0, 2, (2,), generator=g)).loss
            engine.backward(loss)
            engine.step()
            rec.append(loss.item())
        rec.append(engine.get_global_grad_norm())
        if poff:
            moved.append((poff.bytes_read - before[0], poff.bytes_written - before[1]))
    store_held = poff.pool.held if poff else 0          # between steps: the all-gathers read into their own buffers
    with engine.gathered_parameters(model.parameters()):
        params = {n: p.detach().float().clone() for n, p in model.named_parameters()}
    b = torch.empty(0, dtype=engine.dtype).element_size()
    info = {"moved": moved, "bS": b * sum(u.shard for u in engine.layout.units),
            "held": sum(t.numel() for t in engine.stage.pshard[:len(engine.layout.group_local)]),
            "grads_held": sum(t.numel() for t in engine.stage.gshard), "store_held": store_held,
            "most_in_use": max([s.pool.peak for s in (poff, engine.stage.goff) if s] + [0]),
            "peaks": [(s.name, s.pool.peak) for s in (poff, engine.stage.goff) if s],
            "largest": b * max(u.shard for u in engine.layout.units),
            "report": engine.memory_report(print_table=False)["offload_param"]}
    return rec, params, info


FAST = [(True, "nvme", "nvme", True)]
SLOW = [(False, "nvme", None, True), (False, "cpu", None, False), (True, "cpu", None, True), (False, "nvme", "nvme", False),
        (True, "nvme", "cpu", False)]


def _compare(rank, world, path, cases):
    out = {}
    for bf16 in sorted({c[0] for c in cases}):
        out[bf16, None, None, False] = _train(rank, _cfg(bf16))
    for i, (bf16, poff, ooff, overlap) in enumerate(cases):
        out[bf16, poff, ooff, overlap] = _train(rank, _cfg(bf16, poff, ooff, os.path.join(path, str(i)), overlap))
    return out


@pytest.mark.parametrize("cases", [pytest.param(FAST, id="infinity-bf16-prefetch"),
                                   pytest.param(SLOW, id="rest", marks=pytest.mark.slow)])
def test_param_offload_is_exact_and_moves_the_formula(spawn, tmp_path, cases):
    res = spawn(_compare, 2, args=(str(tmp_path), cases), timeout=300.0)
    for r, runs in enumerate(res):
        for bf16, poff, ooff, overlap in cases:
            plain, off = runs[bf16, None, None, False], runs[bf16, poff, ooff, overlap]
            what = f"rank {r} {'bf16' if bf16 else 'fp32'} offload_param {poff} offload_optimizer {ooff} overlap {overlap}"
            assert off[0] == plain[0], f"{what}: losses/norms {off[0]} vs {plain[0]}"
            assert all(torch.equal(off[1][n], plain[1][n]) for n in plain[1]), f"{what}: parameters"
            info, ga = off[2], 2
            assert info["held"] == 0, f"{what}: the stage still holds {info['held']} shard elements"
            assert info["store_held"] == 0, f"{what}: the store holds {info['store_held']} bytes between steps"
            assert (info["grads_held"] == 0) == (ooff == "nvme"), f"{what}: gradient shards {info['grads_held']}"
            # the norm and the step stream unit by unit: one offloaded shard in memory at a time (bf16
            # without nvme optimizer states: refresh_master's reads keep up to buffer_count)
            assert info["most_in_use"] <= info["largest"] or (bf16 and ooff != "nvme"), f"{what}: {info['peaks']}"
            for read, written in info["moved"][1:]:   # per optimizer step (the first also writes the edit back)
                assert (read, written) == ((2 * ga + 1) * info["bS"], info["bS"]), f"{what}: moved {read, written}"
            rep = info["report"]
            assert rep["device"] == poff and rep["bytes_in_files"] == (info["bS"] if poff == "nvme" else 0), rep
    if cases is FAST:                                   # every shard of rank 1 in its files; gradients too
        d = tmp_path / "0" / "p" / "zero_rank001"
        assert sum(os.path.getsize(d / f) for f in os.listdir(d)) == res[1][FAST[0]][2]["bS"], os.listdir(d)
        assert any(f.startswith("grads.group") for f in os.listdir(tmp_path / "0" / "o" / "zero_rank001"))


def _split(rank, world, path, max_in_cpu):
    torch.manual_seed(0)
    cfg = _cfg(False, "nvme", None, path)
    cfg["zero_optimization"]["offload_param"]["max_in_cpu"] = max_in_cpu
    engine, *_ = zero_from_scratch.initialize(model=tiny_distilbert(), config=cfg)
    rep = engine.memory_report(print_table=False)["offload_param"]
    try:                                                   # a buffer smaller than a unit's shard: refused
        zero_from_scratch.initialize(model=tiny_distilbert(), config=_cfg(False, "nvme", None, path + "b", buffer_size=100))
        small = None
    except ValueError as e:
        small = str(e)
    return rep, [u.shard for u in engine.layout.units], small


def test_max_in_cpu_keeps_whole_units_in_host_memory_and_buffer_size_is_checked(spawn, tmp_path):
    res = spawn(_split, 2, args=(str(tmp_path), 3000))
    rep, shards, _ = res[0]
    host, budget = 0, 3000
    for n in shards:                                   # unit order, while the budget lasts
        if n > budget:
            break
        host, budget = host + n, budget - n
    assert rep["bytes_in_host"] == 4 * host and rep["bytes_in_files"] == 4 * (sum(shards) - host) > 0, rep
    for r, (_, _, small) in enumerate(res):
        assert small and f"rank {r}: zero_optimization.offload_param.buffer_size = 100" in small, small


def test_offload_param_config_is_checked():
    ok = load_config({"train_batch_size": 2, "zero_optimization": {"stage": 3, "offload_param": {"device": "cpu"}}}, 1)
    assert ok.offload_param == {**param_offload.DEFAULTS, "device": "cpu"}
    assert load_config({"train_batch_size": 2, "zero_optimization": {"stage": 2, "offload_param": {"device": "none"}}},
                       1).offload_param is None
    for z, msg in (({"stage": 2, "offload_param": {"device": "cpu"}}, "needs stage 3"),
                   ({"stage": 3, "offload_param": {"device": "nvme"}}, "nvme_path' is required"),
                   ({"stage": 3, "offload_param": {"device": "cpu", "swap": 1}}, "offload_param.swap"),
                   ({"stage": 3, "offload_param": {"device": "cpu", "buffer_count": 0}}, "buffer_count' = 0")):
        with pytest.raises(ValueError, match=msg):
            load_config({"train_batch_size": 2, "zero_optimization": z}, 1)


def _vm(key: str) -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith(key))


def _peak(rank, world, poff, path, ooff=None):
    """Training peak RSS (VmHWM after initialize, above the RSS with the model built) of 2 steps."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(1024, 1024) for _ in range(16)])
    base = _vm("VmRSS:")
    engine, *_ = zero_from_scratch.initialize(model=model, config={
        "train_micro_batch_size_per_gpu": 4, "steps_per_print": 10 ** 9, "optimizer": {"type": "AdamW"},
        "zero_optimization": {"stage": 3, **({"offload_param": {"device": poff, "nvme_path": path, "max_in_cpu": 0}}
                                             if poff else {}),
                              **({"offload_optimizer": {"device": ooff, "nvme_path": path}} if ooff else {})}})
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")                                       # VmHWM := VmRSS: the training peak from here
    g, losses = torch.Generator().manual_seed(rank), []
    for _ in range(2):
        loss = engine(torch.randn(4, 1024, generator=g)).pow(2).mean()
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    return _vm("VmHWM:") - base, losses, engine.layout.numel


@pytest.mark.slow
def test_nvme_param_offload_lowers_the_training_peak(spawn, tmp_path):
    plain = spawn(_peak, 2, args=(None, ""))
    nvme = spawn(_peak, 2, args=("nvme", str(tmp_path)))
    infinity = spawn(_peak, 2, args=("nvme", str(tmp_path), "nvme"))
    for r in range(2):
        (p0, l0, psi), (p1, l1, _), (p2, l2, _) = plain[r], nvme[r], infinity[r]
        assert l1 == l0 and l2 == l0, f"rank {r}: losses {l1}, {l2} vs {l0}"
        assert p0 - p1 >= 0.5 * 4 * psi / 2, f"rank {r}: peak {p0 / MIB:.1f} → {p1 / MIB:.1f} MiB; 4Ψ/N = {2 * psi / MIB:.1f} MiB"
        # parameters, gradients, m and v all in files: 16Ψ/N, less the staging and resident buffers
        assert p0 - p2 >= 0.6 * 16 * psi / 2, f"rank {r}: peak {p0 / MIB:.1f} → {p2 / MIB:.1f} MiB; 16Ψ/N = {8 * psi / MIB:.1f} MiB"


@pytest.mark.slow
@pytest.mark.timeout(2400)                                 # ~10 min on 2 loaded cores: 67 M parameters, twice
def test_zero_infinity_whole_run_within_a_quarter_of_the_fp32_weights(spawn, tmp_path):
    """256 × Linear(512, 512): Ψ = 67 M, 4Ψ = 256 MiB of fp32 weights, N = 2. Built under zero.Init
    with offload_param + offload_optimizer nvme (DeepSpeed's defaults but the live-parameter bound),
    adopted by initialize and trained: each rank's peak over the whole run ≤ 0.25 × 4Ψ above its RSS
    before the model existed (the model states, 16Ψ/N = 2 × 4Ψ, are in files), and every loss equals
    ZeRO-3 without offload on the plainly built model."""
    from benchmarks.zero_init_memory import infinity   # the benchmark's measurement: only this test needs it
    for r, out in enumerate(spawn(infinity, 2, args=(str(tmp_path),), timeout=1800.0)):
        peak, psi = out["train"], out["psi"]                # cumulative: build, initialize and training
        assert peak <= 0.25 * 4 * psi, f"rank {r}: peak {peak / MIB:.1f} MiB > 0.25 × 4Ψ = {psi / MIB:.1f} MiB"
        assert out["in_files"] >= 4 * psi // 2, f"rank {r}: {out['in_files']} bytes of parameter shards in files"
        assert out["losses"] == out["ref_losses"], f"rank {r}: {out['losses']} vs ZeRO-3 without offload"


def _resume(rank, world, path):
    cfg = _cfg(True, "nvme", "nvme", path)
    torch.manual_seed(0)
    a, *_ = zero_from_scratch.initialize(model=tiny_distilbert(), config=cfg)
    g = torch.Generator().manual_seed(rank)
    batches = [{"input_ids": torch.randint(1, 101, (2, 10), generator=g), "labels": torch.randint(0, 2, (2,), generator=g)}
               for _ in range(4)]
    for x in batches[:2]:
        a.backward(a(**x).loss)
        a.step()
    a.save_checkpoint(os.path.join(path, "ckpt"), tag="t")
    after = []
    for x in batches[2:]:
        loss = a(**x).loss
        a.backward(loss)
        a.step()
        after.append(loss.item())
    torch.manual_seed(1)                                   # different initial weights: the load must replace them
    b, *_ = zero_from_scratch.initialize(model=tiny_distilbert(), config=_cfg(True, "nvme", "nvme", path + "b"))
    b.load_checkpoint(os.path.join(path, "ckpt"), tag="t")
    resumed = []
    for x in batches[2:]:
        loss = b(**x).loss
        b.backward(loss)
        b.step()
        resumed.append(loss.item())
    return after, resumed


@pytest.mark.slow
def test_checkpoint_of_an_offloaded_run_resumes_bit_identically(spawn, tmp_path):
    for r, (after, resumed) in enumerate(spawn(_resume, 2, args=(str(tmp_path),))):
        assert resumed == after, f"rank {r}: resumed {resumed} vs uninterrupted {after}"


def _cuda(rank, world, path):
    out = {}
    for poff in (None, "cpu", "nvme"):
        torch.manual_seed(0)
        model = tiny_distilbert().cuda()
        engine, *_ = zero_from_scratch.initialize(model=model, config=_cfg(False, poff, None, os.path.join(path, str(poff))))
        g, losses = torch.Generator().manual_seed(rank), []
        for _ in range(4):
            loss = engine(input_ids=torch.randint(1, 101, (2, 10), generator=g).cuda(),
                          labels=torch.randint(0, 2, (2,), generator=g).cuda()).loss
            engine.backward(loss)
            engine.step()
            losses.append(loss.item())
        store = engine.stage.poff
        out[poff] = losses, store and (all(t.is_pinned() for t in store.host.values()), store.bytes_read > 0)
    return out


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_param_offload_of_a_cuda_model(spawn, tmp_path):
    res = spawn(_cuda, 1, args=(str(tmp_path),), backend="nccl")[0]   # a GPU user's backend
    assert res["cpu"][1] == (True, True) and res["nvme"][1][1], res   # pinned host shards; bytes moved
    for poff in ("cpu", "nvme"):     # the same kernels on the same values: equal up to GPU reduction order
        assert res[poff][0] == pytest.approx(res[None][0], rel=1e-6, abs=1e-7), (poff, res[poff][0], res[None][0])
