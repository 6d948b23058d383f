"""Every layout's prediction, the ones that fit, ranked by step time.

    python -m planner llama-70b --gpus 512 --hardware h100 --json plan.json

A prediction holds the layout, its memory terms (planner.memory), its time terms
(planner.steptime) and the throughput they imply: tokens/s, model TFLOP/s per GPU (planner.model's
count without recomputation, what MFU divides) and MFU = that / the hardware's peak.
"""
from __future__ import annotations

from dataclasses import dataclass

from planner.layout import Layout, enumerate_layouts
from planner.memory import memory
from planner.steptime import Software, step_time


@dataclass
class Prediction:
    layout: Layout
    memory: dict
    time: dict
    fits: bool
    tokens_per_s: float
    tflops_per_gpu: float
    mfu: float

    def as_dict(self) -> dict:
        return {"layout": self.layout.as_dict(), "label": self.layout.label(), "fits": self.fits,
                "memory_bytes": self.memory, "time_s": self.time, "tokens_per_s": self.tokens_per_s,
                "model_tflops_per_gpu": self.tflops_per_gpu, "mfu": self.mfu}


def predict_layout(model, seq: int, lay: Layout, global_batch: int, hw, sw: Software = Software()) -> Prediction:
    mem = memory(model, seq, lay, global_batch, hw, sw)
    tm = step_time(model, seq, lay, global_batch, hw, sw)
    T = tm["total"]
    flops = model.flops_per_token(seq) * global_batch * seq
    tf = flops / (T * lay.gpus)
    return Prediction(lay, mem, tm, mem["total"] <= hw.memory, global_batch * seq / T, tf / 1e12, tf / hw.peak_flops)


def host_apart(hw) -> bool:
    """Whether the hardware has a host apart from its devices (offload possible): not a CPU host."""
    return not hw.name.startswith("cpu")


def plan(model, gpus: int, hw, seq: int, global_batch: int, sw: Software = Software(),
         fixed: dict | None = None, keep_all: bool = False) -> list[Prediction]:
    """Predictions of every legal layout, fitting ones first, each group by step time."""
    host = host_apart(hw)
    per_node = min(hw.gpus_per_node, gpus)
    preds = [predict_layout(model, seq, lay, global_batch, hw, sw)
             for lay in enumerate_layouts(model, gpus, per_node, global_batch, host, fixed=fixed)]
    if not keep_all:
        preds = [p for p in preds if p.fits]
    return sorted(preds, key=lambda p: (not p.fits, p.time["total"], p.memory["total"]))
