"""parallelize() on DistilBERT equals one process; its bytes equal the formula.

Parity (tensor_parallel/parity.py): on every rank the unsharded model runs beside the sharded
one on the same batch; logits, loss, every gradient (sharded ones against the matching slice)
and the parameters after 5 AdamW steps (through gather_state_dict) must agree to 1e-5 in fp32.
What separates them is only the order of floating-point sums (a row-parallel product is
summed over N partial products instead of in one matmul), ~1e-7 relative; a wrong shard,
a missing all-reduce or a doubled gradient is O(1). Every split is uneven here (5 heads,
FFN 37, vocabulary 101).

Ledger: LEDGER.calls of one forward + backward == tensor_parallel.formulas, exactly.
"""
import pytest
import torch

from primitives.ledger import LEDGER

TOL = 1e-5


def _check(res, label):
    bad = []
    for rank, r in enumerate(res):
        for k in ("logits", "loss", "grads", "params"):
            if not r[k] <= TOL:
                bad.append(f"{label} rank {rank}: {k} differs by {r[k]:.3g} > {TOL}")
        if r["missing grads"]:
            bad.append(f"{label} rank {rank}: {r['missing grads']} parameters got no gradient")
    return bad


def _model():
    from transformers import DistilBertForSequenceClassification

    from tensor_parallel.parity import tiny_config
    torch.manual_seed(0)
    return DistilBertForSequenceClassification(tiny_config())


def _ledger(rank, n, sp, b=4, s=6):
    """Calls and bytes of one forward + backward vs formulas.distilbert_traffic (ring pinned)."""
    import tensor_parallel.comm as C
    from tensor_parallel import parallelize, sharded_numel
    from tensor_parallel.formulas import distilbert_params, distilbert_traffic
    from tensor_parallel.parity import batch
    for k in C.ALGORITHM:
        C.ALGORITHM[k] = "ring"
    model = parallelize(_model(), None, sequence_parallel=sp)
    ids, mask, labels = batch(7, b, s)
    LEDGER.reset()
    model(input_ids=ids, attention_mask=mask, labels=labels).loss.backward()
    calls = {}
    for c in LEDGER.calls:
        calls[c.name] = calls.get(c.name, 0) + 1
    sent = sum(c.counts.bytes_sent for c in LEDGER.calls)
    exp_calls, exp_bytes = distilbert_traffic(model.config, b, s, n, rank, sp)
    params = sharded_numel(model)[0], distilbert_params(model.config, n, rank)
    return calls, sent, exp_calls, exp_bytes, params


def _tp_work(rank, n, with_real):
    from tensor_parallel.parity import run_parity
    out = {"plain": run_parity(_model(), None, False), "sp": run_parity(_model(), None, True)}
    out["ledger plain"] = _ledger(rank, n, False)
    out["ledger sp"] = _ledger(rank, n, True)
    if with_real:
        out["real"] = _real_forward()
    else:
        out["bad"] = _bad_distilbert(rank, n)
    return out


def _bad_distilbert(rank, n):
    """Fewer heads than ranks; a sequence SP cannot split evenly. Same error on every rank."""
    from transformers import DistilBertForSequenceClassification

    from tensor_parallel import parallelize
    from tensor_parallel.parity import batch, tiny_config
    rows = []
    try:
        parallelize(DistilBertForSequenceClassification(tiny_config(n_heads=n - 1, dim=4 * (n - 1))))
        rows.append(("heads < tp", "no error", []))
    except Exception as e:
        rows.append(("heads < tp", str(e), [f"{n - 1} attention heads", f"tp={n}"]))
    model = parallelize(_model(), sequence_parallel=True)
    ids, mask, labels = batch(3, 2, 3 * n + 1)
    try:
        model(input_ids=ids, attention_mask=mask, labels=labels)
        rows.append(("SP seq", "no error", []))
    except Exception as e:
        rows.append(("SP seq", str(e), [f"sequence length ({3 * n + 1})", f"divisible by tp={n}"]))
    return rows


def _real_forward():
    """The offline pretrained DistilBERT (classification/model.py) at tp = N: forward only."""
    import copy

    from classification.model import load_offline_model
    from tensor_parallel import parallelize
    torch.manual_seed(0)
    model, tok = load_offline_model(num_labels=2, dropout=0.0)
    model.eval()
    ref = copy.deepcopy(model)
    parallelize(model)
    enc = tok(["a gripping, beautifully acted film", "flat and far too long", "not bad at all"],
              padding=True, return_tensors="pt")
    with torch.no_grad():
        a = model(**enc).logits
        b = ref(**enc).logits
    return (a - b).abs().max().item(), b.abs().max().item()


def _assert_ledger(res, n):
    for rank, r in enumerate(res):
        for key in ("ledger plain", "ledger sp"):
            calls, sent, exp_calls, exp_bytes, (params, exp_params) = r[key]
            assert calls == exp_calls, f"rank {rank} {key}: collectives {calls} != formula {exp_calls}"
            assert sent == exp_bytes, f"rank {rank} {key}: {sent} bytes sent != formula {exp_bytes}"
            assert params == exp_params, f"rank {rank}: holds {params} parameters, formula says {exp_params}"


def test_tp2_parity_ledger_and_real_distilbert(spawn):
    res = spawn(_tp_work, 2, args=(True,), timeout=300)
    bad = _check([r["plain"] for r in res], "tp=2") + _check([r["sp"] for r in res], "tp=2 SP")
    assert not bad, "\n".join(bad)
    _assert_ledger(res, 2)
    for rank, r in enumerate(res):
        diff, scale = r["real"]
        assert diff <= TOL, f"rank {rank}: real DistilBERT logits differ by {diff:.3g} (|logits| ≤ {scale:.3g})"


def test_tp3_uneven_parity_and_ledger(spawn):
    res = spawn(_tp_work, 3, args=(False,), timeout=300)
    bad = _check([r["plain"] for r in res], "tp=3") + _check([r["sp"] for r in res], "tp=3 SP")
    assert not bad, "\n".join(bad)
    _assert_ledger(res, 3)
    for rank, r in enumerate(res):
        for label, msg, words in r["bad"]:
            missing = [w for w in [f"rank {rank}"] + words if w not in msg]
            assert words and not missing, f"[{label}] rank {rank}: {msg} (missing {missing})"


def _dp_tp_work(rank, n, sp):
    from primitives.mesh import Mesh
    from tensor_parallel.parity import run_parity
    mesh = Mesh.build(dp=2, tp=2)
    return run_parity(_model(), mesh.tp_group, sp, mesh.dp_group)


@pytest.mark.parametrize("sp", [False, pytest.param(True, marks=pytest.mark.slow)])
def test_dp2_tp2_equals_one_process(spawn, sp):
    res = spawn(_dp_tp_work, 4, args=(sp,), timeout=300)
    bad = _check(res, f"dp=2 × tp=2 sp={sp}")
    assert not bad, "\n".join(bad)
