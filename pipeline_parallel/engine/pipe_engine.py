"""PipelineEngine: one rank's stage trained by train_batch, as DeepSpeed's (initialize builds it: engine/ds_pipe.py).

    torchrun --standalone --nproc_per_node 4 pipeline_parallel/train.py --pp 2 --dp 2 --schedule 1f1b
    deepspeed --num_gpus 4 pipeline_parallel/train.py --pp 2 --engine ours

    engine, optimizer, _, sched = pipeline_parallel.initialize(model=pipe_module, config="ds_config.json")
    loss = engine.train_batch(data_iter)      # one optimizer step over m micro-batches, mean loss on every rank
    loss = engine.eval_batch(data_iter)       # forward only

World = pp × dp (primitives.mesh, data fastest: DeepSpeed's PipeDataParallelTopology), or pp × dp × tp
with a caller-built mesh (classification/parallel/train.py --pp). Each data replica reads its own
iterator; its first and last stage both pull m micro-batches (inputs, labels) per step, as DeepSpeed's.
Every tensor of a step lives on the stage's device (stage_device: cuda:LOCAL_RANK under nccl).

One step, per rank (p stages, m micro-batches, Ψ_s = this stage's parameters, A = activation bytes):
  schedule        the textbook schedule run by the textbook executor inside engine/draining.py's
                  guards: 2·m·A bytes sent per inner boundary side
  reduce_tied     tied weights: each holder sends its gradient to the other holders (k−1)·Ψ_tied
  reduce_grads    one coalesced all-reduce of the stage's gradients over dp (2(dp−1)/dp·Ψ_s), ÷ dp;
                  under ZeRO-1 a reduce-scatter, and the step all-gathers the shards (engine/zero1.py)
  step            one 24-byte all-reduce over the world (errors, loss, norm²), clip, optimizer, scheduler
  (tp > 1: the layers' own collectives inside fwd / bwd, over mesh.tp_group)
After each train_batch, engine.step_bytes = data bytes this rank sent, by axis: {"tp": fwd + bwd,
"pp": the boundary sends + tied reductions, "dp": reduce_grads} (the ledger, per instruction).
"""
from __future__ import annotations

import contextlib

import os

import torch
import torch.distributed as dist

from pipeline_parallel.engine.checkpoint import load_checkpoint, save_checkpoint
from pipeline_parallel.engine.config import engine_optimizer
from pipeline_parallel.engine.draining import DrainingExecutor
from pipeline_parallel.engine.layers import TiedWeights
from pipeline_parallel.engine.module import PipelineModule
from pipeline_parallel.engine.simulator import programs
from pipeline_parallel.engine.step import MixedPrecision, StepReport, build_scaler, take_step
from pipeline_parallel.engine.zero1 import Zero1
from pipeline_parallel.schedules import build
from primitives import LEDGER, all_gather_object, all_reduce, get_comm
from primitives.coalesced import all_reduce_coalesced
from primitives.mesh import Mesh
from zero_from_scratch.engine.activation_checkpointing import checkpoint as non_reentrant_checkpoint
from zero_from_scratch.engine.precision import model_dtype
from zero_from_scratch.engine.lr_schedules import build_scheduler

def stage_device(module, comm) -> torch.device:
    """The stage's device: cuda:LOCAL_RANK under nccl (DeepSpeed's get_accelerator().device_name(local_rank)),
    else where the module's parameters are (cpu under gloo)."""
    if comm.backend == "nccl":
        dev = torch.device("cuda", int(os.environ.get("LOCAL_RANK", torch.cuda.current_device())))
        torch.cuda.set_device(dev)
        return dev
    p = next(module.parameters(), None)
    return p.device if p is not None else torch.device("cpu")


class PipelineError(RuntimeError):
    """Raised on every rank when any rank failed during a step; lists each failing rank's error."""


