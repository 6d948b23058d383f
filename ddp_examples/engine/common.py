"""What every chapter shares: the model, the data, the training loop and the table.

Each chapter script only says how to wrap the model (its one idea) and calls `main(wrap)`:

    torchrun --standalone --nproc_per_node 2 ddp_examples/04_bucketed.py --steps 20
    mpiexec -n 2 python ddp_examples/04_bucketed.py --backend mpi

Everything is deterministic: the model is built from `seed`, and step s draws its global batch
from a generator seeded by (seed, s), so every rank (and the single-process reference) sees
the same global batch and takes its own contiguous slice of it. With B the global batch, N
ranks and k accumulation micro-batches, each rank runs k forward/backward passes on B/(N·k)
samples with the loss divided by k; the average over ranks of the summed gradients is then
exactly the gradient of the mean loss over the B samples, up to float summation order.

Communication per optimizer step and rank, ring all-reduce of Ψ parameters of e bytes:
2(N−1)/N·Ψ·e bytes (exactly, when every all-reduced buffer divides by N; primitives.engine.cost.traffic
gives the exact bytes otherwise).
"""
from __future__ import annotations

import argparse
import contextlib
import statistics
import time
from dataclasses import asdict, dataclass, field

import torch
import torch.nn as nn
import torch.nn.functional as F
from rich.table import Column, Table

import primitives as P
from primitives.engine.cost import ring_fraction
from primitives.launch import add_launch_args, init_from_env
from primitives.log import print0


@dataclass
class Config:
    """One training run. The defaults make every parameter's size divisible by 6, so at
    N = 2 and 3 each all-reduced buffer splits evenly and the byte formula holds exactly."""
    steps: int = 12                 # optimizer steps
    global_batch: int = 48          # samples per optimizer step, over all ranks and micro-batches
    accum: int = 1                  # micro-batches per optimizer step (gradient accumulation)
    in_dim: int = 24                # input features
    hidden: int = 48                # width of each hidden layer
    depth: int = 2                  # hidden layers
    classes: int = 6                # output classes
    lr: float = 0.05                # SGD learning rate
    momentum: float = 0.9           # SGD momentum
    seed: int = 0                   # model init and data
    bucket_cap_mb: float = 25.0     # chapter 4/5 bucket size (torch DDP's default is 25 MB too)
    algorithm: str = "ring"         # primitives all-reduce algorithm; "ring" makes the formula exact

    def __post_init__(self):
        for name in ("steps", "global_batch", "accum", "in_dim", "hidden", "depth", "classes"):
            v = getattr(self, name)
            if not isinstance(v, int) or v < 1:
                raise ValueError(f"Config.{name} must be a positive int, got {v!r}")
        if not self.lr > 0 or not 0 <= self.momentum < 1:
            raise ValueError(f"Config: need lr > 0 and 0 <= momentum < 1, got lr={self.lr}, momentum={self.momentum}")
        if not self.bucket_cap_mb > 0:
            raise ValueError(f"Config.bucket_cap_mb must be > 0 MB, got {self.bucket_cap_mb}")
        if self.global_batch % self.accum:
            raise ValueError(f"Config: global_batch {self.global_batch} is not divisible by accum {self.accum}")

    def check_world(self, world_size: int, rank: int = 0) -> None:
        """Every rank must get the same number of samples per micro-batch."""
        if self.global_batch % (world_size * self.accum):
            raise ValueError(
                f"rank {rank}: global batch {self.global_batch} is not divisible by world size {world_size}"
                + (f" × accumulation steps {self.accum} = {world_size * self.accum}" if self.accum > 1 else "")
                + f"; pick a global batch that is a multiple of {world_size * self.accum}")


# ----------------------------------------------------------------------------- model and data

def build_model(cfg: Config) -> nn.Module:
    """An MLP classifier, initialised from cfg.seed without touching the global RNG."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(cfg.seed)
        layers, d = [], cfg.in_dim
        for _ in range(cfg.depth):
            layers += [nn.Linear(d, cfg.hidden), nn.GELU()]
            d = cfg.hidden
        layers.append(nn.Linear(d, cfg.classes))
        return nn.Sequential(*layers)


def make_batch(cfg: Config, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The global batch of `step`: Gaussian inputs labelled by a fixed random linear teacher."""
    g = torch.Generator().manual_seed(cfg.seed)
    teacher = torch.randn(cfg.in_dim, cfg.classes, generator=g)
    g.manual_seed(cfg.seed * 1_000_003 + step + 1)
    x = torch.randn(cfg.global_batch, cfg.in_dim, generator=g)
    y = (x @ teacher + 0.5 * torch.randn(cfg.global_batch, cfg.classes, generator=g)).argmax(1)
    return x, y


def num_params(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters() if p.requires_grad)


# ----------------------------------------------------------------------------- training loop

@dataclass
class Result:
    params: list                              # final parameters (detached copies)
    losses: list = field(default_factory=list)        # this rank's loss per step (over its samples)
    step_times: list = field(default_factory=list)    # seconds per optimizer step
    bytes_sent: list = field(default_factory=list)    # ledger bytes this rank sent per step
    calls: list = field(default_factory=list)         # primitives collectives per step


