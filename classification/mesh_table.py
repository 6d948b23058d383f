"""Who is where in a dp × pp × tp mesh, as a rich table (what the parallel trainers print first).

    python -c "from classification.mesh_table import mesh_table; from primitives.mesh import Layout; \
from primitives.log import console; console.print(mesh_table(Layout(dp=2, pp=2, tp=2)))"

Cost: none (layout arithmetic only, no processes).
"""
from rich.table import Table

from primitives.mesh import Layout


def mesh_table(layout: Layout) -> Table:
    """Every global rank with its (pp, dp, tp) coordinates."""
    t = Table(title=f"mesh dp={layout.dp} × pp={layout.pp} × tp={layout.tp}")
    for col in ("rank", "pp stage", "dp replica", "tp shard"):
        t.add_column(col, justify="right")
    for r in range(layout.world):
        t.add_row(str(r), *map(str, layout.coords_of(r)))
    return t