class PipelineEngine:
    def __init__(self, model: PipelineModule, cfg, mesh: Mesh, model_parameters=None):
        self.module, self.cfg, self.mesh = model, cfg, mesh
        self.pp, self.dp, self.tp, self.v = mesh.layout.pp, mesh.layout.dp, mesh.layout.tp, cfg.virtual_stages
        self.stage, self.dp_rank, self.tp_rank, self.rank = mesh.index("pp"), mesh.index("dp"), mesh.index("tp"), mesh.rank
        self.micro_batches, self.micro_batch_size = cfg.micro_batches, cfg.run.train_micro_batch_size_per_gpu
        self.schedule = cfg.schedule
        self.comm = get_comm(mesh.pp_group)
        self.dp_comm = get_comm(mesh.dp_group) if self.dp > 1 else None
        self._nccl_programs: dict = {}
        self.chunks = model.stage_chunks(self.stage, self.pp, self.v)
        self.device = stage_device(model, self.comm)
        model.to(self.device)          # as DeepSpeed's initialize: the stage on its device, before any collective
        self.loss_fn = model.loss_fn
        self.params = [p for p in model.parameters() if p.requires_grad]     # DeepSpeed's order: tied modules first
        self.tied = TiedWeights(self)
        self.tied.broadcast_initial()
        zero1 = cfg.run.zero.stage == 1
        self.mixed = (MixedPrecision(self, masters=not zero1)                  # bf16 / fp16 (engine/step.py)
                      if model_dtype(cfg.run) != torch.float32 else None)
        self.zero1 = Zero1(self, offload=cfg.run.offload_optimizer is not None) if zero1 else None
        self.clip_norm = cfg.clip_norm
        self.optimizer = engine_optimizer(self, model_parameters)
        self.lr_scheduler = build_scheduler(cfg.run.scheduler, self.optimizer)
        self.executor = DrainingExecutor(self)
        self.report = StepReport(self)             # steps_per_print, tensorboard / csv_monitor
        self.global_steps, self.global_grad_norm, self.global_samples, self.skipped_steps = 0, None, 0, 0
        self.scaler = build_scaler(cfg.run)
        self._errors: list = []
        self._broken = None
        self.timeline, self.peak_activation_bytes, self.step_bytes = [], 0, {}
        self.measure_activations = True   # saved_tensors_hooks per micro-batch (off: an outer meter measures)

    # ------------------------------------------------------------------ error bookkeeping
    def fail(self, msg):
        self._errors.append(msg)

    def failed_locally(self) -> bool:
        return bool(self._errors)

    def is_first_stage(self) -> bool:
        return self.stage == 0

    def is_last_stage(self) -> bool:
        return self.stage == self.pp - 1

    def set_dataiterator(self, iterator) -> None:
        """DeepSpeed's: the iterator train_batch() / eval_batch() read when called without one."""
        self.data_iterator = iterator

    # ------------------------------------------------------------------ public API
    def train_batch(self, data_iter=None):
        """One optimizer step over m micro-batches; returns the mean loss as a 0-dim tensor on every
        rank (DeepSpeed's agg_train_loss). data_iter None: the iterator initialize(training_data=) made."""
        return torch.tensor(self._batch(data_iter, train=True), device=self.device)

    def eval_batch(self, data_iter=None, return_logits=False, compute_loss=True, reduce_output="avg", **kwargs):
        """DeepSpeed's signature; the mean loss over the m micro-batches (reduce_output 'avg'); without a
        loss_fn, DeepSpeed's too: the last stage's outputs averaged over micro-batches and replicas, on every rank."""
        if return_logits or not compute_loss or reduce_output != "avg" or kwargs:
            raise NotImplementedError(f"rank {self.rank}: eval_batch(return_logits={return_logits}, compute_loss="
                                      f"{compute_loss}, reduce_output={reduce_output!r}, {sorted(kwargs)}): only the "
                                      "averaged loss is returned here (DeepSpeed can also return the last stage's "
                                      "logits or per-micro-batch losses)")
        if self.loss_fn is not None:
            with torch.no_grad():
                return torch.tensor(self._batch(data_iter, train=False), device=self.device)
        outs, out, self.executor.loss_fn = [], [None] * dist.get_world_size(), \
            lambda y, _labels: (outs.append(y.detach().cpu()), y.new_zeros(()))[1]
        try:
            with torch.no_grad():
                self._batch(data_iter, train=False)
        finally:
            self.executor.loss_fn = None
        all_gather_object(out, sum(outs) / len(outs) if outs and self.tp_rank == 0 else None)
        return (sum(o for o in out if o is not None) / sum(o is not None for o in out)).to(self.device)

    def _batch(self, data_iter, train):
        if self._broken:
            raise PipelineError(f"rank {self.rank}: this engine failed in an earlier step and cannot continue:\n{self._broken}")
        self._errors = []
        inputs, labels = self._pull(data_iter if data_iter is not None else getattr(self, "data_iterator", None))
        for ch in self.chunks:
            ch.train(train)
        self._status = None
        self.executor.run(self.program(train), inputs, labels, train)
        if not train:
            self.step_status(norm_sq=0.0)
        if train:                      # what the last *training* step did (eval saves nothing)
            self.timeline = self.executor.events
            by = self.executor.sent
            self.step_bytes = {"tp": by.get("fwd", 0) + by.get("bwd", 0), "dp": by.get("reduce_grads", 0)
                               + by.get("step", 0),      # the step's data bytes: ZeRO-1's all-gather
                               "pp": sum(v for k, v in by.items() if k.startswith(("send", "recv", "reduce_tied")))}
            self.peak_activation_bytes = self.executor.meter.peak
            self.report.after_step(self, self._status)
        return self._status

    def program(self, train: bool) -> list:
        """This rank's instruction list: the textbook schedule, built each step (microseconds); under
        nccl's ordering (the nccl backend, or strict mode replaying it over gloo) the order
        engine/simulator.py legalises once, so per-peer queues pair up."""
        if self.comm.backend != "nccl" and not self.comm.strict:
            return build(self.schedule, self.stage, self.pp, self.micro_batches, self.v, train=train)
        if train not in self._nccl_programs:
            self._nccl_programs[train] = programs(self.schedule, self.pp, self.micro_batches, self.v, train=train,
                                                  backend="nccl")[self.stage]
        return self._nccl_programs[train]

    def _pull(self, data_iter):
        """First and last stage pull m micro-batches of (inputs, labels) from this replica's iterator."""
        inputs, labels = {}, {}
        if not (self.is_first_stage() or self.is_last_stage()):
            return inputs, labels
        if data_iter is None:
            self.fail(f"stage {self.stage} needs a data iterator (first and last stages read it), got None")
            return inputs, labels
        for mb in range(self.micro_batches):
            try:
                item = next(data_iter)
            except StopIteration:
                self.fail(f"data iterator ran dry at micro-batch {mb} of {self.micro_batches} "
                          f"(stage {self.stage}, data replica {self.dp_rank})")
                break
            if not (isinstance(item, (tuple, list)) and len(item) == 2 and torch.is_tensor(item[0])):
                self.fail(f"micro-batch {mb} is {type(item).__name__}; expected a pair (inputs, labels), inputs a tensor")
                break
            # DeepSpeed's _exec_load_micro_batch: tensors moved to the device, a label of another type kept
            inputs[mb], labels[mb] = (t.to(self.device) if torch.is_tensor(t) else t for t in item)
            if self._reentrant_activation_checkpointing() and inputs[mb].is_floating_point():
                inputs[mb] = inputs[mb].detach().requires_grad_()     # else the first group is cut off from autograd
        return inputs, labels

    save_checkpoint, load_checkpoint = save_checkpoint, load_checkpoint    # DeepSpeed's pipeline layout (engine/checkpoint.py)

    # ------------------------------------------------------------------ end-of-step ops (called by the executor)
    def reduce_grads(self):
        """Average the stage's gradients over the data-parallel replicas: one coalesced all-reduce
        (sum; a parameter without a gradient contributes zeros), then ÷ dp."""
        if self.zero1 is not None:         # reduce-scatter: each replica keeps the slice it owns
            return self.zero1.reduce_grads()
        if self.dp == 1:
            return
        for p in self.params:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
        grads = [p.grad for p in self.params]
        all_reduce_coalesced(self.dp_comm, grads, "sum")
        for g in grads:
            g.div_(self.dp)

    def step(self):
        """Norm, clipping, optimizer and loss-scale update (engine/step.py)."""
        take_step(self)

    @contextlib.contextmanager
    def coalesce_grad_reduction(self):
        """DeepSpeed's PipelineEngine inherits the block and refuses it on entering the `with`
        (runtime/engine.py): its stage check first, then the pipeline's, both NotImplementedError
        (managed_gradient_accumulation false is refused at start-up, config.py, as DeepSpeed's)."""
        stage = self.cfg.run.zero.stage
        if stage not in (1, 2, 3):
            raise NotImplementedError(f"coalesce_grad_reduction requires ZeRO stage 1/2/3, got stage {stage}")
        raise NotImplementedError("coalesce_grad_reduction is not supported under pipeline parallelism")
        yield                                  # a generator, so the call itself returns the block (DeepSpeed's)

    @property
    def loss_scale(self) -> float:
        return self.scaler.cur_scale if self.scaler is not None else 1.0

    # DeepSpeed's engine queries (the step report's monitors read them)
    loss_scaler = property(lambda self: self.scaler)

    def get_lr(self) -> list:
        return [g["lr"] for g in self.optimizer.param_groups]

    def fp16_enabled(self) -> bool:
        return self.scaler is not None

    def get_global_grad_norm(self):
        return self.global_grad_norm

    config = property(lambda self: self.cfg.raw, doc="the config as given to initialize")

    def _reentrant_activation_checkpointing(self) -> bool:
        """Must stage 0's inputs require grad? Under a reentrant function (DeepSpeed's default, or a
        client's own); ringzero's default (None) and non_reentrant_checkpoint are torch's non-reentrant one."""
        func = self.module.activation_checkpoint_func
        return self.module.activation_checkpoint_interval > 0 and func not in (None, non_reentrant_checkpoint)

    def step_status(self, norm_sq: float):
        """One world all-reduce of (failed ranks, loss sum, norm²): every rank learns the step's
        outcome; on failure every rank gathers the messages and raises the same PipelineError."""
        last = self.is_last_stage() and self.tp_rank == 0      # tp ranks hold the same loss: count one
        status = torch.tensor([1.0 if self._errors else 0.0, self.executor.loss_sum if last else 0.0, norm_sq],
                              dtype=torch.float64, device=self.device)
        with LEDGER.control_traffic():
            all_reduce(status)
            if status[0] > 0:
                mine = "; ".join(m for m in self._errors if m)
                msgs = [None] * dist.get_world_size()         # every rank's message, whole
                all_gather_object(msgs, f"rank {self.rank} (stage {self.stage}, replica {self.dp_rank}): {mine}"
                                  if mine else "")
                self._broken = "\n".join(f"  {m}" for m in msgs if m)
                raise PipelineError(f"rank {self.rank}: the pipeline step failed on {int(status[0])} rank(s):\n{self._broken}")
        self._status = float(status[1]) / (self.micro_batches * self.dp)
        self.global_grad_norm = float(status[2]) ** 0.5
