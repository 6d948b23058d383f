"""Consolidate a sharded ZeRO checkpoint into one full fp32 state_dict (no processes needed).

    python -m zero_from_scratch.engine.zero_to_fp32 CKPT_DIR OUT.pt [--tag global_step10]

Reads the manifest, concatenates every rank's shards unit by unit, drops the padding, and
writes {name: fp32 tensor} (the fp32 master in mixed precision) that `model.load_state_dict`
accepts. The write is atomic. Cost: O(Ψ) memory, one pass over the shard files.
"""
from __future__ import annotations

import argparse
import sys

import torch

from zero_from_scratch.engine.atomic import atomic_write
from zero_from_scratch.engine.checkpoint_read import CheckpointError, consolidate


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("checkpoint_dir")
    ap.add_argument("output_file")
    ap.add_argument("--tag", default=None, help="default: the tag in CHECKPOINT_DIR/latest")
    a = ap.parse_args(argv)
    try:
        sd = consolidate(a.checkpoint_dir, a.tag)
    except CheckpointError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    atomic_write(a.output_file, lambda f: torch.save(sd, f))
    n = sum(v.numel() for k, v in sd.items() if v.is_floating_point())
    print(f"wrote {a.output_file}: {len(sd)} tensors, {n:,} floating-point elements")
    return 0


if __name__ == "__main__":
    sys.exit(main())
