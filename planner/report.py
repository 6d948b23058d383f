"""The planner's outputs: a ranked rich table with every term, the JSON of every layout, and one
stacked bar per layout (time terms, and memory terms beside them).

    python -m planner llama-7b --gpus 64 --hardware a100 --plot plan.png --json plan.json
"""
from __future__ import annotations

import json
import os
from dataclasses import asdict

from rich.table import Table

from zero_from_scratch.engine.atomic import atomic_write

TIME_TERMS = ("matmul", "elementwise", "tp comm", "pp comm", "bubble", "dp comm", "optimizer")
MEM_TERMS = ("params", "grads", "optimizer", "activations", "working", "reserved")


def _s(x: float) -> str:
    return f"{x:,.4g}" if x >= 1e-4 else ("0" if x == 0 else f"{x:.1e}")


def table(preds, model, hw, gpus: int, seq: int, batch: int, top: int = 15) -> Table:
    n = model.params()
    size = f"{n / 1e9:,.2f} B" if n >= 1e9 else f"{n / 1e6:,.2f} M"
    t = Table(title=f"{model.name} ({size} params) on {gpus} × {hw.name}, "
                    f"seq {seq}, global batch {batch}: best {min(top, len(preds))} of {len(preds)} layouts that fit")
    t.add_column("#", justify="right")
    t.add_column("layout")
    t.add_column("step s", justify="right")
    for k in TIME_TERMS:
        t.add_column(k, justify="right")
    t.add_column("GiB/GPU", justify="right")
    t.add_column("states", justify="right")
    t.add_column("activ.", justify="right")
    t.add_column("TFLOP/s", justify="right")
    t.add_column("MFU", justify="right")
    for i, p in enumerate(preds[:top], 1):
        m = p.memory
        t.add_row(str(i), p.layout.label(), _s(p.time["total"]), *[_s(p.time[k]) for k in TIME_TERMS],
                  f"{m['total'] / 2**30:,.1f}", f"{(m['params'] + m['grads'] + m['optimizer']) / 2**30:,.1f}",
                  f"{m['activations'] / 2**30:,.1f}", f"{p.tflops_per_gpu:,.1f}" if p.tflops_per_gpu >= 1 else f"{p.tflops_per_gpu:.3f}", f"{p.mfu:.1%}")
    return t


def write_json(path: str, preds, model, hw, gpus: int, seq: int, batch: int) -> None:
    doc = {"model": asdict(model), "params": model.params(), "hardware": {k: (asdict(v) if hasattr(v, "alpha") else v)
                                                                        for k, v in asdict(hw).items()},
           "gpus": gpus, "seq": seq, "global_batch": batch, "units": {"memory_bytes": "bytes", "time_s": "seconds"},
           "layouts": [p.as_dict() for p in preds]}
    atomic_write(path, lambda f: f.write(json.dumps(doc, indent=1).encode()))    # never half-written


def picture(path: str, preds, title: str, top: int = 12) -> str:
    """One stacked bar per layout: its step-time terms (left) and memory terms (right)."""
    import matplotlib   # optional dependency, loaded only when a picture is asked for
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt   # after use("Agg"): files only, no display
    rows = preds[:top]
    fig, (ax, bx) = plt.subplots(1, 2, figsize=(13, 0.45 * len(rows) + 2), sharey=True)
    labels = [p.layout.label() for p in rows]
    for axis, terms, get, unit in ((ax, TIME_TERMS, lambda p, k: p.time[k] * 1e3, "step time (ms)"),
                                   (bx, MEM_TERMS, lambda p, k: p.memory[k] / 2**30, "memory per GPU (GiB)")):
        left = [0.0] * len(rows)
        for k in terms:
            w = [get(p, k) for p in rows]
            axis.barh(labels, w, left=left, label=k)
            left = [a + b for a, b in zip(left, w)]
        axis.set_xlabel(unit)
        axis.legend(fontsize=7, loc="lower right")
    ax.invert_yaxis()
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    fmt = os.path.splitext(path)[1][1:] or "png"     # savefig to a file object needs the format named
    atomic_write(path, lambda f: fig.savefig(f, dpi=110, format=fmt))
    plt.close(fig)
    return path
