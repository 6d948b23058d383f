"""Parity harness: the same training run under real DeepSpeed and under zero_from_scratch.

    python -m parity.zero.ds_parity --stage 2 --world-size 2 --steps 5            # its CLI

Each side runs in N fresh processes (primitives.launch.spawn: gloo over a file store), from the
same initial state_dict, on the same global micro-batches (rank r takes rows r·m … (r+1)·m of
each), dropout off. Per optimizer step we record the global mean loss, the engine's global
gradient norm and the learning rate; at the end the full parameters (gathered for ZeRO-3).
Models and batches: zero_from_scratch.engine.models; engines: parity.zero.sides; the verdict:
parity.zero.compare. Cost: one training run per side, i.e. 2·steps·gas
forward+backward passes per rank, plus one all-gather of Ψ at the end for stage 3.
"""
from __future__ import annotations

import os
import time
import warnings
from dataclasses import dataclass

import torch
import torch.distributed as dist

from zero_from_scratch.engine.models import MODELS, build_model, make_batches, param_groups
from parity.zero.sides import SIDES, full_params, make_engine, peak_rss_bytes
from primitives.launch import spawn


def _global_mean(x: float) -> float:
    t = torch.tensor([x], dtype=torch.float64)
    dist.all_reduce(t)  # torch's own collective, the same on both sides: a measurement, not the engine
    return t.item() / dist.get_world_size()


@dataclass
class Job:
    """One training run: which engine, which model (a key of `init_states`/`batches`), which config."""
    side: str
    model: str
    config: dict
    steps: int
    comm_impl: str = "primitives"
    groups: str = "split"  # "split": no weight decay on biases/LayerNorm; "all": one group (a bug to detect)

    def __post_init__(self):
        if self.groups not in ("split", "all"):
            raise ValueError(f"Job.groups must be 'split' or 'all', got {self.groups!r}")
        if self.side not in SIDES:
            raise ValueError(f"Job.side must be one of {SIDES}, got {self.side!r}")
        if self.steps < 1:
            raise ValueError(f"Job.steps must be ≥ 1, got {self.steps}")
        if "train_micro_batch_size_per_gpu" not in self.config:
            raise ValueError("Job.config needs train_micro_batch_size_per_gpu (the harness slices batches with it)")

    @property
    def stage(self) -> int:
        return int(self.config.get("zero_optimization", {}).get("stage", 0))

    @property
    def gas(self) -> int:
        return int(self.config.get("gradient_accumulation_steps", 1))


class Runner:
    """One engine on this rank, stepped one optimizer step at a time."""

    def __init__(self, rank: int, job: Job, init_state: dict | None, seed: int = 0):
        torch.manual_seed(seed)
        model = build_model(job.model)
        if init_state is not None:
            model.load_state_dict(init_state)
        wd = float(job.config.get("optimizer", {}).get("params", {}).get("weight_decay", 0.0))
        groups = param_groups(model, wd) if job.groups == "split" else [{"params": list(model.parameters())}]
        self.rank, self.job, self.mb = rank, job, int(job.config["train_micro_batch_size_per_gpu"])
        self.engine = make_engine(job.side, model, groups, job.config, job.comm_impl)
        self.records, self.step_times = [], []

    def step(self, micro_batches: list[dict]) -> dict:
        """gas micro-batches (global; this rank takes rows rank·m … (rank+1)·m) → one record."""
        e, r, mb = self.engine, self.rank, self.mb
        t0, losses, lr = time.perf_counter(), [], float(e.get_lr()[0])  # the LR this step applies
        for gb in micro_batches:
            loss = e(**{k: v[r * mb:(r + 1) * mb] for k, v in gb.items()}).loss
            e.backward(loss)
            e.step()
            losses.append(loss.item())
        self.step_times.append(time.perf_counter() - t0)
        norm = e.get_global_grad_norm()
        rec = {"step": len(self.records) + 1, "loss": _global_mean(sum(losses) / len(losses)),
               "grad_norm": float(norm) if norm is not None else float("nan"), "lr": lr,
               "global_steps": int(e.global_steps)}
        self.records.append(rec)
        return rec

    def full_params(self) -> dict[str, torch.Tensor]:
        return full_params(self.job.side, self.engine, self.job.stage)

    def result(self, t_first: float | None = None) -> dict:
        params = self.full_params()
        # numpy, not tensors: torch pickles tensors through shared-memory fds that die with this process
        params = {n: p.numpy() for n, p in params.items()} if self.rank == 0 else None
        return {"records": self.records, "params": params, "step_times": self.step_times,
                "launch_to_first_step": t_first, "peak_rss": peak_rss_bytes()}


