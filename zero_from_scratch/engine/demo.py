"""Train a small model a few steps under ZeRO and print the measured memory and comm tables.

    torchrun --standalone --nproc_per_node 2 -m zero_from_scratch.engine.demo --stage 2
    torchrun --standalone --nproc_per_node 2 -m zero_from_scratch.engine.demo --stage 3 --bf16 --save /tmp/ck
    deepspeed --num_gpus 2 --module zero_from_scratch.engine.demo --stage 1        (the DeepSpeed launcher works too)
    torchrun --standalone --nproc_per_node 2 -m zero_from_scratch.engine.demo --stage 3 --zero overlap_comm=true \
        --zero stage3_param_persistence_threshold=0          (any zero_optimization key, value as JSON)

Every rank builds the same model; the engine broadcasts rank 0's weights, shards per the stage,
and the reports come from the actual tensors and primitives' byte ledger.
"""
from __future__ import annotations

import argparse
import json

import torch
import torch.nn as nn

import zero_from_scratch
from primitives.launch import add_launch_args, init_from_env
from primitives.log import print0
from primitives.engine.shm import describe


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--stage", type=int, default=2, choices=[0, 1, 2, 3])
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--bf16", action="store_true")
    ap.add_argument("--comm-impl", default="primitives", choices=["primitives", "torch"])
    ap.add_argument("--save", default=None, help="save a checkpoint here at the end")
    ap.add_argument("--zero", action="append", default=[], metavar="KEY=JSON",
                    help="a zero_optimization key, e.g. overlap_comm=true (repeatable)")
    add_launch_args(ap)
    a = ap.parse_args(argv)
    zero = {"stage": a.stage}
    for kv in a.zero:
        k, sep, v = kv.partition("=")
        try:
            zero[k] = json.loads(v) if sep else None
        except json.JSONDecodeError:
            ap.error(f"--zero {kv!r}: expected KEY=JSON (e.g. overlap_comm=true), got value {v!r}")
        if not sep:
            ap.error(f"--zero {kv!r}: expected KEY=JSON (e.g. overlap_comm=true)")
    comm = init_from_env("gloo" if a.backend == "auto" else a.backend, a.timeout)
    print0(describe(comm))                            # which transport the engine's collectives use
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 256), nn.LayerNorm(256), nn.GELU(), nn.Linear(256, 10))
    cfg = {"train_micro_batch_size_per_gpu": 8, "gradient_clipping": 1.0, "bf16": {"enabled": a.bf16},
           "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "weight_decay": 0.01}},
           "zero_optimization": zero}
    engine, *_ = zero_from_scratch.initialize(model=model, model_parameters=model.parameters(), config=cfg,
                                              comm_impl=a.comm_impl)
    g = torch.Generator().manual_seed(comm.rank)
    for step in range(a.steps):
        x, y = torch.randn(8, 64, generator=g), torch.randint(0, 10, (8,), generator=g)
        loss = nn.functional.cross_entropy(engine(x.to(engine.dtype)).float(), y)
        engine.backward(loss)
        engine.step()
        print0(f"step {engine.global_steps}: loss {loss.item():.4f}  grad norm {engine.get_global_grad_norm():.4f}")
    engine.memory_report()
    engine.comm_report()
    if a.save:
        print0(f"saved {engine.save_checkpoint(a.save)}")


if __name__ == "__main__":
    main()
