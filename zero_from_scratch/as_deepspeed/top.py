"""The `deepspeed` module's own functions under the runner: initialize, init_distributed, add_config_arguments.

    python -m zero_from_scratch.as_deepspeed train.py --deepspeed_config ds.json
    engine, optimizer, loader, scheduler = deepspeed.initialize(args=args, model=model, model_parameters=...)

initialize follows deepspeed/__init__.py::initialize (0.19.8): log its "DeepSpeed info: version=..." line
(INFO; rank 0, or "[Rank -1]" on every rank before the first init_distributed), start torch.distributed if it is not
(init_distributed below), take `config`, else `config_params`, else args.deepspeed_config (or the
deprecated args.deepscale_config), with DeepSpeed's checks; then a PipelineModule goes to the
pipeline engine (pipeline_parallel.engine.ds_pipe.initialize, resolved from served.py's table) and
anything else to zero_from_scratch.initialize, with the resolved config as config= (and a copy of
args without deepspeed_config, so the engine sees one config). Every other argument is handed on
unchanged: the engine serves it or refuses it by name, after DeepSpeed's quirks (quirks.py: the
deprecated cpu_offload keys, fp32 pipeline clipping by stage 0, model_parameters that leave
weights out, engine.optimizer.optimizer) are applied. mesh_param (sequence-parallel meshes) is not served.
init_distributed follows deepspeed/comm/comm.py::init_distributed: nothing when torch.distributed
is up; else RANK/WORLD_SIZE/MASTER_ADDR/MASTER_PORT/LOCAL_RANK from the launcher, backend from the
accelerator (gloo on cpu, nccl on cuda), timeout DEEPSPEED_TIMEOUT minutes (default 10). Without a
launcher DeepSpeed asks mpi4py; a single process (no MPI variables) is what that discovery finds,
so the runner sets the variables for rank 0 of 1 and says so; under mpirun it refuses.
Cost: one process-group rendezvous, once.
"""
from __future__ import annotations

import argparse
import copy
import logging
import os
import sys
from datetime import timedelta

import torch
import torch.distributed as dist

from zero_from_scratch.as_deepspeed import quirks, served, z3lin_initialize, comm_names, optimizer_classes
from zero_from_scratch.as_deepspeed.accelerator import get_accelerator
from zero_from_scratch.as_deepspeed.finder import NotServedError, message, resolve
from zero_from_scratch.as_deepspeed.utils import COMM_STARTED, log_dist, logger
from zero_from_scratch.engine.precision import deepspeed_wrappers

