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
A client optimizer / lr_scheduler object or an mpu is refused with the reason. Cost: none beyond initialize.
"""
from __future__ import annotations

import json

from torch.utils.data import DataLoader, DistributedSampler

from pipeline_parallel.engine.layers import LayerSpec, TiedLayerSpec
from pipeline_parallel.engine.module import PipelineModule
from pipeline_parallel.engine.pipe_engine import PipelineEngine
from pipeline_parallel.engine.pipe_engine import initialize as _initialize
from pipeline_parallel.engine.topology import PipeDataParallelTopology, PipeModelDataParallelTopology, ProcessTopology
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
    config = resolve_config(args, config, config_params)
    if isinstance(config, dict):
        config = json.loads(json.dumps(config))
    engine, opt, _, sched = _initialize(model=model, model_parameters=model_parameters, config=config)
    loader = None
    if training_data is not None:
        sampler = DistributedSampler(training_data, num_replicas=engine.dp, rank=engine.dp_rank, shuffle=False)
        loader = DataLoader(training_data, batch_size=engine.micro_batch_size, sampler=sampler, collate_fn=collate_fn,
                            drop_last=bool((engine.cfg.raw or {}).get("dataloader_drop_last", False)))
        engine.training_dataloader = loader
        engine.data_iterator = RepeatingLoader(loader)
    return engine, opt, loader, sched

