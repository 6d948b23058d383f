"""Sharded checkpoints: bit-exact resume, consolidation to a plain state_dict, 2 → 3 resharding,
a kill -9 at every phase of a save (the same tag re-saved), and clear errors for bad input on
every rank."""
import os

import pytest
import torch
import torch.nn as nn

import zero_from_scratch
from conftest import run_cmd
from zero_from_scratch import CheckpointError

GLOBAL = 6


def mlp(seed):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(5, 8), nn.LayerNorm(8), nn.Tanh(), nn.Linear(8, 2))


def cfg(stage, world, bf16=False):
    return {"train_batch_size": GLOBAL, "gradient_clipping": 1.0, "bf16": {"enabled": bf16},
            "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "weight_decay": 0.1}},
            "scheduler": {"type": "WarmupDecayLR", "params": {"warmup_num_steps": 2, "total_num_steps": 20,
                                                              "warmup_max_lr": 1e-2}},
            "zero_optimization": {"stage": stage}}


def run_steps(engine, rank, world, steps, draw=True):
    """Train on this rank's rows of the global batches seeded by `steps`; each loss, plus (draw=True)
    one torch.rand draw, which shows whether the RNG stream was restored."""
    out = []
    for s in steps:
        g = torch.Generator().manual_seed(s)
        x, y = torch.randn(GLOBAL, 5, generator=g), torch.randn(GLOBAL, 2, generator=g)
        per = GLOBAL // world
        xs, ys = x[rank * per:(rank + 1) * per], y[rank * per:(rank + 1) * per]
        loss = nn.functional.mse_loss(engine(xs.to(engine.dtype)).float(), ys)
        engine.backward(loss)
        engine.step()
        out.append(loss.item() + (torch.rand(1).item() if draw else 0.0))
    return out


def full_params(engine, model):
    with engine.gathered_parameters(list(model.parameters())):
        return {n: p.detach().float().clone() for n, p in model.named_parameters()}


def _resume(rank, world, d, stage, bf16):
    model = mlp(0)
    e, *_ = zero_from_scratch.initialize(model=model, config=cfg(stage, world, bf16))
    run_steps(e, rank, world, range(3))
    e.save_checkpoint(d)
    straight = run_steps(e, rank, world, range(3, 6))
    final = full_params(e, model)
    model2 = mlp(1)                                     # different init: everything must come from the checkpoint
    e2, *_ = zero_from_scratch.initialize(model=model2, config=cfg(stage, world, bf16))
    e2.load_checkpoint(d)
    resumed = run_steps(e2, rank, world, range(3, 6))
    final2 = full_params(e2, model2)
    same = all(torch.equal(final[n], final2[n]) for n in final)
    return straight, resumed, same, e2.global_steps, e2.get_lr()


@pytest.mark.parametrize("stage,bf16", [(2, False), (3, True)])
def test_resume_is_bit_exact(spawn, tmp_path, stage, bf16):
    for straight, resumed, same, steps, lr in spawn(_resume, 2, args=(str(tmp_path), stage, bf16)):
        assert straight == resumed          # exactly: same data, same RNG, same state
        assert same and steps == 6


def _save_then_reshard(rank, world, d, phase):
    model = mlp(0)
    e, *_ = zero_from_scratch.initialize(model=model, config=cfg(2, world))
    if phase == "save":
        run_steps(e, rank, world, range(3))
        e.save_checkpoint(d)
        live = full_params(e, model)
        losses = run_steps(e, rank, world, range(3, 6), draw=False)
        return _lists(live), losses, _lists(full_params(e, model))
    try:
        e.load_checkpoint(d)
        err = None
    except CheckpointError as ex:
        err = str(ex)
    e.load_checkpoint(d, reshard=True)
    losses = run_steps(e, rank, world, range(3, 6), draw=False)
    return err, losses, _lists(full_params(e, model))


def _lists(d):  # plain data across the process boundary
    return {n: t.tolist() for n, t in d.items()}


def test_consolidate_and_reshard_2_to_3(spawn, tmp_path):
    d = str(tmp_path / "ck")
    res2 = spawn(_save_then_reshard, 2, args=(d, "save"))
    live = res2[0][0]
    # consolidation: a plain model loads the file and equals the live (gathered) model exactly
    run_cmd(f"python -m zero_from_scratch.engine.zero_to_fp32 {d} {tmp_path}/full.pt")
    plain = mlp(5)
    plain.load_state_dict(torch.load(tmp_path / "full.pt"))
    for n, p in plain.named_parameters():
        assert torch.equal(p.detach(), torch.tensor(live[n]))
    res3 = spawn(_save_then_reshard, 3, args=(d, "load"))
    err = res3[0][0]
    assert "N=2" in err and "N=3" in err and "reshard=True" in err
    # the global-batch loss of each step is the mean of the per-rank means (equal per-rank sizes)
    mean2 = torch.tensor([r[1] for r in res2]).mean(0)
    mean3 = torch.tensor([r[1] for r in res3]).mean(0)
    # after resharding only summation order differs (2 vs 3 partial sums): fp32 rounding
    torch.testing.assert_close(mean3, mean2, rtol=1e-5, atol=1e-6)
    for n, t in res2[0][2].items():
        torch.testing.assert_close(torch.tensor(res3[0][2][n]), torch.tensor(t), rtol=1e-4, atol=1e-5)


