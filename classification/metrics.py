"""The run's record: rank 0 appends JSON lines to OUTPUT_DIR/metrics.jsonl and, when tensorboard is
installed, writes the same scalars as TensorBoard events.

    torchrun --standalone --nproc_per_node 2 classification/train.py --engine zero --tensorboard runs/tb
"""
from __future__ import annotations

import json
import os


class Metrics:
    """Rank 0 appends JSON lines (one flushed line per record) and, when installed, TensorBoard."""

    def __init__(self, out_dir, rank, append, tb_dir=None):
        self.f = self.tb = None
        if rank != 0:
            return
        self.f = open(os.path.join(out_dir, "metrics.jsonl"), "a" if append else "w")
        try:
            from torch.utils.tensorboard import SummaryWriter   # optional dependency: tensorboard
        except Exception:  # tensorboard not installed: JSONL only, unless --tensorboard asked for it
            if tb_dir:
                raise SystemExit("error: --tensorboard needs `pip install tensorboard`") from None
            return
        self.tb = SummaryWriter(tb_dir or os.path.join(out_dir, "tb"))

    def log(self, **rec):
        if self.f:
            self.f.write(json.dumps(rec) + "\n")
            self.f.flush()
            if self.tb and "step" in rec:
                for k, v in rec.items():
                    if isinstance(v, (int, float)) and k != "step":
                        self.tb.add_scalar(f"{rec.get('event', '')}/{k}", v, rec["step"])
                self.tb.flush()
