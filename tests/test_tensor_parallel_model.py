"""parallelize() on DistilBERT equals one process; its bytes equal the formula.

Parity (parity/tp.py): on every rank the unsharded model runs beside the sharded
one on the same batch; logits, loss, every gradient (sharded ones against the matching slice)
and the parameters after 5 AdamW steps (through gather_state_dict) must agree to 1e-5 in fp32.
What separates them is only the order of floating-point sums (a row-parallel product is
summed over N partial products instead of in one matmul), ~1e-7 relative; a wrong shard,
a missing all-reduce or a doubled gradient is O(1). Every split is uneven here (5 heads,
FFN 37, vocabulary 101).

Ledger: LEDGER.calls of one forward + backward == tensor_parallel.engine.formulas, exactly (with SP
that includes the backward re-gather of the Q/K/V and lin1 inputs).

SP memory: inside the transformer layers nothing saved for backward spans the whole sequence
at full width h (b·s·h): the gathered inputs of Q/K/V and lin1 are re-gathered in backward,
LayerNorm and residual hold s/N positions (without the re-gather it finds 4 per layer: Q, K, V, lin1).

Accuracy (classification/parallel/accuracy.py): the offline pretrained classifier, its head fine-tuned
in this process, predicts every test row the same sharded at tp = 2 as unsharded. Bound on
|Δlogit|: ACC_BOUND = 1e-4. Sharding changes only fp32 summation order (a row-parallel output
is N partial dot products of length h/N added by the ring instead of one dot product of length
h; six layers of softmax/LayerNorm carry those ~1e-7 relative errors to the logits, ~1e-6
relative in the end), measured 7.9e-6 (tp = 2) and 9.1e-6 (tp = 3) over the whole test split for
logits up to 10.8 (the tutorial's table); 1e-4 leaves an 11× margin for other BLAS blockings
and thread counts, while a wrong shard or a missing reduction moves logits by O(0.1-1).
"""
import pytest
import torch

from primitives.engine.ledger import LEDGER

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

    from parity.tp import tiny_config
    torch.manual_seed(0)
    return DistilBertForSequenceClassification(tiny_config())


def _ledger(rank, n, sp, b=4, s=6):
    """Calls and bytes of one forward + backward vs formulas.distilbert_traffic (ring pinned)."""
    import tensor_parallel.comm as C
    from tensor_parallel import parallelize, sharded_numel
    from tensor_parallel.engine.formulas import distilbert_params, distilbert_traffic
    from parity.tp import batch
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


ACC_BOUND = 1e-4
ACC_ROWS, ACC_TRAIN_ROWS, ACC_EPOCHS = 32, 32, 10     # the default suite's slice; the slow test takes all


def _tp_work(rank, n, real):
    from parity.tp import run_parity
    out = {"plain": run_parity(_model(), None, False), "sp": run_parity(_model(), None, True)}
    out["ledger plain"] = _ledger(rank, n, False)
    out["ledger sp"] = _ledger(rank, n, True)
    out["sp full-width saves"] = _sp_full_width_saves()
    if real is not None:
        from classification.parallel.accuracy import _sharded
        out["real"] = _sharded(rank, n, *real)
    else:
        out["bad"] = _bad_distilbert(rank, n)
    return out


def _sp_full_width_saves(b=2, s=6):
    """Saved-for-backward tensors inside the SP transformer layers that hold all s positions × h."""
    from tensor_parallel import parallelize
    from parity.tp import batch
    model = parallelize(_model(), sequence_parallel=True)
    h, found, on = model.config.dim, [], [False]
    weights = {p.untyped_storage().data_ptr() for p in model.parameters()}
    for blk in model.distilbert.transformer.layer:
        blk.register_forward_pre_hook(lambda *a: on.__setitem__(0, True))
        blk.register_forward_hook(lambda *a: on.__setitem__(0, False))

    def pack(t):
        if (on[0] and t.dim() >= 2 and t.shape[-1] == h and t.numel() >= b * s * h      # 2-D views too
                and t.untyped_storage().data_ptr() not in weights):
            found.append(tuple(t.shape))
        return t
    ids, mask, labels = batch(5, b, s)
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = model(input_ids=ids, attention_mask=mask, labels=labels).loss
    loss.backward()
    return found


