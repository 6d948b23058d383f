"""DeepSpeedEngine's surface that real clients touch, on ZeroEngine: ranks, the device, attribute
lookups forwarded to the wrapped module, no_sync, destroy,
deepspeed_io, the throughput timer, the 16-bit model save; and initialize's argument handling (args.deepspeed_config,
starting torch.distributed, the client LR scheduler).

    engine, optimizer, loader, sched = zero_from_scratch.initialize(args=args, model=m, training_data=ds)
    with engine.no_sync(): engine.backward(loss)                  # stages 0-1: kept on the rank

Each follows DeepSpeed 0.19.8's runtime/engine.py (named in the docstrings). Cost: none per step.
"""
from __future__ import annotations

import contextlib
import logging
import os
import stat
import time
import warnings

import torch
import torch.distributed as dist

from primitives.engine import registry
from primitives.launch import init_from_env
from primitives.log import print0
from zero_from_scratch.engine.atomic import atomic_write
from zero_from_scratch.engine.dataloader import DeepSpeedDataLoader
from zero_from_scratch.engine import offload_states
from zero_from_scratch.engine.mpu import engine_mp


class ThroughputTimer:
    """DeepSpeed's engine.tput_timer (utils/timer.py), its state machine without the logging: start()
    marks it initialized and started, and times from then once `start_step` global steps are done;
    stop() counts a micro step (a global one when global_step), adds the time to total and step
    elapsed (the latter reset at each global step); avg_samples_per_sec over the timed steps."""

    def __init__(self, batch_size: int, start_step: int = 2):
        self.batch_size = 1 if batch_size is None else batch_size
        self.start_step, self.start_time, self.end_time, self.started, self.initialized = start_step, 0, 0, False, False
        self.epoch_count = self.micro_step_count = self.global_step_count = 0
        self.total_elapsed_time = self.step_elapsed_time = 0

    def update_epoch_count(self) -> None:
        self.epoch_count += 1
        self.micro_step_count = 0

    def start(self) -> None:
        self.initialized = self.started = True
        if self.global_step_count >= self.start_step:
            self.start_time = time.time()

    def stop(self, global_step: bool = False, report_speed: bool = True) -> None:
        if not self.started:
            return
        self.started = False
        self.micro_step_count += 1
        if global_step:
            self.global_step_count += 1
        if self.start_time > 0:
            self.end_time = time.time()
            duration = self.end_time - self.start_time
            self.total_elapsed_time += duration
            self.step_elapsed_time += duration
            if global_step:
                self.step_elapsed_time = 0

    def avg_samples_per_sec(self) -> float:
        steps = self.global_step_count - self.start_step
        if self.global_step_count > 0 and steps > 0 and self.total_elapsed_time > 0:   # DeepSpeed divides by 0 here
            return self.batch_size / (self.total_elapsed_time / steps)
        return float("-inf")


