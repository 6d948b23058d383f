"""initialize(model, model_parameters, config) → a ZeRO engine driven exactly like DeepSpeed's.

    torchrun --standalone --nproc_per_node 2 -m zero_from_scratch.engine.demo --stage 2
    deepspeed --num_gpus 2 --module zero_from_scratch.engine.demo --stage 2

    engine, optimizer, _, lr_scheduler = zero_from_scratch.initialize(
        model=model, model_parameters=model.parameters(), config="ds_config.json")
    loss = engine(**batch).loss; engine.backward(loss); engine.step()   # step() after every micro-batch

What one optimizer step does (the stages: stage1/2/3.py, engine/stages.py, engine/stage3.py; the step: step.py):
  backward   loss ÷ gradient_accumulation_steps × loss_scale, autograd, gradient hooks fill the
             stage's gradient storage; at the boundary (stage 1) or every micro-batch (2, 3) the
             gradients are reduce-scattered: each rank ends with the SUM of its shard.
  step       norm² of the local shard (fp64), one 8-byte all-reduce → the global norm (padding is
             zero, so uneven shards are exact; eps is added once, after the sum; +8 bytes when a
             monitor is on: the mean loss rides along; with an mpu, one more 8-byte all-reduce
             over the model-parallel group, replicated parameters counted once); overflow → skip;
             grads × clip_coef / (N · loss_scale); Adam on the owned shard; stages 1-2 all-gather
             the updated shards.
overlap_comm (zero_keys.ZERO_KEYS lists what every zero_optimization key does here): the gradient reduce-scatters
start from the hooks on a communication thread and are waited for at the end of backward; stage 3 also prefetches
parameters along the traced module order. Same bytes, same bits; comm_report() times each asynchronous collective.
Device: every buffer, shard, gradient and Adam state lives on the parameters' device (one device per model,
else a ValueError naming the parameters on each), except with offload_optimizer: "cpu" keeps the fp32 master
and Adam states on the host, "nvme" in files (offload.py). Every rank must call forward/backward/step the
same number of times (the collectives pair up). DeepSpeed's client-facing surface: client optimizer objects /
callables (at stage 0 in fp32 the object handed back) and LR schedulers (client_optim.py, optimizers.py),
initialize(training_data=, args=), torch.distributed start-up, ranks, module forwarding, no_sync, destroy,
save_16bit_model (surface.py), the boundary (managed or the caller's step()), scale() and a plain loss.backward()
(z_ua_boundary.py), coalesce_grad_reduction (coalesce.py), safe_get_*/safe_set_* (safe_api.py), checkpoints, leaf.py.
"""
from __future__ import annotations

import contextlib
import random
import warnings

import torch
import torch.nn as nn

from zero_from_scratch.engine import checkpoint as ckpt
from zero_from_scratch.engine.coalesce import CoalesceGradReduction
from zero_from_scratch.engine.comm import Comm, reset_all
from zero_from_scratch.engine.config import load_config
from zero_from_scratch.engine.external import ExternalParams
from zero_from_scratch.engine.frozen import FrozenParams
from zero_from_scratch.engine.mixed_cast import MixedPrecisionCast
from zero_from_scratch.engine.monitor import Monitors
from zero_from_scratch.engine.mpu import check as mpu_check
from zero_from_scratch.engine.mpu import counted_ranges
from zero_from_scratch.engine.lr_schedules import build_scheduler
from zero_from_scratch.engine import client_optim, leaf, ledger, moe_grads, moe_params, offload, safe_api, surface, wall_clock, z3_grads
from zero_from_scratch.engine.z_ua_boundary import AccumulationBoundary, check_config
from zero_from_scratch.engine.params import broadcast_module_state, module_units, param_device, param_groups
from zero_from_scratch.engine.precision import build_loss_scaler, model_dtype
from zero_from_scratch.sharding import bucket_units
from zero_from_scratch.engine.stage3 import ZeroStage3
from zero_from_scratch.engine.stages import ZeroStage0, ZeroStage1, ZeroStage2
from zero_from_scratch.engine.step import client_step, optimizer_step, sync_steps
from zero_from_scratch.engine.zero_partition import refuse_below_stage3, release_from_other_engines, true_shapes
from primitives.log import print0

_STAGES = {0: ZeroStage0, 1: ZeroStage1, 2: ZeroStage2, 3: ZeroStage3}


