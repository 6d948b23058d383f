"""Tensor parallelism inside classification/train.py's loop: --tp N with --engine zero | ddp | deepspeed.

    torchrun --standalone --nproc_per_node 2 classification/train.py --tp 2 --engine zero
    deepspeed --num_gpus 2 classification/train.py --tp 2                                 # real DeepSpeed
    torchrun --standalone --nproc_per_node 4 classification/train.py --tp 2 --engine ddp    # dp 2 × tp 2

The world becomes a primitives.mesh dp × tp mesh (tp ranks adjacent). tensor_parallel.engine.parallelize
shards the model over the tp group; the engine gets the mesh's mpu (DeepSpeed's protocol), so
ZeRO's collectives, or DDP's all-reduce, run over the dp group; every tp rank of a replica reads
the same batches, so the loop deals data, batch arithmetic and evaluation by dp rank and size.
Checkpoints: the engine's own (ZeRO's files carry mp_rank_XX), and OUTPUT_DIR/best as one
UNSHARDED save_pretrained folder (gather_state_dict, then rank 0 writes), which predict.py and
any later --tp load alike (load_full_state_dict narrows it again).
Cost per step and rank: the TP traffic of tensor_parallel.engine.formulas (4 all-reduces of b·s·h per
layer), the engine's gradient traffic over dp on this rank's ~Ψ/tp parameters, and one 8-byte
gradient-norm all-reduce over tp.
"""
from __future__ import annotations

from classification.mesh_table import mesh_table
from primitives.log import print0
from primitives.mesh import Mesh
from tensor_parallel.engine.parallelize import parallelize
from tensor_parallel.engine.state_dict import gather_state_dict, load_full_state_dict
from tensor_parallel.layers import TPError


def refusals(a) -> list[str]:
    """Options --tp cannot honour, each with why (train.py refuses them before any process group)."""
    out = []
    if a.tp < 1:
        out.append(f"--tp must be >= 1, got {a.tp}")
    if a.tp > 1 and getattr(a, "lora", 0):
        out.append("--lora (peft wraps the modules tensor_parallel.engine.parallelize must shard; train LoRA with --tp 1)")
    return out


class TP:
    """The mesh and what the loop asks of it."""

    def __init__(self, mesh):
        self.mesh = mesh
        self.dp_rank, self.dp_size, self.dp_group = mesh.index("dp"), mesh.layout.dp, mesh.dp_group
        self.tp = mesh.layout.tp

    def mpu(self):
        return self.mesh.mpu()

    def shard(self, model):
        try:
            return parallelize(model, self.mesh.tp_group)
        except TPError as e:
            raise SystemExit(f"error (rank {self.mesh.rank}): --tp {self.tp}: {e}") from None

    def full_state_dict(self, module) -> dict:
        """The unsharded state dict (collective over the tp group: every rank calls it)."""
        return gather_state_dict(module)

    def load_full(self, module, state_dict) -> None:
        load_full_state_dict(module, state_dict)


def setup(a, comm) -> TP | None:
    """None for --tp 1; else the dp × tp mesh (every rank, after init; a --tp that does not
    divide the world is an error on every rank)."""
    if a.tp == 1:
        return None
    if comm.size % a.tp:
        raise SystemExit(f"error (rank {comm.rank}): --tp {a.tp} does not divide the {comm.size} ranks; start a "
                         f"multiple of {a.tp} processes (dp = ranks / tp)")
    mesh = Mesh.build(dp=comm.size // a.tp, tp=a.tp)
    print0(mesh_table(mesh.layout))
    return TP(mesh)
