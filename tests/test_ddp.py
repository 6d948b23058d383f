"""Data-parallel chapters (ddp_examples/) against independent references.

References: the single-process run on the whole global batch (computed here, in the test
process, with no communication at all) and torch's DistributedDataParallel (chapter 5).
Byte counts come from the primitives ledger and are compared with 2(N−1)/N·Ψ·4.

Tolerance TOL = 1e-5 on parameters after 12 SGD steps (lr 0.05, momentum 0.9), float32:
a data-parallel gradient differs from the single-process one only in summation order (per-rank
means averaged, instead of one mean), i.e. by a few float32 ulps relative (ε = 6e-8) times the
number of summands (≤ 48), ≲ 3e-6 relative on gradients of order 1. Momentum sums at most
1/(1−0.9) = 10 such errors per update and 12 steps add them up: ≤ 12·10·0.05·3e-6 ≈ 2e-5 in the
worst case without any cancellation; measured differences are ~1e-8. Every bug this guards
against (a missing average, a rank training alone, a stale bucket) moves parameters by
lr·|g| ≈ 1e-2 or more, three orders of magnitude above TOL.
"""
import importlib

import pytest
import torch
import torch.nn as nn

from primitives.launch import spawn as _spawn
from ddp_examples.bucketed import plan_buckets
from ddp_examples.engine.common import Config, build_model, make_batch, max_diff, reference, train
from ddp_examples.engine.wrappers import BucketedDataParallel, FlatDataParallel, NaiveDataParallel
from primitives.engine.cost import ring_fraction, traffic

TOL = 1e-5
SMALL_CAP = 0.004                            # MiB: splits the default model (Ψ = 3846) into 4 uneven buckets
CH_CFG = Config(steps=12, bucket_cap_mb=SMALL_CAP)                     # every tensor's size divides by 6
ACC_CFG = Config(steps=10, global_batch=48, accum=3, bucket_cap_mb=SMALL_CAP)   # 8 samples per micro-batch
EDGE_CFG = Config(steps=10)
UNEVEN_CFG = Config(steps=10, in_dim=7, hidden=13, classes=5, global_batch=30)  # odd sizes everywhere


def formula_bytes(numel: int, world_size: int, elem: int = 4) -> float:
    """2(N−1)/N·Ψ·e: what a ring all-reduce of Ψ elements sends per rank."""
    return float(ring_fraction("all_reduce", world_size) * numel * elem)


def ring_bytes(buffer_numels: list[int], world_size: int, rank: int, elem: int = 4) -> int:
    """Exact bytes `rank` sends when each buffer is ring-all-reduced (tensor_split chunk sizes)."""
    return sum(traffic("all_reduce", "ring", world_size, rank, n, elem)[1] for n in buffer_numels)

def _all(rank, world):
    """Everything one world size needs, in ONE set of rank processes (starting ranks is the
    slow part on a 2-core machine): each test below reads its share."""
    out = {"chapters": _chapters(rank, world, CH_CFG)}
    if world == 2:
        out["accum"] = _accumulate(rank, world, ACC_CFG)
        out["edge"] = _edge_cases(rank, world, EDGE_CFG)
    else:
        out["uneven"] = _uneven(rank, world, UNEVEN_CFG)
    return out


@pytest.fixture(scope="module")
def ranks():
    """ranks(world) -> per-rank results of _all, spawned once per world size and module.
    Same harness as the `spawn` fixture (primitives.launch.spawn, same deadline), module-scoped."""
    cache = {}

    def get(world):
        if world not in cache:
            cache[world] = _spawn(_all, world, timeout=180.0)
        return cache[world]
    return get


def chapter(n: int):
    name = {1: "01_single_process", 2: "02_naive", 3: "03_flat", 4: "04_bucketed", 5: "05_torch_ddp"}[n]
    return importlib.import_module(f"ddp_examples.{name}")


def flat(params):
    return torch.cat([torch.as_tensor(p).reshape(-1) for p in params])


# ----------------------------------------------------------------------------- no processes