class ZeroEngine(AccumulationBoundary, CoalesceGradReduction, MixedPrecisionCast, surface.DeepSpeedSurface, nn.Module):
    def __init__(self, model: nn.Module, model_parameters=None, config=None, comm_impl: str = "primitives",
                 mpu=None, optimizer=None, lr_scheduler=None):
        super().__init__()
        if not isinstance(model, nn.Module):
            raise TypeError(f"initialize(model=...) must be a torch.nn.Module, got {type(model).__name__}")
        if config is None:
            raise ValueError("initialize(config=...) is required: a DeepSpeed JSON path or dict")
        self.device = param_device(model)
        # mpu (mpu.py): ZeRO runs over the data-parallel group; the model-parallel group only
        # sums the gradient norm and names checkpoint files
        self.parallel = mpu_check(mpu) if mpu is not None else None
        self.comm = Comm(comm_impl, self.parallel.dp_group if self.parallel else None)
        self.comm.device = self.device
        self.mp = None
        if self.parallel and self.parallel.mp_size > 1:
            self.mp = Comm(comm_impl, self.parallel.mp_group)
            self.mp.device = self.device
        self.config = load_config(config, self.comm.size)
        check_config(self.config)                    # managed_gradient_accumulation=False's checks (z_ua_boundary.py)
        if self.mp is not None and self.config.zero.zero_hpz_partition_size > 1:
            raise ValueError(f"rank {self.comm.global_rank}: zero_optimization.zero_hpz_partition_size > 1 with an "
                             "mpu: hpZ builds its groups from the world; use 1 with model parallelism")
        for msg in self.config.zero.notes:           # accepted keys that do not act here: say so, once
            if self.comm.global_rank == 0:
                warnings.warn(f"zero_from_scratch: {msg}", stacklevel=3)
        if self.config.resolved_auto and self.comm.global_rank == 0:
            print0("[zero_from_scratch] \"auto\" resolved: "
                   + ", ".join(f"{k}={v}" for k, v in self.config.resolved_auto.items()))
        from zero_from_scratch.engine import activation_checkpointing as ac   # the config's section, applied
        self.activation_checkpointing = ac.apply(model, self.config.activation_checkpointing, self.comm.rank)
        self.dtype = model_dtype(self.config)
        self.mixed = self.dtype != torch.float32
        self.module = model
        self.cast_for_training()   # parameters to the 16-bit dtype, buffers as loaded (mixed_cast.py)
        self.stage_id = self.config.zero.stage
        self.client_optimizer = client_optim.resolve_client(optimizer, model_parameters, model)   # client_optim.py
        # client_optim.plan, after DeepSpeed's MoE set-up (its layers' groups, its param groups: moe_params.py)
        names, hypers, kind, w_mode, shared = moe_params.plan(self, model, model_parameters, param_groups)
        self.group_names = names
        self.params_by_name = dict((n, p) for n, p in model.named_parameters() if any(n in g for g in names))
        for n, p in self.params_by_name.items():
            if not p.is_floating_point():
                raise TypeError(f"parameter {n!r} has dtype {p.dtype}; ZeRO shards floating-point parameters only")
        broadcast_module_state(self.comm, model)
        release_from_other_engines(model, self.comm.global_rank)   # another engine's shards: to zero.Init's form
        refuse_below_stage3(model, self.stage_id, self.comm.global_rank)   # zero.Init shards: ZeRO-3 only
        if self.stage_id == 3:
            units = true_shapes(module_units(model, names), model)   # zero.Init: ds_shape (zero_partition.py)
        else:
            shapes = [[(n, tuple(self.params_by_name[n].shape)) for n in g] for g in names]
            units = bucket_units(shapes, self.config.zero.reduce_bucket_size)
        self.layout = moe_grads.layout(self, units, 1 if self.stage_id == 0 else self.comm.size)   # shard_layout
        self.stage = _STAGES[self.stage_id](self)
        self.frozen = FrozenParams(self)   # requires_grad=False: never in the optimizer; sharded at stage 3
        leaf.install(self)                   # ZeRO-3 leaf modules: each gathered whole (leaf.py)
        self.external = ExternalParams(self)   # stage 3: params used outside their module (external.py)
        # offload_optimizer (offload.py): nvme keeps the states in files (none allocated here),
        # cpu on the host (offload.HostOptimizerStates: pinned, next to its own fp32 master)
        self.offload = offload.build(self, self.config.offload_optimizer, self.config.sub_group_size)
        host = hasattr(self.offload, "adopt")
        in_ram = [0] * len(self.layout.group_local) if self.offload and not host else list(self.layout.group_local)
        self.optimizer = client_optim.build(kind, hypers, in_ram, w_mode, shared)
        z3_grads.install(self)                       # stage 3: DeepSpeed's averaged_gradients
        for st in self.optimizer.state:              # the states live with the shards they update
            for k in self.optimizer.STATE:
                st[k] = self.offload.adopt(st[k]) if host else st[k].to(self.device)
        self.master = None if not self.mixed else (   # host: checkpoints read/write it where it lives
            self.offload.master if host else [torch.zeros(n, dtype=torch.float32, device=self.device) for n in in_ram])
        self.refresh_master()
        self.basic_optimizer = client_optim.serve_basic(self, self.client_optimizer, names, w_mode, client_step)
        self.norm_ranges = counted_ranges(self, self.mp.rank) if self.mp is not None else moe_grads.norm_ranges(self)
        self.lr_scheduler = (build_scheduler(self.config.scheduler, self.optimizer) if lr_scheduler is None
                             else surface.client_scheduler(self, lr_scheduler))   # a client's replaces the config's
        self.loss_scaler = build_loss_scaler(self.config)
        self.optimizer.loss_scaler, self.optimizer.engine_backward = self.loss_scaler, self.backward
        self._boundary_override = self._global_grad_norm = None   # the former: set_gradient_accumulation_boundary
        self.tput_timer = surface.ThroughputTimer(self.config.train_batch_size)
        safe_api.register(self)                      # safe_get_full_* find the engine from the parameter
        self.micro_steps = self.global_steps = self.skipped_steps = self.global_samples = 0
        self.monitor = Monitors(self.config.monitor, self.comm, self.config.train_batch_size)  # tensorboard/csv
        self.instruments = wall_clock.install(self)   # steps_per_print, wall_clock_breakdown, comms_logger
        reset_all(self)

    # ------------------------------------------------------------------ DeepSpeed's API
    def forward(self, *args, **kwargs):
        if self.stage_id != 3:
            return self.watch_outputs(self.module(*args, **kwargs))   # a plain backward (z_ua_boundary.py)
        self.stage.forward_done()
        with self.stage.saved.active(), self.external.guard():
            return self.watch_outputs(self.module(*args, **kwargs))

    def backward(self, loss: torch.Tensor, retain_graph: bool = False, scale_wrt_gas: bool = True):
        if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
            raise TypeError("engine.backward(loss) needs a scalar loss tensor")
        boundary = self.backward_boundary()            # False inside no_sync (surface.py)
        scaled = loss.float()
        if self.gradient_accumulation_steps() > 1 and scale_wrt_gas:
            scaled = scaled / self.gradient_accumulation_steps()
        if self.loss_scaler.loss_scale * self.config.reduction.pre != 1.0:   # pre: grad_keys.py
            scaled = scaled * (self.loss_scaler.loss_scale * self.config.reduction.pre)
        self.stage.before_backward(boundary)
        with self.engine_backward():                  # counted when unmanaged (z_ua_boundary.py)
            scaled.backward(retain_graph=retain_graph)
        self._after_backward(boundary)
        self.monitor.record_loss(loss)
        gas = self.gradient_accumulation_steps()     # DeepSpeed returns the loss divided as its gradients are
        return loss / gas if gas > 1 and scale_wrt_gas else loss

    def step(self, lr_kwargs=None) -> None:
        self.check_step()
        with self.boundary_step():                    # unmanaged: this call is the boundary (z_ua_boundary.py)
            if self.is_gradient_accumulation_boundary():
                self.lr_kwargs = lr_kwargs            # DeepSpeed's: passed to lr_scheduler.step (step.py)
                self._optimizer_step()
                self.optimizer.micro_step_id = 0      # DeepSpeed's counter (coalesce.py)
            self.tput_timer.stop(global_step=self.is_gradient_accumulation_boundary())
        self.micro_steps += 1

    def zero_grad(self) -> None:
        self.stage.zero_grad()

    allreduce_gradients = z3_grads.allreduce_gradients   # DeepSpeed's (z3_grads.py)

    # DeepSpeed's read-only accessors, so code written against DeepSpeedEngine can report them
    def train_batch_size(self) -> int:
        return self.config.train_batch_size

    def train_micro_batch_size_per_gpu(self) -> int:
        return self.config.train_micro_batch_size_per_gpu

    def zero_optimization_stage(self) -> int:
        return self.stage_id

    def gradient_clipping(self) -> float:
        return self._config.gradient_clipping

    def fp16_enabled(self) -> bool:
        return self.config.fp16.enabled

    def bf16_enabled(self) -> bool:
        return self.config.bf16
    bfloat16_enabled = bf16_enabled   # DeepSpeed 0.19.8's name for it

    def get_lr(self) -> list[float]:
        return [g["lr"] for g in self.optimizer.param_groups]

    def get_global_grad_norm(self):
        return self._global_grad_norm

    def train(self, mode: bool = True):
        self.module.train(mode)
        self.training = mode
        return self

    def gathered_parameters(self, params, modifier_rank=None):
        """Context manager: full parameters inside (stage 3); all ranks must enter it."""
        if isinstance(params, torch.Tensor):
            params = [params]
        return self._gathered(list(params), modifier_rank)

    @contextlib.contextmanager
    def _gathered(self, params, modifier_rank):
        with self.frozen.gathered(params, modifier_rank), self.stage.gathered(params, modifier_rank):
            yield

    # ------------------------------------------------------------------ the optimizer step
    def refresh_master(self) -> None:
        """fp32 master shards ← the model-dtype shards (after init or an edit of the weights)."""
        if self.offload is not None:
            return self.offload.write_master()
        if self.mixed:
            for u in self.layout.units:
                self.master[u.group][u.local_offset:u.local_offset + u.shard].copy_(self.stage.param_shard(u))

    _optimizer_step = optimizer_step
    _zero_init_paused = True   # built inside zero.Init: its tensor work is not construction (zero_init.py)

    # ------------------------------------------------------------------ reports and checkpoints
    def memory_report(self, print_table: bool = True) -> dict:
        return ledger.memory_report(self, print_table)

    def comm_report(self, print_table: bool = True) -> dict:
        return ledger.comm_report(self, print_table)

    def save_checkpoint(self, save_dir: str, tag=None, client_state=None, exclude_frozen_parameters: bool = False) -> str:
        moe_params.refuse_checkpoint(self, "save")
        with self.frozen.full(), (self.offload.in_memory() if hasattr(self.offload, "in_memory")
                                  else contextlib.nullcontext()):
            return ckpt.save(self, save_dir, tag, client_state or {}, exclude_frozen_parameters)

    def load_checkpoint(self, load_dir: str, tag=None, load_module_strict: bool = True, load_optimizer_states: bool = True,
                        load_lr_scheduler_states: bool = True, load_module_only: bool = False, custom_load_fn=None,
                        reshard: bool = False):
        """DeepSpeed's signature and order; load_module_strict/_only and custom_load_fn: surface.load_args."""
        moe_params.refuse_checkpoint(self, "load")
        load_optimizer_states, load_lr_scheduler_states = surface.load_args(
            self, load_module_strict, load_optimizer_states, load_lr_scheduler_states, load_module_only, custom_load_fn)
        with self.frozen.full(write_back=True), (self.offload.in_memory() if hasattr(self.offload, "in_memory")
                                                 else contextlib.nullcontext()):
            out = ckpt.load(self, load_dir, tag, load_optimizer_states, load_lr_scheduler_states, reshard)
        if hasattr(self.offload, "after_load"):
            self.offload.after_load()    # cpu offload in fp32: the host master follows the loaded params
        self.stage.after_load()      # stage 3: drop gathered copies of the old weights
        sync_steps(self)
        return out

    def rng_state(self) -> dict:
        return {"torch": torch.get_rng_state(), "python": random.getstate()}