DEFAULT_PORT = 29500   # deepspeed.constants.TORCH_DISTRIBUTED_DEFAULT_PORT
REQUIRED_ENV = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "LOCAL_RANK")
MPI_ENV = ("OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "PMIX_RANK", "MPI_LOCALNRANKS")


def _default_timeout() -> timedelta:
    return timedelta(minutes=int(os.getenv("DEEPSPEED_TIMEOUT", default=10)))


def init_distributed(dist_backend=None, auto_mpi_discovery=True, distributed_port=DEFAULT_PORT, verbose=True,
                     timeout=None, init_method=None, dist_init_required=None, config=None, rank=-1, world_size=-1):
    if config is not None:
        raise NotServedError(message("deepspeed.init_distributed(config=...)", "configure its comms logger",
                                     "primitives.LEDGER and engine.comm_report()"))
    COMM_STARTED[:] = [True]
    up = dist.is_available() and dist.is_initialized()
    if up:
        return
    if dist_init_required is False:
        raise AssertionError("Distributed backend is not initialized. Please set dist_init_required to True or "
                             "initialize before calling deepspeed.initialize()")
    if init_method is None and not all(v in os.environ for v in REQUIRED_ENV):
        if not auto_mpi_discovery:
            missing = [v for v in REQUIRED_ENV if v not in os.environ]
            raise RuntimeError(f"deepspeed.init_distributed(auto_mpi_discovery=False): {missing} are not set; "
                               "launch with torchrun or deepspeed")
        if any(v in os.environ for v in MPI_ENV):
            raise NotServedError(message("deepspeed.init_distributed under mpirun", "discover ranks with mpi4py",
                                         "launch with torchrun or deepspeed"))
        # what DeepSpeed's mpi4py discovery finds for one process not started by a launcher
        for k, v in {"RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0", "MASTER_ADDR": "127.0.0.1",
                     "MASTER_PORT": str(distributed_port)}.items():
            os.environ.setdefault(k, v)
        if verbose:
            logger.warning("no launcher variables: running as rank 0 of 1 (what DeepSpeed's MPI discovery finds "
                           "for a single process)")
    backend = dist_backend or get_accelerator().communication_backend_name()
    if int(os.getenv("RANK", "0")) == 0 and verbose:
        logger.info(f"Initializing TorchBackend in DeepSpeed with backend {backend}")
    dist.init_process_group(backend, timeout=timeout or _default_timeout(), init_method=init_method, rank=rank,
                            world_size=world_size)


def _add_core_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    group = parser.add_argument_group("DeepSpeed", "DeepSpeed configurations")
    group.add_argument("--deepspeed", default=False, action="store_true",
                       help="Enable DeepSpeed (helper flag for user code, no impact on DeepSpeed backend)")
    group.add_argument("--deepspeed_config", default=None, type=str, help="DeepSpeed json configuration file.")
    group.add_argument("--deepscale", default=False, action="store_true",
                       help="Deprecated enable DeepSpeed (helper flag for user code, no impact on DeepSpeed backend)")
    group.add_argument("--deepscale_config", default=None, type=str, help="Deprecated DeepSpeed json configuration file.")
    return parser


def add_config_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """--deepspeed, --deepspeed_config, --deepscale, --deepscale_config, as DeepSpeed adds them."""
    return _add_core_arguments(parser)


def _config_from(args, config, config_params):
    if config is None and config_params is not None:
        config = config_params
    if getattr(args, "deepscale_config", None) is not None:
        logger.warning("************ --deepscale_config is deprecated, please use --deepspeed_config ************")
        if hasattr(args, "deepspeed_config"):
            assert args.deepspeed_config is None, \
                "Not sure how to proceed, we were given both a deepscale_config and deepspeed_config"
        args.deepspeed_config = args.deepscale_config
        args.deepscale_config = None
    if getattr(args, "deepspeed_config", None) is not None:
        assert config is None, ("Not sure how to proceed, we were given deepspeed configs in the deepspeed "
                                "arguments and deepspeed.initialize() function call")
        config = args.deepspeed_config
    assert config is not None, "DeepSpeed requires --deepspeed_config to specify configuration file"
    return config


def _is_pipeline_module(model) -> bool:
    # only a script that used deepspeed.pipe has loaded the pipeline engine: never import it for a plain model
    mod_name, _, cls = served.PIPELINE_MODULE.partition(":")
    mod = sys.modules.get(mod_name)
    return mod is not None and isinstance(model, getattr(mod, cls))


def initialize(args=None, model=None, optimizer=None, model_parameters=None, training_data=None, lr_scheduler=None,
               distributed_port=DEFAULT_PORT, mpu=None, dist_init_required=None, collate_fn=None, config=None,
               mesh_param=None, config_params=None):
    # DeepSpeed's first line, on its logger at INFO (shown once a script or the Trainer lowers the level)
    info = f"DeepSpeed info: version={served.VERSION}, git-hash=unknown, git-branch=unknown"
    log_dist(info, ranks=[0])
    assert model is not None, "deepspeed.initialize requires a model"
    init_distributed(dist_backend=get_accelerator().communication_backend_name(), distributed_port=distributed_port,
                     dist_init_required=dist_init_required)
    config = _config_from(args, config, config_params)
    if mesh_param is not None:
        raise NotServedError(message("deepspeed.initialize(mesh_param=...)", "build a data × sequence-parallel mesh",
                                     "primitives.mesh and zero_from_scratch.initialize(mpu=...)"))
    given = {"optimizer": optimizer, "model_parameters": model_parameters, "training_data": training_data,
             "lr_scheduler": lr_scheduler, "mpu": mpu, "collate_fn": collate_fn}
    kwargs = {k: v for k, v in given.items() if v is not None}
    pipeline = _is_pipeline_module(model)
    config = quirks.tag_validation_warn(quirks.deprecated_offload_keys(quirks.read_config(config)))
    config = quirks.offload_param_below_stage3(config)
    if pipeline:
        assert mpu is None, "mpu must be None with pipeline parallelism"
        build = resolve("deepspeed.initialize(model=PipelineModule)", served.PIPELINE_INITIALIZE)
        config = quirks.pipeline_defaults(config)
    else:
        build = resolve("deepspeed.initialize", "zero_from_scratch:initialize")
        quirks.init_model_below_stage3(model, config)
        z3lin_initialize.before(model, config)     # DeepSpeed's ZeRO-3 Linear and leaves (z3lin_initialize.py)
        if model_parameters is not None:
            kwargs["model_parameters"] = quirks.train_what_is_given(model, model_parameters)
        if isinstance(optimizer, torch.optim.Optimizer):    # DeepSpeed steps what the client's object holds
            quirks.train_what_is_given(model, [{"params": g["params"]} for g in optimizer.param_groups],
                                       "the client optimizer's param_groups")
    if getattr(args, "deepspeed_config", None) is not None:
        # the config goes on as config=: a copy of args without it, so the engine does not see two configs
        args = copy.copy(args)
        args.deepspeed_config = None
    with deepspeed_wrappers():         # DeepSpeed's 16-bit optimizer wrappers' first step (precision.py)
        out = build(args=args, model=model, config=config, **kwargs)
    _fp16_loss_note(out[0])
    quirks.expose_torch_optimizer(out[0])
    quirks.register_external_on_use(out[0])
    quirks.dp_change_load(out[0])
    quirks.lr_on_load(out[0])
    quirks.shared_step_load(out[0])
    quirks.prefetch_as_deepspeed(out[0])
    comm_names.install(out[0])        # the engine's collectives by deepspeed.comm's names
    optimizer_classes.install(out[0])  # DeepSpeed's ZeRO-1/2 optimizer classes where it would build them
    return out


_SAID: list[bool] = []     # the fp16 note is given once per process


def _fp16_loss_note(engine) -> None:
    """quirks.py zero0_fp16_loss_unscaled: the one DeepSpeed behaviour at ZeRO-0 fp16 the runner does not copy."""
    if _SAID or not getattr(engine, "ds_wrapper", False) or not engine.config.fp16.enabled:
        return
    _SAID.append(True)
    log_dist("ZeRO stage 0 with fp16: DeepSpeed 0.19.8's engine.backward does not multiply the loss by the loss scale "
             "there (only for a ZeRO optimizer, engine.py backward; upstream PR #8393) while its step divides by it; "
             "the runner scales the loss, so its updates are DeepSpeed's given the scaled loss", ranks=[0],
             level=logging.WARNING)
