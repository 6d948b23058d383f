"""ddp_examples' engine: what every chapter script shares (common.py: model, data, loop, table)
and the same starting point on every rank (state.py)."""
