"""zero.Init vs building the whole model: peak memory per rank while constructing and adopting it.

    python benchmarks/zero_init_memory.py                     # 16 × Linear(2048, 2048), Ψ ≈ 67 M, 2 ranks, ~1 min
    python benchmarks/zero_init_memory.py --layers 8 --dim 1024 --world 2     # ~10 s (2 idle cores)
    python benchmarks/zero_init_memory.py --infinity    # zero.Init + ZeRO-Infinity, Ψ = 67 M, whole run, minutes

The rows run one after the other in the same ranks (primitives spawn, gloo), glibc's allocator at
its defaults (zero.Init and the engine make their one announced setting, engine/allocator.py, so
a freed tensor of ≥ 1 MiB leaves RSS at once; rows without Init run after it); each rank resets its peak
(/proc/self/clear_refs "5") just before each model is built and reports VmHWM minus the RSS at that
moment. Expected, fp32, model bytes M = 4Ψ, largest module L = 4·dim²:
  plain                      M                  (every rank builds the whole model)
  Init                       M/N + L            (a module is whole only until its __init__ returns)
  + initialize(ZeRO-3)       the engine's state, 16Ψ/N = 4M/N (parameter and gradient shards, Adam
                             m and v), + L while a unit is built; Init's shards are freed unit by unit
Measured here (8 × Linear(1024, 1024), N = 2): plain 36.5 MiB, Init 25.0 (M/N + L = 20), plain +
initialize 74.0, Init + initialize 64.9; N = 4: plain 36.5, Init 17.2 (12), plain + initialize 78.0
(initialize's rank-0 broadcast concatenates the whole model once more), Init + initialize 32.8 (36).
At N = 2 with Adam on the rank the engine's own 4M/N is 2M, so what Init saves (M·(N-1)/N, at
construction) shows less after initialize; it decides whether the model can be built at all when M
exceeds one rank's memory, and stays the whole saving once the optimizer state is offloaded or N
is large.
--infinity: the whole run of ZeRO-Infinity (zero.Init with offload_param + offload_optimizer
"nvme", initialize, 2 steps), 256 × Linear(512, 512): Ψ = 67 M, 4Ψ = 256 MiB, model states
16Ψ/N = 512 MiB per rank, all in files. What stays is the working set, a few units of 1 MiB:
the module being built, one unit assembled at initialize, ≤ 2 units gathered (the live bound),
≤ buffer_count (5) parameter shards and 4 gradient shards in buffers, the optimizer's staging;
the peak must stay ≤ 0.25 × 4Ψ (tests/test_param_offload.py asserts it, and the losses of ZeRO-3
without offload, which the same processes train afterwards).
"""
from __future__ import annotations

import argparse
import os
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402
import torch.nn as nn  # noqa: E402
from rich.table import Table  # noqa: E402

import zero_from_scratch  # noqa: E402
from primitives.launch import spawn  # noqa: E402
from primitives.log import console  # noqa: E402
from zero_from_scratch.engine.zero_init import Init  # noqa: E402

MIB = 2 ** 20
CFG = {"train_micro_batch_size_per_gpu": 1, "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
       "zero_optimization": {"stage": 3}}


def _rss(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"no {field} in /proc/self/status")


def peak(rank, world, init: bool, engine: bool, layers: int, dim: int) -> int:
    """Bytes this rank's peak RSS rose while building (and with engine, adopting) the model."""
    torch.manual_seed(0)
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    base = _rss("VmRSS")
    with Init(dtype=torch.float32, enabled=init):
        model = nn.Sequential(*[nn.Linear(dim, dim, bias=False) for _ in range(layers)])
    if engine:
        zero_from_scratch.initialize(model=model, config=CFG)
    return _rss("VmHWM") - base


ROWS = [(False, False), (True, False), (False, True), (True, True)]


def peaks(rank, world, layers: int, dim: int) -> list:
    """Every row in one process, one after the other: the model and engine of a row are gone
    (their frees reach the OS) before the next row resets the peak."""
    return [peak(rank, world, init, eng, layers, dim) for init, eng in ROWS]


def measure(world: int, layers: int, dim: int) -> dict:
    per_rank = spawn(peaks, world, args=(layers, dim), timeout=300)
    return {row: max(r[i] for r in per_rank) for i, row in enumerate(ROWS)}


def _infinity_cfg(path, dim: int) -> dict:
    z = {"stage": 3, "stage3_max_reuse_distance": 0, "stage3_max_live_parameters": 2 * (dim * dim + dim)}
    if path:
        z["offload_param"] = {"device": "nvme", "nvme_path": path, "max_in_cpu": 0}
        z["offload_optimizer"] = {"device": "nvme", "nvme_path": path}
    return {"train_micro_batch_size_per_gpu": 4, "steps_per_print": 10 ** 9, "optimizer": {"type": "AdamW"},
            "zero_optimization": z}