def initialize(args=None, model=None, optimizer=None, model_parameters=None, training_data=None, lr_scheduler=None,
               distributed_port=None, mpu=None, dist_init_required=None, collate_fn=None, config=None,
               mesh_param=None, config_params=None, comm_impl: str = "primitives", **kwargs):
    """deepspeed.initialize: returns (engine, optimizer, training_dataloader, lr_scheduler).
    optimizer: a client optimizer object or callable (client_optim.py), else the config's;
    lr_scheduler: a client scheduler object or callable(optimizer), else the config's;
    training_data: a Dataset → DeepSpeed's distributed loader (dataloader.py); torch.distributed is
    started when nobody started it (surface.py). mpu: DeepSpeed's model-parallel unit (mpu.py).
    What each argument does here: zero_keys.INITIALIZE_ARGS."""
    if kwargs:
        raise TypeError(f"initialize() got unexpected arguments {sorted(kwargs)}")
    if mesh_param is not None:
        raise NotImplementedError("initialize(mesh_param=...) is not implemented here; DeepSpeed would build a "
                                  "data × sequence parallel device mesh. Use mpu= (primitives.mesh.Mesh.mpu())")
    if model is None:
        raise ValueError("initialize(model=...) is required (DeepSpeed asserts 'deepspeed.initialize requires a model')")
    config = surface.resolve_config(args, config, config_params)
    if dist_init_required is not False:
        surface.start_distributed(comm_impl, distributed_port)
    engine = ZeroEngine(model, model_parameters, config, comm_impl, mpu, optimizer, lr_scheduler)
    if hasattr(args, "local_rank"):
        args.local_rank = engine.local_rank          # DeepSpeed writes it back too
    loader = engine.deepspeed_io(training_data, collate_fn=collate_fn) if training_data is not None else None
    return engine, engine.basic_optimizer, loader, engine.lr_scheduler