def train(model: nn.Module, cfg: Config, rank: int = 0, world_size: int = 1) -> Result:
    """SGD on this rank's slice of each global batch. `model` may be a plain module (the
    single-process reference: rank 0 of 1 sees the whole batch) or any data-parallel wrapper:
    wrappers with no_sync() skip communication on all but the last micro-batch; wrappers
    with sync_gradients() are asked to average explicitly after the last one."""
    cfg.check_world(world_size, rank)
    opt = torch.optim.SGD(model.parameters(), lr=cfg.lr, momentum=cfg.momentum)
    per_rank = cfg.global_batch // world_size
    micro = per_rank // cfg.accum
    device = next(model.parameters()).device
    res = Result(params=[])
    for step in range(cfg.steps):
        x, y = make_batch(cfg, step)
        x, y = x[rank * per_rank:(rank + 1) * per_rank], y[rank * per_rank:(rank + 1) * per_rank]
        x, y = x.to(device), y.to(device)              # the batch goes where the model is
        n_calls = len(P.LEDGER.calls)
        t0 = time.perf_counter()
        with P.LEDGER.track() as sent:
            # set_to_none=False keeps .grad alive: in chapters 3-4 it is a view into the comm buffer
            opt.zero_grad(set_to_none=False)
            total = 0.0
            for j in range(cfg.accum):
                last = j == cfg.accum - 1
                # no_sync must cover forward AND backward: like torch DDP, the forward decides
                ctx = model.no_sync() if (not last and hasattr(model, "no_sync")) else contextlib.nullcontext()
                with ctx:
                    out = model(x[j * micro:(j + 1) * micro])
                    loss = F.cross_entropy(out, y[j * micro:(j + 1) * micro]) / cfg.accum
                    loss.backward()
                total += loss.item()
            if hasattr(model, "sync_gradients"):
                model.sync_gradients()
            opt.step()
        res.step_times.append(time.perf_counter() - t0)
        res.losses.append(total)
        res.bytes_sent.append(sent.bytes_sent)
        res.calls.append(len(P.LEDGER.calls) - n_calls)
    inner = getattr(model, "module", model)
    res.params = [p.detach().cpu().clone() for p in inner.parameters()]    # compared on the host
    return res


def reference(cfg: Config) -> Result:
    """Chapter 1: one process, the whole global batch, no communication."""
    return train(build_model(cfg), cfg, 0, 1)


def max_diff(a: list, b: list) -> float:
    return max((x - y).abs().max().item() for x, y in zip(a, b))


# ----------------------------------------------------------------------------- the table and main()

def summary_table(title: str, rows: list[tuple[str, str]]):
    t = Table("quantity", Column("value", justify="right"), title=title)
    for k, v in rows:
        t.add_row(k, v)
    return t


def parse_args(description: str, argv=None) -> tuple[Config, argparse.Namespace]:
    p = argparse.ArgumentParser(description=description)
    for f, v in asdict(Config()).items():
        p.add_argument("--" + f.replace("_", "-"), type=type(v), default=v)
    add_launch_args(p)
    a = p.parse_args(argv)
    cfg = Config(**{f: getattr(a, f) for f in asdict(Config())})
    return cfg, a


def main(wrap, title: str, *, single_process: bool = False, needs_torch_dist: bool = False, argv=None) -> Result:
    """Run one chapter: init from the launcher's env, wrap the model, train, compare with the
    single-process reference and print the table on rank 0."""
    cfg, a = parse_args(title, argv)
    comm = init_from_env(a.backend, a.timeout)
    if needs_torch_dist and comm.backend == "mpi":
        raise SystemExit(f"{title} uses torch.distributed, which has no MPI backend in torch wheels: "
                         "launch it with torchrun instead of mpiexec")
    rank, world = (0, 1) if single_process else (comm.rank, comm.size)
    cfg.check_world(world, comm.rank)
    model = build_model(cfg).to(comm.device)         # nccl: the rank's GPU; gloo/MPI: the CPU
    psi = num_params(model)
    model = wrap(model, cfg)
    res = train(model, cfg, rank, world)
    ref = reference(cfg)
    # after training (outside the ledger windows): global loss and agreement between ranks
    dev = comm.device
    loss = torch.tensor([res.losses[-1]], dtype=torch.float64, device=dev)
    flat = torch.cat([p.reshape(-1) for p in res.params]).to(dev)
    spread = torch.zeros(1, dtype=torch.float32, device=dev)
    if comm.size > 1:
        P.all_reduce(loss, P.ReduceOp.SUM)
        loss /= comm.size
        rank0 = flat.clone()
        P.broadcast(rank0, 0)
        spread[0] = (flat - rank0).abs().max()
        P.all_reduce(spread, P.ReduceOp.MAX)
    steady = res.step_times[1:] or res.step_times
    b = res.bytes_sent[-1]
    rows = [("backend", comm.backend), ("transport", getattr(comm, "transport", comm.backend)),   # shm.py
            ("optimizer steps", str(cfg.steps)),
            ("ranks × micro-batches", f"{world} × {cfg.accum}"),
            ("parameters Ψ", f"{psi:,}"),
            ("final loss (global batch)", f"{loss.item():.6f}"),
            ("final loss, single process", f"{ref.losses[-1]:.6f}"),
            ("max |param − single-process param|", f"{max_diff(res.params, ref.params):.2e}"),
            ("max |param − rank 0 param|", f"{spread.item():.2e}"),
            ("step time (median of steps 2..)", f"{statistics.median(steady) * 1e3:.2f} ms"),
            ("bytes sent per step, this rank (ledger)",
             "n/a (torch's own traffic)" if needs_torch_dist else f"{b:,}"),
            ("collective calls per step", f"{res.calls[-1]}" if not needs_torch_dist else "n/a"),
            ("2(N−1)/N·Ψ·4 bytes", f"{float(ring_fraction('all_reduce', world) * psi * 4):,.0f}")]
    print0(summary_table(title, rows))
    return res
