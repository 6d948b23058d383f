"""initialize() for a PipelineModule (`deepspeed.initialize`'s signature) and `deepspeed.pipe`'s names.

    from pipeline_parallel.engine.ds_pipe import PipelineModule, LayerSpec, initialize
    net = PipelineModule(layers=[...], num_stages=2, loss_fn=F.cross_entropy)
    engine, optimizer, loader, sched = initialize(args=args, model=net, training_data=ds,
                                                  model_parameters=[p for p in net.parameters() if p.requires_grad])
    loss = engine.train_batch()          # a 0-dim tensor, the mean loss, on every rank
    engine, *_ = pipeline_parallel.initialize(model=net, config="ds_config.json", mesh=mesh)   # the same function

initialize()'s rules: config, config_params or args.deepspeed_config — exactly one; training_data →
a loader over this data replica's share (DistributedSampler over the data axis, no shuffle), returned
third, and a repeating iterator that train_batch() reads without data_iter; a client optimizer,
lr_scheduler or mpu is refused with the reason. DeepSpeed's "pipeline" keys act as in its engine:
activation_checkpoint_interval k > 0 overrides the module's (built stages too), use_reentrant false
selects non_reentrant_checkpoint, true DeepSpeed's reentrant one (absent: torch's non-reentrant; the runner
sets it true), pipe_partitioned / grad_partitioned are refused with a model axis
(accepted without), stages / partition / seed_layers are read by nothing, as in DeepSpeed.
The world: the module's topology (pp × dp, or pp × dp × tp), or pp × world/pp, or ringzero's mesh=
(a primitives.mesh.Mesh whose layers already hold their tp shards: classification/parallel/pipeline.py);
dp=, when given, is checked. model_parameters: None (the stage's trainable parameters) or parameters
of this rank's stage. Cost: none beyond building the engine.
"""
from __future__ import annotations

import torch.distributed as dist
from torch.utils.data import DataLoader, DistributedSampler

from pipeline_parallel.engine.config import load, read_json
from pipeline_parallel.engine.layers import LayerSpec, TiedLayerSpec
from pipeline_parallel.engine.module import PipelineModule
from pipeline_parallel.engine.pipe_engine import PipelineEngine
from pipeline_parallel.engine.topology import (PipeDataParallelTopology, PipeModelDataParallelTopology, ProcessTopology,
                                               mesh_sizes)
from primitives.launch import init_from_env
from primitives.mesh import Mesh, MeshError
from zero_from_scratch.engine.activation_checkpointing import checkpoint as non_reentrant_checkpoint, reentrant_checkpoint
from zero_from_scratch.engine.dataloader import RepeatingLoader   # one home: deepspeed.utils.RepeatingLoader
from zero_from_scratch.engine.surface import resolve_config        # deepspeed.initialize's config rule, one home

__all__ = ["PipelineModule", "LayerSpec", "TiedLayerSpec", "ProcessTopology", "PipeDataParallelTopology",
           "PipeModelDataParallelTopology", "PipelineEngine", "RepeatingLoader", "initialize"]


def initialize(args=None, model=None, optimizer=None, model_parameters=None, training_data=None, lr_scheduler=None,
               distributed_port=None, mpu=None, dist_init_required=None, collate_fn=None, config=None,
               mesh_param=None, config_params=None, dp: int | None = None, mesh: Mesh | None = None):
    """(engine, optimizer, training_dataloader, lr_scheduler) for a PipelineModule, as deepspeed.initialize;
    dp (checked against the world) and mesh are ringzero's (see the module docstring)."""
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
    if not dist.is_initialized():
        init_from_env()
    mesh = _mesh(model, dp, mesh)
    engine = PipelineEngine(model, load(config, mesh.layout.dp), mesh, model_parameters)
    loader = None
    if training_data is not None:
        sampler = DistributedSampler(training_data, num_replicas=engine.dp, rank=engine.dp_rank, shuffle=False)
        loader = DataLoader(training_data, batch_size=engine.micro_batch_size, sampler=sampler, collate_fn=collate_fn,
                            drop_last=bool((engine.cfg.raw or {}).get("dataloader_drop_last", False)))
        engine.training_dataloader = loader
        engine.data_iterator = RepeatingLoader(loader)
    return engine, engine.optimizer, loader, engine.lr_scheduler


def _mesh(model, dp: int | None, mesh: Mesh | None) -> Mesh:
    """The caller's mesh, else the module topology's, else pp × world/pp; each checked against the
    model's stages, the world size and dp."""
    world, rank, pp = dist.get_world_size(), dist.get_rank(), model.num_stages
    if mesh is None and model._topo is not None:
        tpp, tdp, ttp = mesh_sizes(model._topo)
        if tpp * tdp * ttp != world or (dp is not None and dp != tdp):
            raise MeshError(f"rank {rank}: topology pipe={tpp} × data={tdp} × model={ttp} does not match the world size "
                            f"{world}" + (f" and dp={dp}" if dp is not None else ""))
        mesh = Mesh.build(dp=tdp, pp=tpp, tp=ttp)
    if mesh is not None:
        if mesh.layout.pp != pp or mesh.layout.world != world or (dp is not None and dp != mesh.layout.dp):
            raise MeshError(f"rank {rank}: mesh dp={mesh.layout.dp} × pp={mesh.layout.pp} × tp={mesh.layout.tp} does not "
                            f"match the model's {pp} stages, dp={dp} and world size {world}")
        return mesh
    if world % pp or (dp is not None and dp * pp != world):
        raise MeshError(f"rank {rank}: pp={pp} stages × dp={dp if dp is not None else 'world/pp'} does not divide "
                        f"the world size {world}; expected world = pp × dp")
    return Mesh.build(dp=world // pp, pp=pp)


_READ_BY_NOTHING = ("stages", "partition", "seed_layers")   # DeepSpeed's engine does not read these either


def _deepspeed_pipeline_keys(model, config: dict) -> None:
    """Act on (and remove) DeepSpeed's own keys of config["pipeline"] (see the module docstring)."""
    pipe = config.get("pipeline") or {}
    for key in _READ_BY_NOTHING:
        pipe.pop(key, None)
    k = pipe.pop("activation_checkpoint_interval", 0)
    if k > 0:     # DeepSpeed's runtime/pipe/engine.py __init__: the config's k > 0 overrides the module's (built stages too)
        model.set_checkpoint_interval(k)
    reentrant = pipe.pop("use_reentrant", None)
    if reentrant is False:     # DeepSpeed's engine: the module's function becomes its non_reentrant_checkpoint
        model.set_checkpoint_func(non_reentrant_checkpoint)
    elif reentrant and model.activation_checkpoint_func is None:   # said (the runner says it): DeepSpeed's default
        model.set_checkpoint_func(reentrant_checkpoint)
    model_axis = model._topo is not None and model._topo.get_dim("model") > 1
    for key in ("pipe_partitioned", "grad_partitioned"):
        if pipe.pop(key, True) and model_axis:
            raise NotImplementedError(f"config key 'pipeline.{key}' with a model axis: DeepSpeed would partition "
                                      "activations/gradients sent between stages over the tensor-parallel ranks; "
                                      "set it false (ringzero sends them whole)")
    if "pipeline" in config and not pipe:
        del config["pipeline"]