def _bad_distilbert(rank, n):
    """Fewer heads than ranks; a sequence SP cannot split evenly. Same error on every rank."""
    from transformers import DistilBertForSequenceClassification

    from tensor_parallel import parallelize
    from parity.tp import batch, tiny_config
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


def _assert_ledger(res, n):
    for rank, r in enumerate(res):
        for key in ("ledger plain", "ledger sp"):
            calls, sent, exp_calls, exp_bytes, (params, exp_params) = r[key]
            assert calls == exp_calls, f"rank {rank} {key}: collectives {calls} != formula {exp_calls}"
            assert sent == exp_bytes, f"rank {rank} {key}: {sent} bytes sent != formula {exp_bytes}"
            assert params == exp_params, f"rank {rank}: holds {params} parameters, formula says {exp_params}"
        assert not r["sp full-width saves"], f"rank {rank}: SP saved full-sequence b·s·h tensors {r['sp full-width saves']}"


def _assert_accuracy(ref, per_rank, n):
    for rank, c in enumerate(per_rank):
        assert c["differ"] == 0 and c["max dlogit"] <= ACC_BOUND, (
            f"tp={n} rank {rank}: {c['differ']} of {len(ref['texts'])} test rows predicted differently, "
            f"max |Δlogit| {c['max dlogit']:.3g} (bound {ACC_BOUND}), accuracy {c['acc']:.4f} vs {c['acc ref']:.4f}")


def test_tp2_parity_ledger_and_real_distilbert(spawn):
    """…and the pretrained classifier at tp = 2 on the first ACC_ROWS test rows (one process
    computes the reference here, before the ranks start)."""
    from classification.parallel.accuracy import compare, reference
    ref = reference(ACC_ROWS, ACC_TRAIN_ROWS, ACC_EPOCHS)
    res = spawn(_tp_work, 2, args=((ref["num_labels"], ref["head"], ref["texts"]),), timeout=300)
    bad = _check([r["plain"] for r in res], "tp=2") + _check([r["sp"] for r in res], "tp=2 SP")
    assert not bad, "\n".join(bad)
    _assert_ledger(res, 2)
    _assert_accuracy(ref, [compare(ref["logits"], r["real"], ref["labels"]) for r in res], 2)


@pytest.mark.slow
def test_accuracy_whole_test_split_tp2_tp3(spawn):
    """The whole test split (1,275 rows), head fine-tuned on 2,000 training rows, tp = 2 and 3."""
    from classification.parallel.accuracy import reference, sharded
    ref = reference()
    for n in (2, 3):
        _assert_accuracy(ref, sharded(spawn, n, ref), n)


def test_tp3_uneven_parity_and_ledger(spawn):
    res = spawn(_tp_work, 3, args=(None,), timeout=300)
    bad = _check([r["plain"] for r in res], "tp=3") + _check([r["sp"] for r in res], "tp=3 SP")
    assert not bad, "\n".join(bad)
    _assert_ledger(res, 3)
    for rank, r in enumerate(res):
        for label, msg, words in r["bad"]:
            missing = [w for w in [f"rank {rank}"] + words if w not in msg]
            assert words and not missing, f"[{label}] rank {rank}: {msg} (missing {missing})"


def _dp_tp_work(rank, n, sp):
    from primitives.mesh import Mesh
    from parity.tp import run_parity
    mesh = Mesh.build(dp=2, tp=2)
    return run_parity(_model(), mesh.tp_group, sp, mesh.dp_group)


@pytest.mark.parametrize("sp", [False, pytest.param(True, marks=pytest.mark.slow)])
def test_dp2_tp2_equals_one_process(spawn, sp):
    res = spawn(_dp_tp_work, 4, args=(sp,), timeout=300)
    bad = _check(res, f"dp=2 × tp=2 sp={sp}")
    assert not bad, "\n".join(bad)