def test_plan_buckets_reverse_order_and_oversized_parameter():
    # bytes of params 0..4; cap 100: param 3 (250 B) is bigger than the cap and sits alone
    assert plan_buckets([40, 40, 30, 250, 60], 100) == [[4], [3], [2, 1], [0]]
    assert plan_buckets([10, 10, 10], 1000) == [[2, 1, 0]]
    # a dtype change closes the bucket even when there is room
    assert plan_buckets([4, 4, 4], 1000, keys=["f32", "f16", "f16"]) == [[2, 1], [0]]
    with pytest.raises(ValueError, match="bucket cap"):
        plan_buckets([4], 0)


def test_world_size_not_dividing_global_batch_names_both_numbers():
    with pytest.raises(ValueError, match=r"global batch 50 is not divisible by world size 3"):
        Config(global_batch=50).check_world(3)
    with pytest.raises(ValueError, match=r"global batch 36 is not divisible by world size 4 × accumulation steps 4"):
        Config(global_batch=36, accum=4).check_world(4)
    with pytest.raises(ValueError, match="Config.steps"):
        Config(steps=0)


# ----------------------------------------------------------------------------- chapters 2-5

def _chapters(rank, world, cfg):
    out = {}
    for n in (2, 3, 4, 5):
        model = chapter(n).wrap(build_model(cfg), cfg)
        res = train(model, cfg, rank, world)
        out[n] = dict(params=res.params, bytes=res.bytes_sent, calls=res.calls,
                      buckets=model.bucket_numels() if n == 4 else None)
    # bad input on a real world of 3 (or 2): raised before any communication, on every rank
    try:
        train(build_model(cfg), Config(global_batch=cfg.global_batch + 1), rank, world)
        out["bad"] = None
    except ValueError as e:
        out["bad"] = str(e)
    return out


@pytest.mark.parametrize("world", [2, 3])
def test_chapters_equal_single_process_and_bytes_match_formula(ranks, world):
    cfg = CH_CFG
    ref = reference(cfg)
    psi = sum(p.numel() for p in ref.params)
    results = [r["chapters"] for r in ranks(world)]
    for n in (2, 3, 4, 5):
        for r, res in enumerate(results):
            d = max_diff(res[n]["params"], ref.params)
            assert d <= TOL, f"chapter {n}, rank {r}: max |param - reference| = {d:.2e} > {TOL}"
            # all ranks bitwise identical: every rank ends an all-reduce with the same bytes
            assert torch.equal(flat(res[n]["params"]), flat(results[0][n]["params"])), f"chapter {n}: rank {r} differs"
    expected = formula_bytes(psi, world)             # 2(N−1)/N·Ψ·4
    assert expected == int(expected)
    for n in (2, 3, 4):
        for r, res in enumerate(results):
            assert res[n]["bytes"] == [int(expected)] * cfg.steps, f"chapter {n}, rank {r}: {res[n]['bytes'][:3]}"
    buckets = results[0][4]["buckets"]
    assert len(buckets) == 4 and sum(buckets) == psi and len(set(buckets)) == 4
    assert results[0][2]["calls"] == [6] * cfg.steps          # one all-reduce per parameter tensor
    assert results[0][3]["calls"] == [1] * cfg.steps          # one flat buffer
    assert results[0][4]["calls"] == [4] * cfg.steps          # one per bucket
    for r, res in enumerate(results):
        assert f"global batch {cfg.global_batch + 1} is not divisible by world size {world}" in res["bad"]
        assert res["bad"].startswith(f"rank {r}:")


# ----------------------------------------------------------------------------- accumulation

def _accumulate(rank, world, cfg):
    out = {}
    for n in (3, 4, 5):
        model = chapter(n).wrap(build_model(cfg), cfg)
        res = train(model, cfg, rank, world)
        out[n] = dict(params=res.params, bytes=res.bytes_sent, calls=res.calls)
    return out