class DeepSpeedSurface:
    """Mixed into ZeroEngine (an nn.Module: `module` is a registered submodule)."""

    @property
    def global_rank(self) -> int:
        return self.comm.global_rank

    @property
    def local_rank(self) -> int:
        return int(os.environ.get("LOCAL_RANK", "-1"))    # DeepSpeed: args.local_rank or $LOCAL_RANK, -1 absent

    @property
    def world_size(self) -> int:
        return self.comm.size

    @property
    def dp_world_size(self) -> int:
        return self.comm.size

    def __getattr__(self, name: str):
        """DeepSpeedEngine.__getattr__: what the engine lacks is looked up on the wrapped module."""
        try:
            return super().__getattr__(name)
        except AttributeError:
            module = self.__dict__.get("_modules", {}).get("module")
            if module is not None and name != "module" and hasattr(module, name):
                return getattr(module, name)
            raise AttributeError(f"'{type(self).__name__}' object has no attribute {name!r} (nor has its module "
                                 f"{type(module).__name__ if module is not None else None})") from None

    inside_no_sync_ctxt = False    # DeepSpeed's name: backwards inside engine.no_sync() keep their gradients local
    _grads_local = False           # stages 0-1: the gradient buffers hold this rank's unreduced gradients

    @contextlib.contextmanager
    def no_sync(self):
        """DeepSpeedEngine.no_sync: the backwards inside do not reduce; their gradients add up on each
        rank and the next backward outside (at the boundary) reduces the sum. Stages 0-1 only: stages 2-3
        reduce-scatter every micro-batch into shards. step() inside is an error. DeepSpeed's assertions
        and words."""
        if self.stage_id >= 2:
            raise AssertionError("no_sync context manager is incompatible with gradient partitioning logic of "
                                 f"ZeRO stage {self.stage_id}")
        if self.inside_no_sync_ctxt:
            raise AssertionError("no_sync context manager reentry is unsupported")
        self.inside_no_sync_ctxt = True
        try:
            yield
        finally:
            self.inside_no_sync_ctxt = False

    def destroy(self) -> None:
        """DeepSpeedEngine.destroy: drop the optimizer's and stages' references so memory can be
        freed (hooks removed); the engine is unusable afterwards. The process group stays."""
        for h in getattr(self.stage, "hooks", []):
            h.remove()
        self.stage.hooks = []
        if hasattr(self.stage, "release_all"):
            self.stage.release_all(keep_persistent=True)    # DeepSpeed's destroy leaves them gathered
        self.optimizer.state = type(self.optimizer.state)({} for _ in self.optimizer.state)

    def empty_partition_cache(self) -> None:
        """DeepSpeedEngine.empty_partition_cache: release ZeRO-3's gathered parameters (a no-op below stage 3)."""
        if hasattr(self.stage, "release_all"):
            self.stage.release_all()

    def offload_states(self, include=None, device="cpu", pin_memory: bool = True,
                       non_blocking: bool = False) -> None:
        """DeepSpeedEngine.offload_states: the chosen states to the host until reload_states (offload_states.py)."""
        offload_states.offload_states(self, include, device, pin_memory, non_blocking)

    def reload_states(self, non_blocking: bool = False) -> None:
        """DeepSpeedEngine.reload_states: every offloaded state back where it was (offload_states.py)."""
        offload_states.reload_states(self, non_blocking)

    def _get_optimizer_ckpt_name(self, checkpoints_path, tag, expp_rank) -> str:
        """DeepSpeed's: the name of expert-parallel rank `expp_rank`'s optimizer file (its MoE layout; ringzero,
        without MoE, writes none: the ZeRO files are zero_pp_rank_*, checkpoint_ds.py)."""
        mp, _ = engine_mp(self)
        return os.path.join(checkpoints_path, str(tag), f"expp_rank_{expp_rank}_mp_rank_{mp:02d}_optim_states.pt")

    def _change_recovery_script_permissions(self, dst) -> None:
        """DeepSpeed's: make a checkpoint's recovery script executable; where the file system refuses
        (or the file is missing), say so on DeepSpeed's logger at info level and go on."""
        try:
            os.chmod(dst, os.stat(dst).st_mode | stat.S_IEXEC)
        except (FileNotFoundError, PermissionError) as e:
            logging.getLogger("DeepSpeed").info(f"Warning: Could not change permissions for {dst} due to error: {e}. "
                                                "Continuing without changing permissions.")

    def was_step_applied(self) -> bool:    # DeepSpeed's _step_applied: the latest step() updated the weights
        return getattr(self, "applied_at", None) == self.micro_steps - 1

    def deepspeed_io(self, dataset, batch_size=None, route="train", pin_memory=True, data_sampler=None,
                     collate_fn=None, num_local_io_workers=None):
        """DeepSpeedEngine.deepspeed_io: the distributed loader (dataloader.py); eval/predict routes
        read in order (shuffle=False), as DeepSpeed."""
        if not isinstance(dataset, torch.utils.data.Dataset):
            raise ValueError("Training data must be a torch Dataset")     # DeepSpeed's words
        if data_sampler is None and route in ("predict", "eval"):
            data_sampler = torch.utils.data.DistributedSampler(dataset, num_replicas=self.comm.size,
                                                               rank=self.comm.rank, shuffle=False)
        return DeepSpeedDataLoader(
            dataset, batch_size or self.train_micro_batch_size_per_gpu(), pin_memory and self.device.type == "cuda",
            self.local_rank, self.tput_timer if route == "train" else None, collate_fn, num_local_io_workers,
            data_sampler, self.comm.size, self.comm.rank, self.config.surface["dataloader_drop_last"])


    # ------------------------------------------------------------------ 16-bit weights (the HF Trainer's save)
    def module_state_dict(self, destination=None, prefix="", keep_vars=False, exclude_frozen_parameters=False):
        """The wrapped module's state_dict (stages 0-2: every parameter is whole on every rank)."""
        sd = self.module.state_dict(destination=destination, prefix=prefix, keep_vars=keep_vars)
        if exclude_frozen_parameters:
            for n, p in self.module.named_parameters():
                if not p.requires_grad:
                    sd.pop(prefix + n, None)
        return sd

    def _zero3_consolidated_16bit_state_dict(self, exclude_frozen_parameters: bool = False):
        """DeepSpeed's: the full state_dict in the model dtype on rank 0 (None elsewhere), gathered one
        module at a time (every rank must call it: all-gathers); shared parameters stay shared."""
        if self.stage_id != 3:
            raise ValueError("this function requires ZeRO-3 mode")      # DeepSpeed's words
        out, seen = ({} if self.comm.global_rank == 0 else None), {}
        for mname, m in self.module.named_modules():
            pre = f"{mname}." if mname else ""
            params = list(m.parameters(recurse=False))
            with self._gathered(params, None):
                if out is None:
                    continue
                for n, p in m.named_parameters(recurse=False):
                    if exclude_frozen_parameters and not p.requires_grad:
                        continue
                    out[pre + n] = out[seen[id(p)]] if id(p) in seen else p.detach().cpu().clone()
                    seen.setdefault(id(p), pre + n)
                for n, b in m.named_buffers(recurse=False):
                    if n not in m._non_persistent_buffers_set:
                        out[pre + n] = b.detach().cpu().clone()
        return out

    def zero_gather_16bit_weights_on_model_save(self) -> bool:
        """DeepSpeed's: whether stage 3 gathers the 16-bit weights on save (accelerate's get_state_dict asks)."""
        return bool(self.config.surface["gather_16bit_on_save"])

    def save_16bit_model(self, save_dir: str, save_filename: str = "pytorch_model.bin",
                         exclude_frozen_parameters: bool = False) -> bool:
        """DeepSpeed's: rank 0 writes the model-dtype state_dict; at stage 3 only with
        zero_optimization.stage3_gather_16bit_weights_on_model_save (else False, nothing written)."""
        if self.stage_id == 3:
            if not self.config.surface["gather_16bit_on_save"]:
                print0(f"[zero_from_scratch] did not save {save_filename}: stage3_gather_16bit_weights_on_model_save "
                       "is false (DeepSpeed does the same)")
                return False
            sd = self._zero3_consolidated_16bit_state_dict(exclude_frozen_parameters)
        else:
            sd = self.module_state_dict(exclude_frozen_parameters=exclude_frozen_parameters)
        if self.comm.global_rank == 0:
            os.makedirs(save_dir, exist_ok=True)
            atomic_write(os.path.join(save_dir, save_filename), lambda f: torch.save(sd, f))
        return True

    save_fp16_model = save_16bit_model


