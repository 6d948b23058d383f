"""ddp_examples' engine: the wrappers as a user calls them (wrappers.py: a process group, the
same start on every rank, torch's all-reduce as an option), the same starting point on every
rank (state.py), and what every chapter script shares (common.py: model, data, loop, table)."""
