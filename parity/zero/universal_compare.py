"""Resume at another world size: our `reshard=True` next to DeepSpeed's universal checkpoints.

    python -m parity.zero.universal_compare          # ~1-2 min on 2 cores, CPU/gloo

Both engines train the same tiny model with ZeRO-2 at N = 2 for 6 steps (global batch 12),
saving a checkpoint after step 3. Then, at N = 3 with the same global batch:
  * DeepSpeed: `python -m deepspeed.checkpoint.ds_to_universal` converts its step-3 checkpoint
    (`--inject_missing_state`: a plain model's client state lacks the `universal_checkpoint_info`
    that Megatron-DeepSpeed adds), and a fresh engine with `"checkpoint": {"load_universal": true}`
    loads it;
  * ours: a fresh engine calls `load_checkpoint(dir, reshard=True)`, which re-cuts every shard
    (parameters, fp32 master, Adam moments) with the N = 3 layout from the manifest's offsets;
  * ours, DeepSpeed's way: the runner's served converter (zero_from_scratch/as_deepspeed/ds_to_universal.py,
    what `deepspeed.checkpoint.ds_to_universal.main` is under the runner) converts our step-3 folder, and a
    fresh engine with `"checkpoint": {"load_universal": true}` loads it (engine/checkpoint_universal.py).
Each resumed run then trains steps 4-6; a control row resumes our checkpoint without its optimizer
state, to show the loss column would see a lost Adam state. The table compares the parameters right after loading
with the ones that were saved, and the resumed losses with the uninterrupted N = 2 run's: if
both engines restore optimizer state exactly, the losses agree to fp32 summation-order rounding.
Cost: two 2-rank and three 3-rank spawns of a 13-37-3 MLP, two ds_to_universal conversions (~1-2 min).
"""
from __future__ import annotations

import argparse
import contextlib
import io
import os
import subprocess
import sys
import tempfile

import torch
import torch.distributed as dist
from rich.table import Table

from primitives.launch import spawn
from primitives.log import console
from parity.zero.sides import make_engine
from parity.zero.ds_parity import make_config
from zero_from_scratch.as_deepspeed.ds_to_universal import main as ds_to_universal
from zero_from_scratch.engine.models import TinyMLP, param_groups

GLOBAL_BATCH, SAVE_AT, STEPS = 12, 3, 6


def _batch(step: int, rank: int, world: int):
    g = torch.Generator().manual_seed(1000 + step)
    x = torch.randn(GLOBAL_BATCH, 13, generator=g)
    y = torch.randint(0, 3, (GLOBAL_BATCH,), generator=g)
    per = GLOBAL_BATCH // world
    return x[rank * per:(rank + 1) * per], y[rank * per:(rank + 1) * per]


