"""ZeRO++ qwZ and qgZ (zero_from_scratch/engine/quantize.py, qwz.py, qgz.py): the block-wise
quantiser's error bound; the bytes the ledger measured equal the formulas and are at most 0.35 of
plain ZeRO-3's; training stays within tolerance of unquantised; qgZ's hierarchical reduction on
2 "nodes" × 2 ranks against the exact sum; qwZ combined with hpZ."""
import json
import os

import pytest
import torch
import torch.nn as nn

import zero_from_scratch
from benchmarks.zeropp import compare
from zero_from_scratch.engine import qgz, qwz
from zero_from_scratch.engine.config import load_config
from zero_from_scratch.engine.quantize import Spec, decode_rows, encode_rows, quantize_rows, round_trip

# ---------------------------------------------------------------------------------- the quantiser


@pytest.mark.parametrize("bits,symmetric,block", [(8, True, 256), (8, False, 64), (4, True, 256), (4, True, 7),
                                                  (4, False, 33)])
def test_quantiser_error_bounded_by_half_a_step(bits, symmetric, block):
    spec = Spec(bits, block, symmetric)
    g = torch.Generator().manual_seed(bits + block)
    x = torch.randn(3, 1001, generator=g) * torch.logspace(-3, 3, 3).view(3, 1)   # rows of very different scale
    x[1, 17] = 500.0                                                                # an outlier: one block only
    wire = encode_rows(x, spec)
    assert wire.dtype == torch.uint8 and wire.shape == (3, spec.wire_bytes(1001))
    y = decode_rows(wire, 1001, spec)
    _, s, _ = quantize_rows(x, spec)
    step = s.repeat_interleave(block, dim=1)[:, :1001]
    assert ((x - y).abs() <= step / 2 * (1 + 1e-6)).all()
    # the outlier coarsened only its own block: the rest of row 1 keeps its fine step
    other = torch.arange(1001) // block != 17 // block
    assert (step[1, other] < step[1, 17] / 10).all()


@pytest.mark.parametrize("bits,symmetric", [(8, True), (8, False), (4, True), (4, False)])
def test_quantiser_exact_on_the_grid(bits, symmetric):
    spec = Spec(bits, 16, symmetric)
    q = 2 ** (bits - 1) - 1 if symmetric else 2 ** bits - 1
    codes = torch.randint(-q if symmetric else 0, q + 1, (4, 16 * 5 + 3), generator=torch.Generator().manual_seed(1))
    codes[:, ::16] = q                          # every block reaches the top code: its scale is exactly s
    x = codes.float() * 0.125 + (0.0 if symmetric else -2.0)
    if not symmetric:
        codes[:, 1::16] = 0                     # and the bottom one: the zero point is exactly -2
        x = codes.float() * 0.125 - 2.0
    assert torch.equal(decode_rows(encode_rows(x, spec), x.shape[1], spec), x)


def test_quantiser_zeros_and_wire_sizes():
    assert torch.equal(round_trip(torch.zeros(10), Spec(4, 4)), torch.zeros(10))
    assert Spec(8, 256).wire_bytes(1024) == 1024 + 16 and Spec(4, 256).wire_bytes(1001) == 501 + 16
    assert Spec(8, 256, symmetric=False).wire_bytes(256) == 256 + 8
    with pytest.raises(ValueError, match="bits"):
        Spec(bits=3)


def test_keys_are_known_checked_and_stage3_only():
    z = {"stage": 3, "zero_quantized_weights": True, "zero_quantized_gradients": True}
    cfg = load_config({"train_batch_size": 4, "zero_optimization": z}, world_size=2)
    assert cfg.zeropp.quantized_weights and cfg.zeropp.quantized_gradients and not cfg.unknown_keys
    with pytest.raises(ValueError, match="zero_quantized_weights"):
        load_config({"train_batch_size": 4, "zero_optimization": {**z, "zero_quantized_weights": "yes"}}, 2)
    cfg = load_config({"train_batch_size": 4, "zero_optimization": {**z, "stage": 2}}, world_size=2)
    assert not cfg.zeropp.quantized_weights and any("no effect at stage 2" in n for n in cfg.zero.notes)


# ---------------------------------------------------------------------------------- training, 2 ranks

CFG = {"train_micro_batch_size_per_gpu": 8, "optimizer": {"type": "AdamW", "params": {"lr": 3e-3}},
       "gradient_clipping": 1.0}
STEPS = 30


def mlp(width=256):
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(32, width), nn.GELU(), nn.Linear(width, width), nn.GELU(), nn.Linear(width, 10))