def start_distributed(comm_impl: str, distributed_port=None) -> None:
    """deepspeed.initialize → init_distributed: start torch.distributed when nobody did (from
    RANK/WORLD_SIZE/MASTER_ADDR, MASTER_PORT defaulting to distributed_port, or a world of one for
    a plain `python script.py`). Not with mpiexec's MPI world (primitives' MPI communicator needs
    no process group)."""
    if dist.is_initialized() or (comm_impl == "primitives" and registry._MPI_WORLD is not None):  # mpiexec's world
        return
    if "RANK" not in os.environ:                     # DeepSpeed's mpi_discovery sets these for a world of one
        os.environ.setdefault("LOCAL_RANK", "0")
    elif distributed_port is not None:
        os.environ.setdefault("MASTER_PORT", str(distributed_port))
    init_from_env("auto")


def resolve_config(args, config, config_params):
    """deepspeed.initialize's rule: config, else config_params; args.deepspeed_config (or the
    deprecated deepscale_config) when neither is given, and an error when both are."""
    if config is None:
        config = config_params
    from_args = getattr(args, "deepspeed_config", None) or getattr(args, "deepscale_config", None)
    if from_args is not None:
        if config is not None:
            raise ValueError("initialize(): a config came both in args.deepspeed_config and as config=; DeepSpeed "
                             "asserts 'Not sure how to proceed'. Pass one")
        config = from_args
    if config is None:
        raise ValueError("initialize(config=...) is required: a DeepSpeed JSON path or dict (or args.deepspeed_config)")
    return config


def client_scheduler(engine, lr_scheduler):
    """DeepSpeed's _configure_lr_scheduler: a client callable is called with the basic optimizer
    (the client's object, or the engine's); a client object is used as given; either replaces the
    config's scheduler. Stepped by engine.step() at the boundary, skipped on overflow."""
    if engine.config.scheduler is not None and engine.comm.global_rank == 0:
        warnings.warn("zero_from_scratch: initialize(lr_scheduler=...) replaces the config's \"scheduler\" "
                      "section, as in DeepSpeed", stacklevel=3)
    if callable(lr_scheduler) and not hasattr(lr_scheduler, "step"):
        opt = engine.client_optimizer
        return lr_scheduler(opt if opt is not None else engine.optimizer)
    return lr_scheduler


def load_args(engine, strict: bool, optimizer_states: bool, scheduler_states: bool, module_only: bool,
              custom_load_fn) -> tuple[bool, bool]:
    """DeepSpeed's load_checkpoint arguments on the ZeRO engine: (load optimizer states, scheduler states).
    load_module_only: the weights alone, no optimizer or scheduler state (the step counters are still
    restored here; DeepSpeed keeps its own);
    load_module_strict=False: DeepSpeed would skip missing/unexpected module keys; the engine loads
    its own partitioned layout, which has no such keys, so it says so once; custom_load_fn: refused."""
    if custom_load_fn is not None:
        raise NotImplementedError(f"rank {engine.global_rank}: load_checkpoint(custom_load_fn=...) is not served: DeepSpeed "
                                  "would call it to load the module's weights; load the state dict yourself after "
                                  "load_checkpoint(load_module_only=True)")
    if not strict and engine.global_rank == 0:
        warnings.warn("zero_from_scratch: load_checkpoint(load_module_strict=False): the checkpoint's weights are "
                      "loaded by the engine's own layout (a key the model lacks is an error, as with True)", stacklevel=3)
    if module_only:
        return False, False
    return optimizer_states, scheduler_states
