"""python -m pipeline_parallel.schedules: every schedule through the simulator, p = 4, m = 8 (no processes)."""
from rich.table import Table

from pipeline_parallel.schedules import SCHEDULES, build
from pipeline_parallel.schedules.base import bubble_formula, simulate
from primitives.engine.log import console

p, m = 4, 8
t = Table(title=f"simulated schedules, p = {p} stages, m = {m} micro-batches, t_bwd = 2·t_fwd")
for col in ("schedule", "v", "bubble (sim)", "formula", "peak stored activations per stage (in chunks)"):
    t.add_column(col)
for name in SCHEDULES:
    v = 2 if name == "interleaved" else 1
    r = simulate([build(name, s, p, m, v) for s in range(p)], m, v)
    f = {"naive": (p - 1) / p}.get(name, bubble_formula(p, m, v))
    t.add_row(name, str(v), f"{max(r['bubble']):.3f}", f"{f:.3f}", str(r["peak_live"]))
console.print(t)
