"""ZeRO memory table for a T5-shaped model: configuration → peak memory per rank, time per step.

    python benchmarks/zero_memory_table.py              # T5 d_model 384, 6+6 layers, Ψ ≈ 28 M, 2 ranks, ~10 min loaded
    python benchmarks/zero_memory_table.py --quick      # d_model 128, 2+2 layers: proves it runs (~40 s)
    python benchmarks/zero_memory_table.py --rows 6 7   # both offloads under zero.Init, without and with activation checkpointing (~3 min)

Rows: ZeRO-1; ZeRO-3; ZeRO-3 + offload_optimizer; ZeRO-3 + offload_param + offload_optimizer
(ZeRO-Infinity); the last two again with the model built under zero.Init (with offload_param
"nvme", Init writes each shard to a file as it is built); and that last row with activation
checkpointing (HF's gradient_checkpointing_enable, each T5Block recomputed in its backward: how
DeepSpeed users run Infinity), beside it, never instead of it. Offload goes to files (device "nvme",
max_in_cpu 0): on this CPU-only machine "cpu" offload keeps the states in the same memory and
saves nothing. Each row runs in a fresh pair of ranks (primitives spawn, gloo, fp32, AdamW,
micro-batch 2 × 32 tokens), with glibc's allocator left at its defaults (the engine's own
process-wide setting, engine/allocator.py, announces itself); each rank runs a tiny T5 once
(torch's kernels and thread pools are then loaded) and reports VmHWM above its RSS just before
the model is built: "peak" covers construction + initialize + training, "train" the training
steps alone (peak reset after initialize). "predicted" is zero_from_scratch.engine.report's:
working_set (model states + working set) under zero.Init; for a model built whole
whole_model_peak (the constructor's bytes, counted on the meta device, or initialize's, or
training's) and, for ZeRO-1, stage1_peak. Model-state formulas per rank (fp32, K = 8):
ZeRO-1 4Ψ + 4Ψ + 8Ψ/N, ZeRO-3 16Ψ/N; offload_optimizer "nvme" removes 8Ψ/N and, at stage 3,
the gradient shards (4Ψ/N: they go to files beside the states); offload_param 4Ψ/N more. The
gathered units stay, bounded by LIVE (stage3_max_live_parameters 4e6, no reuse distance). The
model is T5ForConditionalGeneration from a T5Config (offline, random init, seed 0); time per step
is the median after the first step, on 2 shared cores: read it as the trade, not a claim.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import tempfile
import time

import torch
import transformers
from rich.table import Table

import zero_from_scratch
from zero_from_scratch.engine import report
from primitives.launch import spawn
from primitives.log import console

MIB = 2 ** 20
# ZeRO-3's working set: DeepSpeed's defaults (1e9) keep every unit gathered from its forward to its
# backward, i.e. the whole model in memory at the turn of the pass; these bound it to ~2 layers
LIVE = {"stage3_max_reuse_distance": 0, "stage3_max_live_parameters": 4_000_000, "stage3_param_persistence_threshold": 10_000}
ROWS = [("ZeRO-1", 1, False, False, False), ("ZeRO-3", 3, False, False, False),
        ("ZeRO-3 + offload_optimizer", 3, True, False, False),
        ("ZeRO-3 + offload_param + offload_optimizer", 3, True, True, False),
        ("ZeRO-3 + offload_optimizer, zero.Init", 3, True, False, True),
        ("ZeRO-3 + offload_param + offload_optimizer, zero.Init", 3, True, True, True),
        ("ZeRO-3 + offload_param + offload_optimizer, zero.Init, activation checkpointing", 3, True, True, True, True)]


def _vm(key: str) -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith(key))


def _reset_peak() -> None:
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")                                       # VmHWM := VmRSS


def _t5(size: dict):
    return transformers.T5ForConditionalGeneration(transformers.T5Config(
        vocab_size=size["vocab"], d_model=size["d"], d_ff=4 * size["d"], d_kv=size["d"] // 4, num_heads=4,
        num_layers=size["layers"], num_decoder_layers=size["layers"], dropout_rate=0.0, decoder_start_token_id=0))


def _run(rank, world, stage, ooff, poff, init, size, path, steps, ckpt=False):
    z = {"stage": stage, **(LIVE if stage == 3 else {})}
    if ooff:
        z["offload_optimizer"] = {"device": "nvme", "nvme_path": path}
    if poff:
        z["offload_param"] = {"device": "nvme", "nvme_path": path, "max_in_cpu": 0}
    cfg = {"train_micro_batch_size_per_gpu": 2, "steps_per_print": 10 ** 9, "zero_optimization": z,
           "optimizer": {"type": "AdamW", "params": {"lr": 1e-4}}}
    warm = _t5({"vocab": 100, "d": 16, "layers": 1})       # load torch's kernels before the baseline
    ids = torch.randint(1, 100, (2, 32))
    warm(input_ids=ids, labels=ids).loss.backward()
    del warm
    base, shm = _vm("VmRSS:"), _vm("RssShmem:")
    _reset_peak()                                          # VmHWM := VmRSS, before the model exists
    torch.manual_seed(0)
    # under zero.Init the config's offload_param "nvme" sends each shard to a file as it is built
    # (init_swap.py); initialize then moves them, unit by unit, to offload_param's own files
    with zero_from_scratch.zero.Init(config_dict_or_path=cfg, enabled=init):
        model = _t5(size)
    if ckpt:                                               # each T5Block's forward again in its backward
        model.config.use_cache = False
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    engine, *_ = zero_from_scratch.initialize(model=model, config=cfg)
    built = _vm("VmHWM:") - base
    act = report.transformer_activations(model.config, 2, 32, 4, recompute=ckpt)   # micro-batch 2 × 32, fp32
    if stage == 3:
        ws = report.working_set(engine.config, engine.layout, world, act)
        pred = ws["total"] if init else report.whole_model_peak(ws, report.built_bytes(lambda: _t5(size)),
                                                                4 * engine.layout.numel)
    else:
        pred = report.stage1_peak(engine.config, engine.layout, world, report.built_bytes(lambda: _t5(size)))
    _reset_peak()
    g, times, losses, last = torch.Generator().manual_seed(rank), [], [], {}
    for i in range(steps):
        t = time.perf_counter()
        mark = (lambda k, key="VmRSS:": last.__setitem__(k, _vm(key) - base)) if i == steps - 1 else (lambda *a: None)
        mark("earlier steps", "VmHWM:")
        mark("before forward")
        ids = torch.randint(1, size["vocab"], (2, 32), generator=g)
        loss = engine(input_ids=ids, labels=torch.roll(ids, 1, 1)).loss
        mark("after forward")
        _reset_peak() if i == steps - 1 else None
        engine.backward(loss)
        mark("backward peak", "VmHWM:")
        _reset_peak() if i == steps - 1 else None
        engine.step()
        mark("step peak", "VmHWM:")
        times.append(time.perf_counter() - t)
        losses.append(loss.item())
    last["shm pages"] = _vm("RssShmem:") - shm            # the transport's segment, touched since
    last["gathered units at most"] = engine.stage.units_pool.peak if stage == 3 else 0
    train = max(last["earlier steps"], last["backward peak"], last["step peak"])
    return {"peak": max(built, train), "built": built, "train": train, "last": last,
            "predicted": pred,
            "step_s": statistics.median(times[1:] or times),
            "losses": losses, "psi": engine.layout.numel}


def measure(quick: bool, steps: int, only: list[int] | None = None) -> dict:
    """Every row (or the rows numbered in `only`) in its own fresh pair of ranks:
    {"size", "psi", "rows": {name: [per-rank dicts]}}."""
    size = {"vocab": 4000, "d": 128, "layers": 2} if quick else {"vocab": 8000, "d": 384, "layers": 6}
    rows = {}
    with tempfile.TemporaryDirectory(prefix="zero-memory-table-") as d:
        for i, (name, stage, ooff, poff, init, *ckpt) in enumerate(ROWS):
            if only and i + 1 not in only:
                continue
            rows[name] = spawn(_run, 2, timeout=1200.0, args=(stage, ooff, poff, init, size,
                                                              os.path.join(d, str(i)), steps, bool(ckpt and ckpt[0])))
    return {"size": size, "psi": next(iter(rows.values()))[0]["psi"], "rows": rows,
            "machine": f"{platform.machine()}, {os.cpu_count()} shared cores, python {platform.python_version()}, "
                       f"torch {torch.__version__}, transformers {transformers.__version__}"}


def states(name: str, psi: int) -> float:
    """Model-state bytes per rank the configuration leaves in memory (fp32, N = 2, K = 8)."""
    if name == "ZeRO-1":
        return 8 * psi + 8 * psi / 2
    return 16 * psi / 2 - 12 * psi / 2 * ("offload_optimizer" in name) - 4 * psi / 2 * ("offload_param" in name)


def show(data: dict) -> None:
    size, psi, res = data["size"], data["psi"], data["rows"]
    t = Table(title=f"T5ForConditionalGeneration (d_model {size['d']}, {size['layers']}+{size['layers']} layers, "
                    f"vocab {size['vocab']}), Ψ = {psi:,} (4Ψ = {4 * psi / MIB:,.0f} MiB), N = 2, fp32, "
                    f"micro-batch 2 × 32, ZeRO-3 live ≤ 4e6: peak RSS per rank above the pre-model RSS (MiB)")
    z3 = res["ZeRO-3"][0]["step_s"] if "ZeRO-3" in res else float("nan")
    for c in ("configuration", "predicted", "peak r0", "peak r1", "peak / predicted", "train r0", "train r1",
              "peak / 4Ψ", "step s", "step / ZeRO-3", "model states (MiB)"):
        t.add_column(c, justify="right" if c != "configuration" else "left")
    for name, r in res.items():
        peak, pred = max(x["peak"] for x in r), max(x["predicted"] for x in r)
        t.add_row(name, f"{pred / MIB:,.0f}", *[f"{x['peak'] / MIB:,.0f}" for x in r], f"{peak / pred:.2f}",
                  *[f"{x['train'] / MIB:,.0f}" for x in r], f"{peak / (4 * psi):.2f}", f"{r[0]['step_s']:.2f}",
                  f"{r[0]['step_s'] / z3:.2f}", f"{states(name, psi) / MIB:,.0f}")
    console.print(t)
    w = Table(title="where the peak is: rank 0's last step, MiB above the pre-model RSS (backward and step peaks "
                    "measured from the RSS their phase starts at)")
    keys = list(next(iter(res.values()))[0]["last"])
    w.add_column("configuration")
    for k in keys:
        w.add_column(k, justify="right")
    for name, r in res.items():
        w.add_row(name, *[f"{r[0]['last'][k] / MIB:,.1f}" for k in keys])
    console.print(w)
    ref = res["ZeRO-3"][0]["losses"] if "ZeRO-3" in res else None
    same = all(res[n][0]["losses"] == ref for n in res if n != "ZeRO-1" and "checkpointing" not in n) if ref else "n/a"
    ck = [max(abs(a - b) / abs(b) for a, b in zip(r[0]["losses"], ref)) for n, r in res.items() if "checkpointing" in n]
    console.print(f"ZeRO-3 rows' losses bit-identical to ZeRO-3's: {same}"
                  + (f" (with activation checkpointing: not bit-identical, within {ck[0]:.1e} relative)" if ck and ref else "")
                  + f"; allocator defaults; machine: {data['machine']}, load average {os.getloadavg()[0]:.1f}")


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--rows", type=int, nargs="*", default=None, help="only these rows, numbered from 1 (default: all)")
    ap.add_argument("--json", default=None, help="also write the measurements here (figures.ch14_zero_infinity draws it)")
    a = ap.parse_args(argv)
    data = measure(a.quick, a.steps, a.rows)
    if a.json:
        with open(a.json, "w") as f:
            json.dump(data, f)
    show(data)


if __name__ == "__main__":
    main()