def _train(engine, rank: int, dim: int, steps: int) -> list:
    g, losses = torch.Generator().manual_seed(rank), []
    for _ in range(steps):
        loss = engine(torch.randn(4, dim, generator=g)).pow(2).mean()
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    return losses


def infinity(rank, world, path: str, dim: int = 512, layers: int = 256, steps: int = 2) -> dict:
    """ZeRO-Infinity's whole run: `layers` × Linear(dim, dim) built under zero.Init with offload_param
    and offload_optimizer "nvme" (shards to files as they are built), initialize, `steps` steps.
    The peak RSS above the RSS before the model existed, cumulative by phase (allocator defaults);
    then, in the same process, the same
    model built plainly and trained by ZeRO-3 without offload: its losses, to compare."""
    torch.ones(8, 8) @ torch.ones(8, 8)                    # torch's first-use allocations before the baseline
    base = _rss("VmRSS")
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    torch.manual_seed(0)
    with Init(config_dict_or_path=_infinity_cfg(path, dim)):
        model = nn.Sequential(*[nn.Linear(dim, dim) for _ in range(layers)])
    out = {"build": _rss("VmHWM") - base}
    engine, *_ = zero_from_scratch.initialize(model=model, config=_infinity_cfg(path, dim))
    out["initialize"] = _rss("VmHWM") - base
    out["losses"] = _train(engine, rank, dim, steps)
    out["train"] = _rss("VmHWM") - base
    out["psi"], out["in_files"] = engine.layout.numel, engine.stage.poff.report()["bytes_in_files"]
    del engine, model
    torch.manual_seed(0)
    ref, *_ = zero_from_scratch.initialize(model=nn.Sequential(*[nn.Linear(dim, dim) for _ in range(layers)]),
                                           config=_infinity_cfg(None, dim))
    out["ref_losses"] = _train(ref, rank, dim, steps)
    return out


def show_infinity(world: int, dim: int, layers: int) -> None:
    with tempfile.TemporaryDirectory(prefix="zero-infinity-") as d:
        res = spawn(infinity, world, args=(d, dim, layers), timeout=1800)
    psi = res[0]["psi"]
    t = Table(title=f"zero.Init + ZeRO-Infinity (nvme), {layers} × Linear({dim}, {dim}), Ψ = {psi:,} "
                    f"(4Ψ = {4 * psi / MIB:.0f} MiB), N = {world}: peak RSS per rank above the pre-model RSS")
    for c in ("through", *[f"rank {r} MiB" for r in range(world)], "max / 4Ψ"):
        t.add_column(c, justify="left" if c == "through" else "right")
    for k in ("build", "initialize", "train"):
        t.add_row(k, *[f"{r[k] / MIB:.1f}" for r in res], f"{max(r[k] for r in res) / (4 * psi):.3f}")
    console.print(t)
    console.print(f"budget 0.25 × 4Ψ = {psi / MIB:.1f} MiB; losses equal to ZeRO-3 without offload: "
                  f"{all(r['losses'] == r['ref_losses'] for r in res)}; parameter shards in files per rank: "
                  f"{res[0]['in_files'] / MIB:.1f} MiB; torch {torch.__version__}, {os.cpu_count()} shared cores")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=None, help="16 (256 with --infinity)")
    ap.add_argument("--dim", type=int, default=None, help="2048 (512 with --infinity)")
    ap.add_argument("--world", type=int, default=2)
    ap.add_argument("--infinity", action="store_true", help="the whole run under zero.Init + ZeRO-Infinity "
                    "(defaults: 256 × Linear(512, 512))")
    a = ap.parse_args()
    if a.infinity:
        return show_infinity(a.world, a.dim or 512, a.layers or 256)
    a.dim, a.layers = a.dim or 2048, a.layers or 16
    m, big = 4 * a.layers * a.dim ** 2, 4 * a.dim ** 2
    res = measure(a.world, a.layers, a.dim)
    t = Table(title=f"peak RSS per rank above the baseline, {a.layers} × Linear({a.dim}, {a.dim}), N = {a.world}")
    for c in ("build", "peak MiB (max over ranks)", "expected MiB"):
        t.add_column(c, justify="right" if c != "build" else "left")
    for (init, eng), v in res.items():
        exp = 4 * m / a.world + big if eng else m / a.world + big if init else m
        t.add_row(("Init" if init else "plain") + (" + initialize(ZeRO-3)" if eng else ""),
                  f"{v / MIB:.1f}", f"{exp / MIB:.1f}")
    console.print(t)


if __name__ == "__main__":
    main()
