"""`deepspeed.pipe` and `deepspeed.initialize` for a PipelineModule, with DeepSpeed's signatures.

    from pipeline_parallel.engine.ds_pipe import PipelineModule, LayerSpec, initialize
    net = PipelineModule(layers=[...], num_stages=2, loss_fn=F.cross_entropy)
    engine, optimizer, loader, sched = initialize(args=args, model=net, training_data=ds,
                                                  model_parameters=[p for p in net.parameters() if p.requires_grad])
    loss = engine.train_batch()          # a 0-dim tensor, the mean loss, on every rank

The names a client imports from deepspeed.pipe (PipelineModule, LayerSpec, TiedLayerSpec,
ProcessTopology, PipeDataParallelTopology, PipeModelDataParallelTopology) and initialize()'s
argument rules: config, or its older name config_params, or args.deepspeed_config — exactly one;
training_data → a loader over this data replica's share (DistributedSampler over the data axis,
no shuffle, micro-batch size, as DeepSpeed's pipeline engine builds it), returned third, and a
repeating iterator over it that train_batch() reads when called without data_iter.
A client optimizer / lr_scheduler object or an mpu is refused with the reason.
DeepSpeed's own "pipeline" config keys (runtime/config.py::get_pipeline_config) are read here, as its
pipeline engine reads them: activation_checkpoint_interval k > 0 sets the module's interval (its stages too
when they are built already: runtime/pipe/engine.py's __init__), use_reentrant false sets the module's
activation_checkpoint_func to non_reentrant_checkpoint (torch's non-reentrant checkpoint, as DeepSpeed's);
pipe_partitioned / grad_partitioned act only with a model axis (DeepSpeed: is_model_parallel), so
they are refused there and accepted without one; stages, partition and seed_layers are accepted and
read by nothing, as in DeepSpeed (PipelineModule's arguments decide those). Cost: none beyond initialize.
"""
from __future__ import annotations


import torch

from torch.utils.data import DataLoader, DistributedSampler

from pipeline_parallel.engine.config import read_json
from pipeline_parallel.engine.layers import LayerSpec, TiedLayerSpec
from pipeline_parallel.engine.module import PipelineModule
from pipeline_parallel.engine.pipe_engine import PipelineEngine
from pipeline_parallel.engine.pipe_engine import initialize as _initialize
from pipeline_parallel.engine.topology import PipeDataParallelTopology, PipeModelDataParallelTopology, ProcessTopology
from zero_from_scratch.engine.activation_checkpointing import checkpoint as non_reentrant_checkpoint
from zero_from_scratch.engine.dataloader import RepeatingLoader   # one home: deepspeed.utils.RepeatingLoader
from zero_from_scratch.engine.surface import resolve_config        # deepspeed.initialize's config rule, one home

__all__ = ["PipelineModule", "LayerSpec", "TiedLayerSpec", "ProcessTopology", "PipeDataParallelTopology",
           "PipeModelDataParallelTopology", "PipelineEngine", "RepeatingLoader", "initialize"]


def initialize(args=None, model=None, optimizer=None, model_parameters=None, training_data=None, lr_scheduler=None,
               distributed_port=None, mpu=None, dist_init_required=None, collate_fn=None, config=None,
               mesh_param=None, config_params=None):
    """(engine, optimizer, training_dataloader, lr_scheduler) for a PipelineModule, as deepspeed.initialize."""
    if not isinstance(model, PipelineModule):
        raise TypeError(f"initialize(model=...) here serves pipeline models: expected a PipelineModule, got "
                        f"{type(model).__name__} (zero_from_scratch.initialize serves plain nn.Modules)")
    for name, val, why in (("optimizer", optimizer, "build the optimizer from the config's 'optimizer' section"),
                           ("lr_scheduler", lr_scheduler, "use the config's 'scheduler' section"),
                           ("mpu", mpu, "DeepSpeed asserts 'mpu must be None with pipeline parallelism'; pass a "
                                        "PipeModelDataParallelTopology to the PipelineModule"),
                           ("mesh_param", mesh_param, "the topology comes from the PipelineModule")):
        if val is not None:
            raise NotImplementedError(f"initialize({name}=...) with a PipelineModule is not supported by "
                                      f"pipeline_parallel: {why}")
    config = read_json(resolve_config(args, config, config_params))
    _deepspeed_pipeline_keys(model, config)
    engine, opt, _, sched = _initialize(model=model, model_parameters=model_parameters, config=config)
    if not hasattr(engine, "device"):     # DeepSpeed's engine.device: where this stage's parameters live
        engine.device = next(iter(engine.params), torch.zeros(0)).device
    loader = None
    if training_data is not None:
        sampler = DistributedSampler(training_data, num_replicas=engine.dp, rank=engine.dp_rank, shuffle=False)
        loader = DataLoader(training_data, batch_size=engine.micro_batch_size, sampler=sampler, collate_fn=collate_fn,
                            drop_last=bool((engine.cfg.raw or {}).get("dataloader_drop_last", False)))
        engine.training_dataloader = loader
        engine.data_iterator = RepeatingLoader(loader)
    return engine, opt, loader, sched


_READ_BY_NOTHING = ("stages", "partition", "seed_layers")   # DeepSpeed's engine does not read these either


def _deepspeed_pipeline_keys(model, config: dict) -> None:
    """Act on (and remove) DeepSpeed's own keys of config["pipeline"] (see the module docstring)."""
    pipe = config.get("pipeline") or {}
    for key in _READ_BY_NOTHING:
        pipe.pop(key, None)
    k = pipe.pop("activation_checkpoint_interval", 0)
    if k > 0:     # DeepSpeed's runtime/pipe/engine.py __init__: the config's k > 0 overrides the module's
        model.activation_checkpoint_interval = k
        for chunk in model._chunks:     # stages built already (parameters() was called): they checkpoint by k too
            chunk.interval = k
    if pipe.pop("use_reentrant", True) is False:     # DeepSpeed's engine: the module's function becomes its
        model.activation_checkpoint_func = non_reentrant_checkpoint     # non_reentrant_checkpoint (ringzero's)
        for chunk in model._chunks:
            chunk.checkpoint_func = non_reentrant_checkpoint
    model_axis = model._topo is not None and model._topo.get_dim("model") > 1
    for key in ("pipe_partitioned", "grad_partitioned"):
        if pipe.pop(key, True) and model_axis:
            raise NotImplementedError(f"config key 'pipeline.{key}' with a model axis: DeepSpeed would partition "
                                      "activations/gradients sent between stages over the tensor-parallel ranks; "
                                      "set it false (ringzero sends them whole)")
    if "pipeline" in config and not pipe:
        del config["pipeline"]


def _reentrant_activation_checkpointing(engine) -> bool:
    """DeepSpeed's engine query (must stage 0's inputs require grad?): only under a client's own checkpoint
    function; ringzero's layer checkpointing and non_reentrant_checkpoint are torch's non-reentrant one."""
    func = engine.module.activation_checkpoint_func
    return engine.module.activation_checkpoint_interval > 0 and func not in (None, non_reentrant_checkpoint)


PipelineEngine._reentrant_activation_checkpointing = _reentrant_activation_checkpointing   # DeepSpeed's surface
PipelineEngine.config = property(lambda engine: engine.cfg.raw,   # DeepSpeed's engine.config: the config given
                                 doc="the config as given to initialize (DeepSpeed's engine.config)")

