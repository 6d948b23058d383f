"""DeepSpeed's `flops_profiler`: per-module FLOPs and MACs of one forward pass, from the model's shapes.

    "flops_profiler": {"enabled": true, "profile_step": 1, "module_depth": -1, "detailed": true}
    python -m pytest tests/test_config_keys.py -k flops

At optimizer step `profile_step` (0-based, DeepSpeed's global_steps), the first micro-batch's forward is
counted on rank 0 by forward hooks on the leaf modules, with DeepSpeed's formulas
(deepspeed/profiling/flops_profiler/profiler.py):
  nn.Linear       MACs = numel(input) · out_features, FLOPs = 2 · MACs (bias not counted, as DeepSpeed)
  nn.LayerNorm    FLOPs = 5 · numel(input) (4 without affine), MACs 0
  activations     FLOPs = numel(input) (ReLU, GELU, SiLU, Tanh, Sigmoid), MACs 0; nn.Embedding 0
A parent module's numbers are its children's sums. Unlike DeepSpeed, calls to torch.nn.functional and
torch.matmul made directly in a forward (outside these leaf modules) are not counted: the summary
says so. fwd+bwd FLOPs = (3 + recompute_fwd_factor) · fwd (backward ≈ 2 × forward; recomputation adds
the factor). Printed after that step: a summary and, with detailed, one row per module up to module_depth
(-1: all); output_file writes the same text to a file. Cost: hooks for one forward; nothing otherwise.
"""
from __future__ import annotations

import time

import torch.nn as nn

from zero_from_scratch.engine.key_status import enabled_section

KEYS = {"enabled", "profile_step", "module_depth", "top_modules", "detailed", "output_file", "recompute_fwd_factor"}
ACT = (nn.ReLU, nn.GELU, nn.SiLU, nn.Tanh, nn.Sigmoid)


def parse(raw: dict) -> dict | None:
    s = enabled_section(raw, "flops_profiler", KEYS)
    if s is None:
        return None
    out = {"profile_step": s.get("profile_step", 1), "module_depth": s.get("module_depth", -1),
           "detailed": bool(s.get("detailed", True)), "output_file": s.get("output_file"),
           "recompute_fwd_factor": float(s.get("recompute_fwd_factor", 0.0))}
    if not isinstance(out["profile_step"], int) or out["profile_step"] < 0:
        raise ValueError(f"config key 'flops_profiler.profile_step' = {out['profile_step']!r} is invalid; allowed: an int >= 0")
    return out


def leaf_cost(m: nn.Module, x) -> tuple[int, int]:
    """(FLOPs, MACs) of one call of leaf module m on input x, DeepSpeed's formulas."""
    if isinstance(m, nn.Linear):
        macs = x.numel() * m.out_features
        return 2 * macs, macs
    if isinstance(m, nn.LayerNorm):
        return x.numel() * (5 if m.elementwise_affine else 4), 0
    if isinstance(m, ACT):
        return x.numel(), 0
    return 0, 0


class Profile:
    """Counts one forward of `model`: per module name → {"flops", "macs", "params", "latency_ms"}."""

    def __init__(self, model: nn.Module, numels: dict | None = None):
        # numels: parameter name → full element count (ZeRO-3 leaves only a shard in p itself)
        self.model, self.rows, self.handles, self.t0 = model, {}, [], {}
        numels = numels or {}
        for name, m in model.named_modules():
            self.rows[name] = {"flops": 0, "macs": 0, "latency_ms": 0.0,
                               "params": sum(numels.get(n, p.numel()) for n, p in m.named_parameters(prefix=name))}
            self.handles.append(m.register_forward_pre_hook(self._pre(name)))
            self.handles.append(m.register_forward_hook(self._post(name, m)))

    def _pre(self, name):
        def hook(m, args):
            self.t0[name] = time.perf_counter()
        return hook

    def _post(self, name, m):
        def hook(mod, args, out):
            r = self.rows[name]
            r["latency_ms"] += 1e3 * (time.perf_counter() - self.t0.pop(name))
            if not list(m.children()) and args and hasattr(args[0], "numel"):
                f, mac = leaf_cost(m, args[0])
                r["flops"] += f
                r["macs"] += mac
        return hook

    def stop(self) -> dict:
        for h in self.handles:
            h.remove()
        for name in sorted(self.rows, key=lambda n: -n.count(".") if n else 1):   # deepest first
            if name:
                parent = name.rsplit(".", 1)[0] if "." in name else ""
                self.rows[parent]["flops"] += self.rows[name]["flops"]
                self.rows[parent]["macs"] += self.rows[name]["macs"]
        return self.rows


def report(rows: dict, spec: dict, step: int) -> str:
    """DeepSpeed's summary lines, then (detailed) one line per module up to module_depth."""
    top, depth = rows[""], spec["module_depth"]
    lines = ["-------------------------- DeepSpeed Flops Profiler --------------------------",
             f"Profile Summary at step {step}:",
             f"params (whole model):           {top['params']:,}",
             f"fwd MACs per GPU:               {top['macs']:,}",
             f"fwd flops per GPU:              {top['flops']:,}",
             f"fwd+bwd flops per GPU:          {int((3 + spec['recompute_fwd_factor']) * top['flops']):,}",
             f"fwd latency:                    {top['latency_ms']:.2f} ms",
             "(leaf nn.Linear/LayerNorm/activation modules; torch.nn.functional calls in a forward not counted)"]
    if spec["detailed"]:
        lines.append("module: params, MACs, fwd FLOPs, fwd latency")
        for name, r in rows.items():
            d = name.count(".") + 1 if name else 0
            if depth < 0 or d <= depth:
                lines.append(f"{'  ' * d}{name or '(model)'}: {r['params']:,} params, {r['macs']:,} MACs, "
                             f"{r['flops']:,} FLOPs, {r['latency_ms']:.3f} ms")
    return "\n".join(lines)