def test_accumulation_equals_big_batch_and_communicates_once_per_step(ranks):
    world, cfg = 2, ACC_CFG
    big = reference(Config(steps=10, global_batch=48, accum=1))                 # one step on the k× batch
    results = [r["accum"] for r in ranks(world)]
    psi = sum(p.numel() for p in big.params)
    for n in (3, 4, 5):
        for r, res in enumerate(results):
            d = max_diff(res[n]["params"], big.params)
            assert d <= TOL, f"chapter {n}, rank {r}: accumulation differs from the big batch by {d:.2e}"
    for r, res in enumerate(results):
        # k micro-batches, but the bytes of ONE all-reduce of Ψ per optimizer step
        assert res[4]["bytes"] == [int(formula_bytes(psi, world))] * cfg.steps
        assert res[4]["calls"] == [4] * cfg.steps and res[3]["calls"] == [1] * cfg.steps


# ----------------------------------------------------------------------------- edge cases

class _Unused(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.body = build_model(cfg)
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(1)
            self.spare = nn.Linear(cfg.hidden, 3)        # never called in forward

    def forward(self, x):
        return self.body(x)


def _seed_broken_sync(model, world):
    """Averaging behind a type check that is never true for an nn.Parameter (naive.py's docstring)."""
    for param in model.parameters():
        if type(param) is torch.Tensor:
            torch.distributed.all_reduce(param.grad.data)
            param.grad.data /= world


class _SeedDP(nn.Module):
    def __init__(self, module, world):
        super().__init__()
        self.module, self.world = module, world

    def forward(self, x):
        return self.module(x)

    def sync_gradients(self):
        _seed_broken_sync(self.module, self.world)


def _edge_cases(rank, world, cfg):
    out = {}
    # 1. a parameter larger than the bucket: every tensor of ≥ 1 KiB gets its own bucket
    m = BucketedDataParallel(build_model(cfg), bucket_cap_mb=0.001)
    out["tiny_cap"] = (train(m, cfg, rank, world).params, m.bucket_names())
    # 2. frozen first layer: skipped by the buckets, never gets a gradient
    frozen = build_model(cfg)
    frozen[0].requires_grad_(False)
    m = BucketedDataParallel(frozen, bucket_cap_mb=SMALL_CAP)
    res = train(m, cfg, rank, world)
    out["frozen"] = (res.params, res.bytes_sent, frozen[0].weight.grad is None, m.bucket_names())
    # 3. an unused parameter: a clear error by default ...
    try:
        train(BucketedDataParallel(_Unused(cfg)), cfg, rank, world)
        out["unused_error"] = None
    except RuntimeError as e:
        out["unused_error"] = str(e)
    # ... or zero gradients with find_unused_parameters=True
    m = BucketedDataParallel(_Unused(cfg), bucket_cap_mb=SMALL_CAP, find_unused_parameters=True)
    out["unused_ok"] = train(m, cfg, rank, world).params
    # 4. parameters that differ across ranks at start: broadcast from rank 0, or an error
    out["differ_check"] = {}
    for cls in (NaiveDataParallel, FlatDataParallel, BucketedDataParallel):
        skewed = build_model(Config(seed=100 + rank))
        cls(skewed)                                      # default init_sync="broadcast"
        out.setdefault("differ_bcast", []).append(flat(skewed.parameters()).detach())
        try:
            cls(build_model(Config(seed=100 + rank)), init_sync="check")
            out["differ_check"][cls.__name__] = None
        except ValueError as e:
            out["differ_check"][cls.__name__] = str(e)
    # 5. comm_impl="torch" (gloo's all_reduce in the same buckets) and a loop that sets .grad to None
    out["torch_impl"] = train(BucketedDataParallel(build_model(cfg), SMALL_CAP, comm_impl="torch"), cfg, rank, world).params
    m = BucketedDataParallel(build_model(cfg), SMALL_CAP)
    opt = torch.optim.SGD(m.parameters(), lr=cfg.lr, momentum=cfg.momentum)
    per = cfg.global_batch // world
    for s in range(cfg.steps):
        x, y = make_batch(cfg, s)
        opt.zero_grad(set_to_none=True)                  # the hooks copy into the bucket and re-point .grad
        torch.nn.functional.cross_entropy(m(x[rank * per:(rank + 1) * per]), y[rank * per:(rank + 1) * per]).backward()
        opt.step()
    out["set_to_none"] = [p.detach().clone() for p in m.module.parameters()]
    # a second live wrapper on the same parameters would double-send: refused
    try:
        BucketedDataParallel(m.module)
        out["rewrap"] = None
    except ValueError as e:
        out["rewrap"] = str(e)
    # 6. the type-check averaging vs ours, on identical starting weights
    out["seed"] = train(_SeedDP(build_model(cfg), world), cfg, rank, world).params
    out["ours"] = train(NaiveDataParallel(build_model(cfg)), cfg, rank, world).params
    return out


def test_bucketing_edge_cases_bad_start_and_seed_bug(ranks):
    world, cfg = 2, EDGE_CFG
    results = [r["edge"] for r in ranks(world)]
    ref = reference(cfg)
    r0, r1 = results

    params, names = r0["tiny_cap"]
    assert max_diff(params, ref.params) <= TOL
    assert ["0.weight"] in names and ["2.weight"] in names           # 4.6 KiB and 9.2 KiB > 1 KiB cap

    frozen_model = build_model(cfg)
    frozen_model[0].requires_grad_(False)
    frozen_ref = train(frozen_model, cfg)
    params, sent, grad_none, names = r0["frozen"]
    assert max_diff(params, frozen_ref.params) <= TOL
    assert grad_none and not any(n.startswith("0.") for b in names for n in b)
    trainable = sum(p.numel() for p in frozen_model.parameters() if p.requires_grad)
    assert sent == [int(formula_bytes(trainable, world))] * cfg.steps   # frozen bytes never sent

    for r, res in enumerate(results):
        assert res["unused_error"] and res["unused_error"].startswith(f"rank {r}:")
        assert "['spare.weight', 'spare.bias']" in res["unused_error"] and "find_unused_parameters" in res["unused_error"]
        unused_ref = train(_Unused(cfg), cfg).params                 # single process: spare untouched
        assert max_diff(res["unused_ok"], unused_ref) <= TOL

    rank0_start = flat(build_model(Config(seed=100)).parameters())
    for res in results:
        for got in res["differ_bcast"]:
            assert torch.equal(got, rank0_start)                     # everyone now holds rank 0's
        for cls, msg in res["differ_check"].items():
            assert msg and "differ across ranks before training: rank(s) [1]" in msg, (cls, msg)
    assert "'0.weight'" in r1["differ_check"]["BucketedDataParallel"]  # the differing rank names them

    for res in results:
        assert max_diff(res["torch_impl"], ref.params) <= TOL and max_diff(res["set_to_none"], ref.params) <= TOL
        assert "already belongs to another live BucketedDataParallel" in res["rewrap"]

    # the type-check version: no error, but each rank trained alone on its half of the data
    seed_spread = max_diff(r0["seed"], r1["seed"])
    assert seed_spread > 100 * TOL, f"broken version should diverge, spread {seed_spread:.2e}"
    assert max_diff(r0["seed"], ref.params) > 100 * TOL
    assert torch.equal(flat(r0["ours"]), flat(r1["ours"])) and max_diff(r0["ours"], ref.params) <= TOL


# ----------------------------------------------------------------------------- exact bytes, uneven sizes

def _uneven(rank, world, cfg):
    m = BucketedDataParallel(build_model(cfg), bucket_cap_mb=0.0005, algorithm="ring")
    res = train(m, cfg, rank, world)
    return res.params, res.bytes_sent, m.bucket_numels()


def test_uneven_buckets_bytes_equal_exact_ring_closed_form(ranks):
    # odd sizes: chunks of a 3-rank ring differ by one element, buckets differ in size
    world, cfg = 3, UNEVEN_CFG
    results = [r["uneven"] for r in ranks(world)]
    ref = reference(cfg)
    psi = sum(p.numel() for p in ref.params)
    for r, (params, sent, numels) in enumerate(results):
        assert max_diff(params, ref.params) <= TOL
        assert sum(numels) == psi and len(numels) > 2
        exact = ring_bytes(numels, world, r)                 # Σ 2·S − c[(r+1)%N] − c[(r+2)%N]
        assert sent == [exact] * cfg.steps
        assert abs(exact - formula_bytes(psi, world)) <= 2 * 4 * len(numels)   # ≤ 2 elements per bucket off
    assert sum(ring_bytes(results[0][2], world, r) for r in range(world)) == 2 * (world - 1) * psi * 4
