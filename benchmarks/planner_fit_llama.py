"""Hugging Face's llama decoder layer, fitted for the planner's cpu-here file: its own line of
non-matmul work, as benchmarks.planner_fit fits torch's layer.

    python -m benchmarks.planner_fit --llama        # only these two terms, into the existing file (~15 s)

    llama_op_overhead, llama_elementwise_s    pipeline_parallel.models.llama's block (the rotary
                              tables made per call, HF's LlamaDecoderLayer at SDPA, causal) forward +
                              backward at three calibration shapes (LLAMA), less its matmul FLOPs at
                              the fitted GEMM rate, fitted as llama_op_overhead + llama_elementwise_s
                              × (the layer's saved bytes, planner.memory.llama_layer_activation_bytes)

Torch's line does not carry over: the llama layer runs more separate ops (two RMSNorms of six
each, the rotary products, SiLU and the gate's product) and does less work per byte it saves
(its four ffn-wide tensors are each written once), so at torch's line a llama layer that saves
many bytes comes out high and one that saves few low. Each round times the torch calibration
layers (benchmarks.planner_fit.LAYERS) and then each llama shape, every op once, right after a
different layer, as a step runs its layers (torch's line is fitted on each layer repeated, warm
on itself): a llama shape's CPU is the median of its ratio to the torch layers' sum, times what
torch's line gives them. So it is on the scale of torch's line, and whatever a step adds to a
layer beyond it (step_cpu, fitted on torch's layers in whole steps, benchmarks.planner_fit_engine)
applies to it as to torch's: what a step adds need not be the same for both layers, and timed in
a step's order the ratio carries llama's share of it. A machine whose speed moves within seconds
moves both sides of the ratio. That needs at least torch's three layers to keep their line's
proportions when timed so: the fit prints their shares of a round beside the line's. Each of
`ranks` processes measures at once, as the rest of the fit; the medians are kept. Cost: `rounds` ×
(3 torch + 3 llama layers) per process, ~15 s.
"""
from __future__ import annotations

import statistics
import time

import torch

from pipeline_parallel.models.llama import LlamaBlockPipe, llama_config
from planner.layout import Layout
from planner.memory import llama_layer_activation_bytes, torch_layer_activation_bytes
from planner.model import Model
from transformers.models.llama.modeling_llama import LlamaDecoderLayer

from benchmarks.planner_fit_map import layer_step

LLAMA = ((96, 4, 2, 256, 64, 2), (192, 6, 3, 512, 96, 4), (160, 4, 2, 432, 160, 2))   # h, heads, kv heads, ffn, s, b


def llama_model(h: int, a: int, kv: int, f: int, s: int) -> Model:
    """The planner's Model of one llama layer at a calibration shape (no biases, gated ffn)."""
    return Model("llama-cal", 1, h, a, 2, s, ffn=f, kv_heads=kv, gated=True, bias=False, tied=False)


def llama_step(h: int, a: int, kv: int, f: int, s: int, b: int):
    """One forward + backward of the llama pipeline's block at a calibration shape."""
    cfg = llama_config("small", hidden_size=h, num_attention_heads=a, num_key_value_heads=kv, intermediate_size=f)
    block = LlamaBlockPipe(LlamaDecoderLayer(cfg, 0), cfg)
    x = torch.randn(b, s, h, requires_grad=True)
    return lambda: block(x).sum().backward()


def _cpu(op) -> float:
    """CPU seconds of one op() right after a different layer's, as a step runs its layers."""
    t0 = time.thread_time()
    op()
    return time.thread_time() - t0


def llama_sweep(rank: int, world: int, layers, rounds: int) -> dict:
    """Over `rounds`, the median of each llama shape's CPU seconds over the torch layers' sum
    ("llama"), and of each torch layer's share of that sum ("torch")."""
    torch.set_num_threads(1)
    ref = [layer_step(*shape) for shape in layers]
    ours = [llama_step(*shape) for shape in LLAMA]
    for op in ref + ours:
        op()        # the first call's one-off work (kernels chosen, pages touched) stays out
    llama, shares = [[] for _ in LLAMA], [[] for _ in layers]
    for _ in range(rounds):
        times = [_cpu(op) for op in ref]
        for s, t in zip(shares, times):
            s.append(t / sum(times))
        for r, op in zip(llama, ours):
            r.append(_cpu(op) / sum(times))
    return {"llama": [statistics.median(r) for r in llama], "torch": [statistics.median(s) for s in shares]}


def torch_line(h: int, a: int, f: int, s: int, b: int, doc: dict) -> float:
    """Torch's layer at the fit's rates: its matmuls at the GEMM rate, op_overhead, elementwise_s per saved byte."""
    m = Model("cal", 1, h, a, 2, s, ffn=f)
    return (matmul_s(m, s, b, gemm_rate(doc)) + doc["op_overhead"]
            + torch_layer_activation_bytes(m, s, Layout(1, 1, 1, mb=b)) * doc["elementwise_s"])


def gemm_rate(doc: dict) -> float:
    """The fit's GEMM rate, FLOPs per CPU second."""
    return doc["peak_flops"] * doc["gemm_efficiency"]


def matmul_s(m: Model, s: int, b: int, rate: float) -> float:
    """CPU seconds of a layer's matmuls, forward + backward, at `rate` FLOPs per CPU second (planner.steptime's FLOPs)."""
    return 3 * (2 * m.layer_linear_params() + 4 * s * m.hidden) * s * b / rate


def torch_shares(got: list[dict], doc: dict, layers) -> list[tuple[float, float]]:
    """Each torch calibration layer's share of a round: (timed in rounds, the ranks' median; by torch's line)."""
    line = [torch_line(*shape, doc) for shape in layers]
    return [(statistics.median(g["torch"][i] for g in got), t / sum(line)) for i, t in enumerate(line)]


def llama_points(got: list[dict], doc: dict, layers) -> list[tuple[float, float, float]]:
    """(saved bytes, CPU seconds beyond the matmuls, the matmuls') of each llama shape at the fit's
    speed: the ranks' median ratio times torch's line over the torch layers."""
    base = sum(torch_line(*shape, doc) for shape in layers)
    points = []
    for i, (h, a, kv, f, s, b) in enumerate(LLAMA):
        m = llama_model(h, a, kv, f, s)
        t = statistics.median(g["llama"][i] for g in got) * base
        mm = matmul_s(m, s, b, gemm_rate(doc))
        points.append((llama_layer_activation_bytes(m, s, Layout(1, 1, 1, mb=b)), t - mm, mm))
    return points
