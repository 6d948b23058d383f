"""3D parallelism (data × pipeline × tensor) on DistilBERT: pipeline_parallel's engine running
classification/parallel/pipeline.py's stages on one primitives.mesh, against one process.

    python -m pytest -q tests/test_tensor_parallel_3d.py            # pp=2 × tp=2 (4 ranks), bad input
    python -m pytest -q -m slow tests/test_tensor_parallel_3d.py    # + dp=2 × pp=2 × tp=2, the demo

Every rank trains the sharded pipeline AND, on its own, a deep copy of the unsharded tiny
DistilBERT (parity.tp.tiny_config: 5 heads, FFN 37, vocab 101, so every tp split
is uneven) on the whole global batch: the reference touches no collective. Per step the loss
and the global gradient norm must match (1e-5); after 3 AdamW steps with clipping active, each
parameter this rank holds must equal its slice of the reference (1e-5, fp32: the differences
are reduction-order rounding, ~1e-7), and together the ranks must hold every parameter.
"""
import copy

import pytest
import torch

CLIP, STEPS, M, B, S = 0.15, 3, 2, 2, 6


def _pipeline_vs_one_process(rank, world, dp):
    import pipeline_parallel
    from pipeline_parallel.engine.module import PipelineModule
    from primitives.mesh import Mesh
    from parity.tp import batch, tiny_config
    from classification.parallel.pipeline import classification_loss, distilbert_layers, hf_named_parameters, pack, stage_bounds
    from transformers import DistilBertForSequenceClassification
    mesh = Mesh.build(dp=dp, pp=2, tp=2)
    torch.manual_seed(0)
    model = DistilBertForSequenceClassification(tiny_config(num_labels=3))
    ref = copy.deepcopy(model)
    layers, source = distilbert_layers(model, mesh.tp_group, 2)
    pm = PipelineModule(layers, num_stages=2, loss_fn=classification_loss, partition_method=stage_bounds(2, 2, rank))
    cfg = {"train_micro_batch_size_per_gpu": B, "gradient_accumulation_steps": M, "gradient_clipping": CLIP,
           "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "weight_decay": 0.01, "torch_adam": True}}}
    engine, opt, *_ = pipeline_parallel.initialize(model=pm, config=cfg, mesh=mesh)
    source.release()
    ref_opt = torch.optim.AdamW(ref.parameters(), **{k: opt.defaults[k] for k in ("lr", "betas", "eps", "weight_decay")})
    # step t: dp·M micro-batches; replica d takes micro-batches d·M … d·M + M − 1
    data = [[batch(100 * t + j, b=B, s=S) for j in range(dp * M)] for t in range(STEPS)]
    d = engine.dp_rank
    mine = iter([(pack(ids, mask), y) for step in data for ids, mask, y in step[d * M:(d + 1) * M]])
    out = {"loss": [], "norm": [], "ref_loss": [], "ref_norm": []}
    for step in data:
        out["loss"].append(engine.train_batch(mine))
        out["norm"].append(engine.global_grad_norm)
        losses = [ref(input_ids=ids, attention_mask=mask, labels=y).loss for ids, mask, y in step]
        loss = torch.stack(losses).mean()
        loss.backward()
        out["ref_loss"].append(loss.item())
        out["ref_norm"].append(torch.nn.utils.clip_grad_norm_(ref.parameters(), CLIP).item())
        ref_opt.step()
        ref_opt.zero_grad()
    full = dict(ref.named_parameters())
    out["param_diff"], out["names"] = 0.0, []
    for name, p in hf_named_parameters(engine.chunks):
        r = full[name].detach()
        if hasattr(p, "tp_shard"):
            dim, lo, hi, _ = p.tp_shard
            r = r.narrow(dim, lo, hi - lo)
        assert r.shape == p.shape, (name, r.shape, p.shape)
        out["param_diff"] = max(out["param_diff"], (p.detach() - r).abs().max().item())
        out["names"].append(name)
    out["all_names"] = sorted(full)
    out["sharded"] = sum(hasattr(p, "tp_shard") for p in engine.params)
    out["bad"] = _bad_input(rank, world)          # in the same ranks: one spawn less for the suite budget
    return out


def _check(results):
    for rank, r in enumerate(results):
        assert max(r["ref_norm"]) > CLIP, "clipping never acted: the test would not see a wrong norm scale it"
        for a, b in zip(r["loss"], r["ref_loss"]):
            assert abs(a - b) < 1e-5, (rank, r["loss"], r["ref_loss"])
        for a, b in zip(r["norm"], r["ref_norm"]):
            assert abs(a - b) < 1e-5 * max(1.0, b), (rank, r["norm"], r["ref_norm"])
        assert r["param_diff"] < 1e-5, (rank, r["param_diff"])
        assert r["sharded"] > 0, rank
    assert sorted({n for r in results for n in r["names"]}) == results[0]["all_names"]
    for rank, r in enumerate(results):
        pp, mesh = r["bad"]
        assert f"rank {rank}" in pp and "--pp 4 does not divide" in pp and "[1, 2, 3, 6]" in pp, pp
        assert f"rank {rank}" in mesh and f"does not factor the world size {len(results)}" in mesh, mesh


def test_pp2_tp2_equals_one_process_and_bad_input(spawn):
    _check(spawn(_pipeline_vs_one_process, 4, args=(1,)))


@pytest.mark.slow
def test_dp2_pp2_tp2_equals_one_process(spawn):
    _check(spawn(_pipeline_vs_one_process, 8, args=(2,)))


def _bad_input(rank, world):
    from classification.parallel import train
    from classification.parallel.pipeline import StageError
    from primitives import get_comm
    from primitives.mesh import MeshError
    got = []
    for argv, exc in ((["--pp", "4", "--tp", "1", "--dp", "1"], StageError),       # 6 blocks, 4 stages
                      (["--pp", "2", "--tp", "2", "--dp", "3"], MeshError)):       # 12 ranks asked
        try:
            train.run(train.parse_args(argv), get_comm())
            got.append("no error")
        except exc as e:
            got.append(str(e))
    return got


def test_pp_flags_refused_where_they_do_nothing(capsys):
    from classification.parallel.train import parse_args
    for argv, words in ((["--micro-batches", "2"], "apply to the pipeline"),
                        (["--pp", "2", "--sequence-parallel"], "--sequence-parallel needs --pp 1"),
                        (["--pp", "2", "--batch", "6", "--micro-batches", "4"], "multiple of --micro-batches")):
        with pytest.raises(SystemExit):
            parse_args(argv)
        err = capsys.readouterr().err
        assert words in err and "(rank 0)" in err, err


def test_demo_refuses_a_mesh_the_world_cannot_take():
    from conftest import run_cmd
    r = run_cmd("python classification/parallel/train.py --pp 2", check=False, timeout=120)
    assert r.returncode != 0 and "Traceback" not in r.stderr, r.stderr[-1500:]
    assert "error: rank 0: mesh dp=1 × pp=2 × tp=1 = 2 does not factor the world size 1" in r.stderr, r.stderr[-1500:]


@pytest.mark.slow
def test_3d_demo_under_torchrun():
    from conftest import run_cmd
    from primitives.launch import free_port
    r = run_cmd(f"torchrun --standalone --master_port {free_port()} --nproc_per_node 8 classification/parallel/train.py "
                "--dp 2 --pp 2 --tp 2 --steps 2 --batch 8 --max-len 32 --eval-samples 32 --log-every 1", timeout=900)
    assert "mesh dp=2 × pp=2 × tp=2" in r.stdout and "step    1  loss" in r.stdout, r.stdout[-3000:]
    assert "val accuracy" in r.stdout and "PP bytes" in r.stdout, r.stdout[-3000:]
    # every rank's measured bytes equal the formula printed beside them: "measured (formula)"
    import re
    cells = re.findall(r"([\d,]+) \(([\d,]+)\)", r.stdout)
    assert len(cells) == 8 * 3 and all(a == b for a, b in cells), cells