def _save_steps(rank, world, d, tag, steps, kill=None):
    """Train `steps` steps from the same init and data, then save to d/tag; `kill` = RINGZERO_CKPT_KILL_AT
    ("phase" or "phase:rank"), or "rename:R" to die on rank R between a temp file and its rename."""
    import zero_from_scratch.engine.atomic as atomic
    from zero_from_scratch.engine.checkpoint import KILL_ENV
    e, *_ = zero_from_scratch.initialize(model=mlp(0), config=cfg(1, world))
    run_steps(e, rank, world, range(steps))
    if kill and kill.startswith("rename:"):
        if rank == int(kill.split(":")[1]):
            atomic.replace = lambda tmp, path: os._exit(3)
    elif kill:
        os.environ[KILL_ENV] = kill
    e.save_checkpoint(d, tag=tag)
    return sorted(os.listdir(d))


KILLS = ["validated", "rename:1", "shard:1", "shard", "manifest", "tag", "latest", "cleanup"]


def test_kill_at_every_phase_leaves_a_loadable_checkpoint(spawn, tmp_path):
    """Re-save the same tag (the hard case: the old save must survive) and die at each phase of
    the save; the checkpoint `latest` names is then the old save or the new one, whole."""
    import shutil
    from zero_from_scratch.engine.checkpoint import PHASES
    from zero_from_scratch.engine.checkpoint_read import consolidate
    assert {k.split(":")[0] for k in KILLS} >= set(PHASES)
    ref = {}
    for steps in (2, 3):                                 # the states the old and the new save hold
        spawn(_save_steps, 2, args=(str(tmp_path / f"ref{steps}"), "t", steps))
        ref[steps] = consolidate(str(tmp_path / f"ref{steps}"))
    assert not torch.equal(ref[2]["0.weight"], ref[3]["0.weight"])
    for kill in KILLS:
        d = tmp_path / kill.replace(":", "_")
        shutil.copytree(tmp_path / "ref2", d, symlinks=True)   # the good old save of tag "t"
        res = spawn(_save_steps, 2, args=(str(d), "t", 3, kill), allow_fail=True, grace=0.5)
        assert any(status != "ok" for status, _ in res), (kill, res)
        new = kill.split(":")[0] in ("tag", "latest", "cleanup")
        assert open(d / "latest").read() == "t"
        got = consolidate(str(d))                        # manifest, sizes and save ids all checked
        for n, t in ref[3 if new else 2].items():
            assert torch.equal(got[n], t), (kill, n)
    # the engine resumes from what a kill left, and its next save cleans up: one folder per tag
    steps, listing = spawn(_load_then_save, 2, args=(str(tmp_path / "manifest"),))[0]
    assert steps == 2 and len([n for n in listing if n.startswith("t.")]) == 1, listing


def _load_then_save(rank, world, d):
    e, *_ = zero_from_scratch.initialize(model=mlp(3), config=cfg(1, world))
    e.load_checkpoint(d)
    steps = e.global_steps
    e.save_checkpoint(d, tag="t")
    return steps, sorted(os.listdir(d))


def _bad_args(rank, world, d):
    e, *_ = zero_from_scratch.initialize(model=mlp(0), config=cfg(1, world))
    run_steps(e, rank, world, range(1))
    out = []
    for client, tag in (({"epoch": 1, "when": object()} if rank == 1 else {"epoch": 1}, "ok"),   # non-JSON on rank 1
                        ({}, "a/b" if rank == 0 else "ok"),                                       # bad tag on rank 0
                        ({}, f"t{rank}")):                                                        # tags differ
        try:
            e.save_checkpoint(d, tag=tag, client_state=client)
            out.append("saved")
        except CheckpointError as ex:                   # raised on every rank, so they stay in step
            out.append(str(ex))
    return out


def test_bad_save_arguments_fail_on_every_rank_before_writing(spawn, tmp_path):
    expect = ["rank 1: client_state is not a JSON-serialisable dict", "rank 0: tag is not a usable folder name",
              "different tags"]
    for msgs in spawn(_bad_args, 2, args=(str(tmp_path),)):
        for m, e in zip(msgs, expect, strict=True):
            assert e in m and "nothing written" in m, msgs
    assert os.listdir(tmp_path) == []


def _bad(rank, world, d, what):
    model = mlp(0) if what != "model" else nn.Sequential(nn.Linear(5, 9), nn.Linear(9, 2))
    e, *_ = zero_from_scratch.initialize(model=model, config=cfg(1, world))
    try:
        e.load_checkpoint(d)
    except CheckpointError as ex:
        return str(ex)
    return "loaded"


def _save_only(rank, world, d):
    e, *_ = zero_from_scratch.initialize(model=mlp(0), config=cfg(1, world))
    run_steps(e, rank, world, range(1))
    e.save_checkpoint(d)


def test_bad_checkpoints_are_clear_errors(spawn, tmp_path):
    d = str(tmp_path)
    spawn(_save_only, 2, args=(d,))
    msg = spawn(_bad, 2, args=(d, "model"))[0]
    assert "different model" in msg and "0.weight" in msg
    shard = os.path.join(d, "global_step1", "zero_rank001.pt")
    data = open(shard, "rb").read()
    open(shard, "wb").write(data[: len(data) // 2])
    msg = spawn(_bad, 2, args=(d, "truncated"))[0]
    assert "zero_rank001.pt" in msg and "truncated" in msg
    os.remove(shard)
    msg = spawn(_bad, 2, args=(d, "missing"))[0]
    assert "zero_rank001.pt" in msg and "missing" in msg