def _micro(batches: list[dict], job: Job, step: int) -> list[dict]:
    return batches[step * job.gas:(step + 1) * job.gas]


def _check_len(rank, batches, job):
    if len(batches) < job.steps * job.gas:
        raise ValueError(f"rank {rank}: need steps·gas = {job.steps * job.gas} micro-batches, got {len(batches)}")


def train_one(rank: int, job: Job, init_state: dict | None, batches: list[dict], t_launch: float | None = None,
              seed: int = 0) -> dict:
    """Train job.steps optimizer steps on this rank; return per-step records and full parameters."""
    _check_len(rank, batches, job)
    run, t_first = Runner(rank, job, init_state, seed), None
    for step in range(job.steps):
        run.step(_micro(batches, job, step))
        if t_first is None and t_launch is not None:
            t_first = time.time() - t_launch
    return run.result(t_first)


def train_lockstep(rank: int, ref: Job, ours: Job, init_state: dict | None, batches: list[dict],
                   seed: int = 0) -> tuple[dict, dict]:
    """Both engines side by side in these processes, one step each in turn; after every step the
    max |Δparam| between them (full parameters, gathered under ZeRO-3) goes into ours' record."""
    _check_len(rank, batches, ours)
    a, b = Runner(rank, ref, init_state, seed), Runner(rank, ours, init_state, seed)
    for step in range(ours.steps):
        a.step(_micro(batches, ref, step))
        rec = b.step(_micro(batches, ours, step))
        pa, pb = a.full_params(), b.full_params()
        rec["max_dparam"] = max(((pa[n] - pb[n]).abs().max().item() for n in pa if pa[n].numel()), default=0.0)
    return a.result(), b.result()


def train_jobs(rank: int, world_size: int, jobs: list[Job], init_states: dict, batches: dict,
               t_launch: float | None = None, seed: int = 0, env: dict | None = None,
               lockstep: bool = False) -> list[dict]:
    """spawn target: run every job in turn in these same processes (imports and DeepSpeed's
    start-up are paid once, which keeps the test suite inside its time budget). With lockstep,
    jobs are (reference, ours) pairs trained side by side (train_lockstep)."""
    os.environ.update(env or {})  # e.g. TORCH_EXTENSIONS_DIR, for these jobs only
    warnings.filterwarnings("ignore", message=r".*torch\.distributed\.\w+` is deprecated")  # DeepSpeed's calls

    def data(j):
        return batches[j.model, j.config["train_micro_batch_size_per_gpu"]]
    if lockstep:
        return [r for a, b in zip(jobs[::2], jobs[1::2])
                for r in train_lockstep(rank, a, b, init_states.get(b.model), data(b), seed)]
    return [train_one(rank, j, init_states.get(j.model), data(j), t_launch, seed) for j in jobs]


def run_jobs(jobs: list[Job], world_size: int, *, seed: int = 0, timeout: float = 300.0,
             batches: dict | None = None, init_states: dict | None = None, env: dict | None = None,
             lockstep: bool = False) -> list[dict]:
    """Run `jobs` on `world_size` fresh ranks (one spawn); return rank 0's result per job.

    Every job on the same model starts from the same state_dict (built here once, seeded) and
    sees the same global micro-batches (rank r takes rows r·m … (r+1)·m of each)."""
    init_states = dict(init_states or {})
    batches = dict(batches or {})
    for j in jobs:
        if j.model not in init_states:
            torch.manual_seed(seed)
            init_states[j.model] = {k: v.clone() for k, v in build_model(j.model).state_dict().items()}
        mb = j.config["train_micro_batch_size_per_gpu"]
        key = (j.model, mb)
        need = max(jj.steps * jj.gas for jj in jobs if jj.model == j.model)
        if key not in batches:
            if j.model not in MODELS:
                raise ValueError(f"model {j.model!r}: pass its batches as batches[(model, micro_bs)]")
            batches[key] = make_batches(j.model, need, mb * world_size, seed=seed + 1)
        elif len(batches[key]) < need:
            raise ValueError(f"batches[{key}] has {len(batches[key])} micro-batches, jobs need {need}")
    t0 = time.time()
    res = spawn(train_jobs, world_size, timeout=timeout, comm_timeout=120.0,
                args=(list(jobs), init_states, batches, t0, seed, env, lockstep))
    out = []
    for i, r0 in enumerate(res[0]):
        r0["params"] = {n: torch.from_numpy(p) for n, p in r0["params"].items()}
        r0["peak_rss_per_rank"] = [res[r][i]["peak_rss"] for r in range(world_size)]
        out.append(r0)
    return out
