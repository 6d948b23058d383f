"""What subnormal floats cost on this CPU: a matmul on normal and on subnormal inputs, and one
training step of benchmarks.planner_local's GPT row with its tied tables at torch's N(0, 1) and
at GPT-2's N(0, 0.02).

    python -m benchmarks.subnormal_cost            # ~30 s on a processor with the slow path
    python -m benchmarks.subnormal_cost --steps 4  # more steps

A float32 below 2⁻¹²⁶ ≈ 1.2e-38 is subnormal; many x86 cores multiply it through a slow
microcode path, others at full speed, so the same model can cost several times more on one
processor than another. The GPT row's model ties its head to its token table: at N(0, 1) a
token's own logit is |e|² ≈ h, its probability 1, the loss 0 and the gradients mostly zero or
subnormal (≤ 1e-29), so the backward multiplies subnormals; at N(0, 0.02) the logits are O(1) and nothing underflows.
`torch.set_flush_denormal(True)` (flush to zero) shows the step without the slow path.
One process, one thread, CPU seconds (time.thread_time), the median of --steps after a warm-up.
"""
from __future__ import annotations

import argparse

import torch
from rich.table import Table

from benchmarks.planner_fit_loss import cpu as cpu_s     # median CPU seconds after a warm-up call
from benchmarks.planner_ranks import SHAPES, Net
from planner.hosts import this_cpu
from primitives.log import console

TINY = torch.finfo(torch.float32).tiny


def matmul_s(scale: float, n: int) -> float:
    a, b = torch.randn(512, 256) * scale, torch.randn(256, 1024)
    return cpu_s(lambda: a @ b, n)


def step_s(std: float, flush: bool, n: int) -> tuple[float, float]:
    """(CPU seconds of one gpt-mini step, the share of its weight-gradient elements that are subnormal)."""
    torch.manual_seed(0)
    m = SHAPES[0]
    net = Net(m)
    for e in (net.emb, net.pos):
        torch.nn.init.normal_(e.weight, std=std)
    opt = torch.optim.AdamW(net.parameters(), lr=1e-4)
    x = torch.randint(0, m.vocab, (4, m.seq))

    def step():
        torch.nn.functional.cross_entropy(net(x).flatten(0, 1), x.flatten()).backward()
        opt.step()
        opt.zero_grad(set_to_none=False)
    torch.set_flush_denormal(flush)
    try:
        t = cpu_s(step, n)
        torch.nn.functional.cross_entropy(net(x).flatten(0, 1), x.flatten()).backward()
        g = torch.cat([p.grad.flatten() for p in net.parameters()])
        return t, ((g != 0) & (g.abs() < TINY)).float().mean().item()
    finally:
        torch.set_flush_denormal(False)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=2, help="timed steps per row (after one warm-up)")
    a = ap.parse_args(argv)
    if a.steps < 1:
        ap.error(f"--steps must be at least 1, got {a.steps}")
    torch.set_num_threads(1)
    reps = 3 * a.steps
    normal, sub = matmul_s(1.0, reps), matmul_s(1e-39, reps)
    t = Table(title=f"subnormal floats on {this_cpu()}, torch {torch.__version__}")
    for c in ("work", "CPU ms", "× its group's first row", "subnormal share: the left operand / the weight gradients"):
        t.add_column(c, justify="right" if c != "work" else "left")
    t.add_row("512×256 @ 256×1024, normal inputs", f"{normal * 1e3:.2f}", "1.00", "0")
    t.add_row("the same, left operand ×1e-39 (subnormal)", f"{sub * 1e3:.2f}", f"{sub / normal:.2f}", "1")
    base = None
    for std, flush, label in ((0.02, False, "gpt-mini step, tables N(0, 0.02) (GPT-2's, the row's)"),
                              (1.0, False, "gpt-mini step, tables N(0, 1) (torch's default)"),
                              (1.0, True, "the same, subnormals flushed to zero")):
        s, share = step_s(std, flush, a.steps)
        base = base or s
        t.add_row(label, f"{s * 1e3:.0f}", f"{s / base:.2f}", f"{share:.4f}")
    console.print(t)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