def _train(rank, world, zpp: dict, steps=STEPS, width=256, report_step=0):
    # persistence 0, reuse 0: every unit is all-gathered in forward AND backward and reduced once
    # (the textbook 3 collectives per unit), so bytes compare with the formula unit by unit
    z = {"stage": 3, "stage3_param_persistence_threshold": 0, "stage3_max_reuse_distance": 0, **zpp}
    engine, *_ = zero_from_scratch.initialize(model=mlp(width), config={**CFG, "zero_optimization": z})
    teacher = torch.nn.Linear(32, 10)
    torch.nn.init.normal_(teacher.weight, std=0.5, generator=torch.Generator().manual_seed(7))
    losses, rep = [], None
    for step in range(steps):
        x = torch.randn(8, 32, generator=torch.Generator().manual_seed(1000 * (step % 16) + rank))   # 16 batches
        y = teacher(x).argmax(1).detach()
        loss = nn.functional.cross_entropy(engine(x.to(engine.dtype)).float(), y)
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
        if step == report_step:
            rep = engine.comm_report(print_table=False)       # one whole optimizer step's ledger
    return losses, rep, [u.padded for u in engine.layout.units], dict(engine.stage.stats)


def test_qwz_qgz_bytes_and_loss(spawn):
    world = 2
    plain = spawn(_train, world, args=({},))
    pp = spawn(_train, world, args=({"zero_quantized_weights": True, "zero_quantized_gradients": True},))
    padded = plain[0][2]
    for r in range(world):
        rows = {row["purpose"]: row for row in pp[r][1]["rows"]}
        # the ledger's measured bytes = the formulas (qwz.allgather_bytes, qgz.reduce_bytes), written per purpose
        for kind in ("forward", "backward"):
            assert rows[f"param all-gather ({kind}, int8)"]["sent"] == qwz.allgather_bytes(padded, world)
        for purpose, b in qgz.reduce_bytes(padded, 1, world).items():
            assert rows[purpose]["sent"] == rows[purpose]["ring_formula"] == b
        # independent expectation: int8 = 1 byte + 4 per 4096 (scales), int4 = 1/2 + 4 per 64, vs fp32 4
        shard = [p // world for p in padded]
        expect = sum((world - 1) * (2 * (s + 4 * -(-s // 4096)) + (s + 1) // 2 + 4 * -(-s // 64)) for s in shard)
        assert pp[r][1]["data_sent"] == expect
        assert plain[r][1]["data_sent"] == 3 * (world - 1) * 4 * sum(shard)
        assert pp[r][1]["data_sent"] <= 0.35 * plain[r][1]["data_sent"]
        # quantisation noise, not a bug: after 30 steps the loss is within 3 % of unquantised, and training worked
        lp, lq = plain[r][0], pp[r][0]
        assert sum(lp[-5:]) / 5 < 0.6 * lp[0]
        assert abs(sum(lq[-5:]) - sum(lp[-5:])) <= 0.03 * sum(lp[-5:]), (lp[-5:], lq[-5:])
        assert lq != lp                                       # the quantised run really differs


# ---------------------------------------------------------------------------------- hierarchical qgZ, hpZ + qwZ

def _refused(rank, world, z: dict):
    try:
        zero_from_scratch.initialize(model=mlp(64), config={**CFG, "zero_optimization": {"stage": 3, **z}})
        return "accepted"
    except ValueError as e:
        return str(e)


def test_offload_with_quantised_collectives_is_refused_on_every_rank(spawn, tmp_path):
    """Combinations the engine does not wire (a quantised all-gather/reduction of shards in files):
    a ValueError naming the keys and the rank at initialize, on every rank, never a silent mix."""
    for z, words in (({"offload_param": {"device": "nvme", "nvme_path": str(tmp_path)}, "zero_hpz_partition_size": 2},
                      "secondary partition"),
                     ({"offload_optimizer": {"device": "nvme", "nvme_path": str(tmp_path)},
                       "zero_quantized_gradients": True}, "zero_quantized_gradients")):
        out = spawn(_refused, 2, args=(z,))
        assert all(f"rank {r}:" in m and words in m and "not supported" in m for r, m in enumerate(out)), out


def _offload_pp(rank, world, offload: bool, overlap: bool, hpz: int = 1, qw: bool = True):
    os.environ["RINGZERO_LOCAL_SIZE"] = "2"                 # with 4 ranks: 2 "nodes" × 2
    z = {"zero_quantized_weights": qw, "zero_quantized_gradients": True, "overlap_comm": overlap,
         "zero_hpz_partition_size": hpz, **({"offload_param": {"device": "cpu", "buffer_count": 2}} if offload else {})}
    losses, rep, _, _ = _train(rank, world, z, steps=3, width=64, report_step=1)
    return losses, sorted(row["purpose"] for row in rep["rows"])


def test_qwz_qgz_with_offload_param_are_qwz_qgz(spawn):
    """qwZ reads each offloaded shard in and quantises it; qgZ reduces gradients, which
    offload_param leaves in memory: offloading the shards changes where they live, not one bit of
    the losses (as offload_param alone vs ZeRO-3); overlap_comm (prefetches, qgZ on the comm
    thread) changes when bytes move only. Offload + overlap against neither."""
    assert spawn(_offload_pp, 2, args=(True, True)) == spawn(_offload_pp, 2, args=(False, False))


def test_hpz_with_offload_param_cpu_is_hpz(spawn):
    """hpZ with offload_param "cpu" keeps its secondary shards in host memory (where DeepSpeed puts
    them for "cpu"); 2 "nodes" × 2 ranks: the backward gathers stay in the group and the losses are
    bit for bit those without offload and without overlap_comm (qgZ's intra-node all-to-all on
    the comm thread, the inter-node step after it: when bytes move, not which)."""
    on, off = spawn(_offload_pp, 4, args=(True, True, 2, False)), spawn(_offload_pp, 4, args=(False, False, 2, False))
    assert on == off
    assert all("param all-gather (backward, hpZ group)" in purposes for _, purposes in on), on[0][1]


def _hier_reduce(rank, world):
    os.environ["RINGZERO_LOCAL_SIZE"] = "2"                 # 2 "nodes" × 2 ranks
    model = nn.Sequential(nn.Linear(40, 50))
    engine, *_ = zero_from_scratch.initialize(
        model=model, config={**CFG, "zero_optimization": {"stage": 3, "zero_quantized_gradients": True}})
    st = engine.stage
    u = engine.layout.units[0]
    full = torch.randn(world, u.padded, generator=torch.Generator().manual_seed(3))   # every rank's bucket
    b = full[rank].clone()
    st.qgz.reduce(b, u)
    lo, hi = u.shard_range(rank)
    return st.qgz.m, st.qgz.k, b[lo:hi], full.sum(0)[lo:hi], full, dict(engine.comm.usage), u.padded


def test_qgz_hierarchical_matches_exact_sum(spawn):
    world = 4
    for r, (m, k, got, exact, full, usage, padded) in enumerate(spawn(_hier_reduce, world)):
        assert (m, k) == (2, 2)
        # bound: each of the 4 contributions rounded once (int4 step/2), the node sums once more
        spec = qgz.SPEC
        bound = sum(full[i].abs().max() / 7 / 2 for i in range(world)) + 2 * full.abs().max() * 2 / 7 / 2
        err = (got - exact).abs().max()
        assert err <= bound, (err, bound)
        assert err < 0.25 * exact.abs().max()                # and it is a sum, not noise
        want = qgz.reduce_bytes([padded], m, k, spec)
        for purpose, b in want.items():
            assert usage[purpose].sent == b, (purpose, usage[purpose].sent, b)


def _hpz_qwz(rank, world, zpp):
    os.environ["RINGZERO_LOCAL_SIZE"] = "2"
    return _train(rank, world, zpp, steps=2, width=64, report_step=1)   # step 1: after the traced one


@pytest.mark.parametrize("qw", [True, False])
def test_hpz_backward_stays_in_group_with_qwz_and_prefetch(spawn, qw):
    world = 4
    on = {"zero_quantized_weights": qw, "zero_hpz_partition_size": 2}
    a = spawn(_hpz_qwz, world, args=({"zero_quantized_weights": True},)) if qw else None
    b = spawn(_hpz_qwz, world, args=(on,))
    c = spawn(_hpz_qwz, world, args=({**on, "overlap_comm": True},))    # prefetches: the group's gather too
    for r in range(world):
        padded = b[r][2]
        piece = (lambda p: qwz.SPEC.wire_bytes(p // world)) if qw else (lambda p: 4 * (p // world))
        group = sum((2 - 1) * (world // 2) * piece(p) for p in padded)
        for run in (b, c):
            rows = {row["purpose"]: row for row in run[r][1]["rows"]}
            assert not any(p.startswith("param all-gather (backward") and "hpZ" not in p for p in rows), rows
            assert rows["param all-gather (backward, hpZ group)"]["sent"] == group
        assert c[r][3]["prefetch_used"] > 0
        assert b[r][0] == c[r][0]                 # prefetching changes when bytes move, not which
        if qw:      # backward used the very int8 bytes forward received: qwZ's losses
            # step 0 bit for bit; later steps within 1e-6 relative: the hpZ copy lives in other buffers,
            # and the CPU's matmul kernels may round differently with the buffers' alignment
            assert a[r][0][0] == b[r][0][0]
            assert all(abs(x - y) <= 1e-6 * abs(x) for x, y in zip(a[r][0], b[r][0])), (a[r][0], b[r][0])


def _overlap(rank, world, overlap, impl="primitives"):
    zpp = {"zero_quantized_weights": True, "zero_quantized_gradients": True, "overlap_comm": overlap}
    z = {"stage": 3, "stage3_param_persistence_threshold": 0, "stage3_max_reuse_distance": 0, **zpp}
    engine, *_ = zero_from_scratch.initialize(model=mlp(64), config={**CFG, "zero_optimization": z}, comm_impl=impl)
    losses, async_a2a, composed = [], [], engine.comm.composed

    def spy(purpose, *a, async_op=False, **k):           # which qgZ all-to-alls were launched asynchronously
        async_a2a.append(async_op and purpose == "grad all-to-all (int4)")
        return composed(purpose, *a, async_op=async_op, **k)
    engine.comm.composed = spy
    for step in range(3):
        x = torch.randn(8, 32, generator=torch.Generator().manual_seed(10 * step + rank))
        loss = engine(x).pow(2).mean()
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    return losses, engine.stage.stats["prefetch_used"], sum(async_a2a)


def test_qwz_prefetch_qgz_overlap_and_torch_comm_are_the_same_computation(spawn):
    seq, ovl = spawn(_overlap, 2, args=(False,)), spawn(_overlap, 2, args=(True,))
    tch = spawn(_overlap, 2, args=(False, "torch"))
    for r in range(2):
        assert ovl[r][1] > 0 and seq[r][1] == 0          # prefetched int8 gathers were used
        assert ovl[r][2] > 0 and seq[r][2] == 0          # overlap_comm: qgZ's all-to-alls left the backward thread
        assert ovl[r][0] == seq[r][0]                     # same bytes quantised, same sums: same losses
        assert tch[r][0] == seq[r][0]                     # torch.distributed moves the same bytes (flat qgZ)


def _bf16(rank, world, zpp):
    CFG["bf16"] = {"enabled": True}
    losses, rep, padded, _ = _train(rank, world, zpp, steps=2)
    return losses, rep["data_sent"], padded


def test_bf16_weights_move_half_gradients_quarter(spawn):
    plain = spawn(_bf16, 2, args=({},))
    pp = spawn(_bf16, 2, args=({"zero_quantized_weights": True, "zero_quantized_gradients": True},))
    for r in range(2):
        shard = [p // 2 for p in plain[r][2]]
        assert plain[r][1] == 3 * 2 * sum(shard)                            # bf16: 2 bytes per element
        assert pp[r][1] == 2 * qwz.allgather_bytes(plain[r][2], 2) + qgz.reduce_bytes(plain[r][2], 1, 2)[
            "grad all-to-all (int4)"]
        assert pp[r][1] <= (2 * 0.5 + 0.25 + 0.05) / 3 * plain[r][1]       # ½ weights, ¼ gradients, + scales
        assert all(abs(a - b) <= 0.03 * b for a, b in zip(pp[r][0], plain[r][0]))


def test_figure_draws_a_saved_benchmark(tmp_path, monkeypatch):
    pytest.importorskip("matplotlib")
    from figures import ch14_zeropp, common
    monkeypatch.setattr(common, "IMG", str(tmp_path))
    rows = {"ZeRO-3": {"param all-gather (forward)": 400, "grad reduce-scatter": 400},
            "qwZ + qgZ": {"param all-gather (forward, int8)": 101, "grad all-to-all (int4)": 56}}
    res = {run: {"losses": [1.0 - 0.01 * i for i in range(8)], "psi": 100, "data_sent": sum(r.values()),
                 "rows": {k: {"sent": v, "formula": v} for k, v in r.items()}} for run, r in rows.items()}
    path = tmp_path / "bench.json"
    path.write_text(json.dumps({"model": "mlp", "world": 2, "results": res}))
    (png,) = ch14_zeropp.main(["--json", str(path)])
    assert common.read_meta(png)["Source"] == "figures.ch14_zeropp"


@pytest.mark.slow
@pytest.mark.timeout(3600)
def test_classification_model_bytes_and_loss():
    """The classification model (DistilBERT shape, MiniLM weights, 22.7 M parameters), 30 steps:
    ~15 min on 2 shared cores."""
    pytest.importorskip("transformers")
    res = compare("classification", 30, world=2, runs={"ZeRO-3": {}, "qwZ + qgZ": {
        "zero_quantized_weights": True, "zero_quantized_gradients": True}})
    plain, pp = res["ZeRO-3"], res["qwZ + qgZ"]
    assert pp["data_sent"] <= 0.35 * plain["data_sent"]
    for purpose, row in pp["rows"].items():
        assert row["sent"] == row["formula"], purpose
    assert abs(sum(pp["losses"][-5:]) - sum(plain["losses"][-5:])) <= 0.03 * sum(plain["losses"][-5:])