def _engine(side: str, world: int, universal: bool = False):
    torch.manual_seed(0)
    model = TinyMLP()
    cfg = make_config(2, micro_bs=GLOBAL_BATCH // world, gas=1)
    if universal:
        cfg["checkpoint"] = {"load_universal": True}
    return make_engine(side, model, param_groups(model, 0.1), cfg, "primitives")


def _train(engine, steps, rank, world) -> list[float]:
    losses = []
    for step in steps:
        x, y = _batch(step, rank, world)
        loss = engine(x, y).loss
        engine.backward(loss)
        engine.step()
        t = loss.detach().clone()
        dist.all_reduce(t)
        losses.append(t.item() / world)
    return losses


def _params(engine) -> dict:
    return {k: v.detach().clone() for k, v in engine.module.state_dict().items()}


def _phase_save(rank, world, side, ckpt):
    engine = _engine(side, world)
    first = _train(engine, range(1, SAVE_AT + 1), rank, world)
    engine.save_checkpoint(ckpt, tag=f"global_step{SAVE_AT}")
    saved = _params(engine)
    rest = _train(engine, range(SAVE_AT + 1, STEPS + 1), rank, world)
    return first + rest, saved


def _phase_resume(rank, world, side, ckpt):
    if side == "weights-only":        # the control: same weights, fresh Adam moments
        engine = _engine("ours", world)
        engine.load_checkpoint(ckpt, tag=f"global_step{SAVE_AT}", load_optimizer_states=False,
                               load_lr_scheduler_states=False, reshard=True)
    elif side in ("deepspeed", "ours-universal"):
        engine = _engine(side.split("-")[0], world, universal=True)
        engine.load_checkpoint(ckpt)                      # reads latest_universal
    else:
        engine = _engine(side, world)
        engine.load_checkpoint(ckpt, tag=f"global_step{SAVE_AT}", reshard=True)
    loaded = _params(engine)
    return _train(engine, range(SAVE_AT + 1, STEPS + 1), rank, world), loaded


def convert_ours(ckpt: str) -> None:
    """The runner's converter, in this process (its argparse flags as a namespace, as DeepSpeed's tests call it)."""
    with contextlib.redirect_stdout(io.StringIO()):
        ds_to_universal(argparse.Namespace(input_folder=os.path.join(ckpt, f"global_step{SAVE_AT}"),
                                           output_folder=os.path.join(ckpt, f"global_step{SAVE_AT}_universal"),
                                           inject_missing_state=True))


def convert(ckpt: str) -> None:
    src = os.path.join(ckpt, f"global_step{SAVE_AT}")
    dst = os.path.join(ckpt, f"global_step{SAVE_AT}_universal")
    subprocess.run([sys.executable, "-m", "deepspeed.checkpoint.ds_to_universal", "--input_folder", src,
                    "--output_folder", dst, "--inject_missing_state", "--num_extract_workers", "1",
                    "--num_merge_workers", "1"], check=True, capture_output=True, text=True)
    with open(os.path.join(ckpt, "latest_universal"), "w") as f:
        f.write(f"global_step{SAVE_AT}_universal")


def run(new_world: int = 3) -> dict:
    out = {}
    with tempfile.TemporaryDirectory(prefix="ringzero-universal-") as tmp:
        for side in ("ours", "deepspeed"):
            ckpt = os.path.join(tmp, side)
            (ref_losses, saved), _ = spawn(_phase_save, 2, args=(side, ckpt), timeout=300)
            (convert if side == "deepspeed" else convert_ours)(ckpt)
            sides = (side, "ours-universal", "weights-only") if side == "ours" else (side,)
            for s in sides:
                (losses, loaded), *_ = spawn(_phase_resume, new_world, args=(s, ckpt), timeout=300)
                out[s] = dict(
                    param_diff=max((saved[k] - loaded[k]).abs().max().item() for k in saved),
                    loss_diff=max(abs(a - b) for a, b in zip(losses, ref_losses[SAVE_AT:])),
                    ref=ref_losses[SAVE_AT:], resumed=losses, saved=saved)
    out["between"] = max((out["ours"]["saved"][k] - out["deepspeed"]["saved"][k]).abs().max().item()
                         for k in out["ours"]["saved"])
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--world-size", type=int, default=3, help="the world size to resume at (saved at 2)")
    a = ap.parse_args(argv)
    if a.world_size < 1 or GLOBAL_BATCH % a.world_size:
        ap.error(f"--world-size must divide the global batch {GLOBAL_BATCH}, got {a.world_size}")
    res = run(a.world_size)
    t = Table(title=f"ZeRO-2 saved at N=2 after step {SAVE_AT}, resumed at N={a.world_size}")
    for c in ("engine", "how", "max |param − saved| after load", "max |loss − uninterrupted N=2|, steps 4–6"):
        t.add_column(c, justify="right" if c.startswith("max") else "left")
    t.add_row("ringzero", "load_checkpoint(reshard=True)", f"{res['ours']['param_diff']:.2e}", f"{res['ours']['loss_diff']:.2e}")
    t.add_row("DeepSpeed", "ds_to_universal + load_universal", f"{res['deepspeed']['param_diff']:.2e}",
              f"{res['deepspeed']['loss_diff']:.2e}")
    t.add_row("ringzero, the runner's way", "served ds_to_universal + load_universal",
              f"{res['ours-universal']['param_diff']:.2e}", f"{res['ours-universal']['loss_diff']:.2e}")
    t.add_row("ringzero, control", "weights only (fresh Adam moments, LR restarts)",
              f"{res['weights-only']['param_diff']:.2e}", f"{res['weights-only']['loss_diff']:.2e}")
    console.print(t)
    console.print(f"the two engines' parameters at the save: max |ours − DeepSpeed| = {res['between']:.2e}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
