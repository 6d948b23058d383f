"""DeepSpeed's own pipeline engine over our layer list: the reference side of the parity checks
(parity/pipeline.py) and of the demo's `--engine deepspeed`.

    deepspeed --num_gpus 2 pipeline_parallel/train.py --pp 2 --engine deepspeed

The only place in pipeline_parallel that imports deepspeed (an optional dependency, imported when
called). Cost: DeepSpeed's initialize.
"""
from __future__ import annotations

import torch

from zero_from_scratch.engine.real_deepspeed import prepare_deepspeed


def deepspeed_engine(layers, pp, loss_fn, config, partition="parameters", ckpt=0):
    """DeepSpeed's PipelineModule over the same LayerSpecs (converted to DeepSpeed's classes), seeded
    per layer like ours, and its engine. Needs an initialised process group (spawn / a launcher)."""
    deepspeed = prepare_deepspeed()
    deepspeed.init_distributed(dist_backend="gloo")   # wraps the group spawn/torchrun made; PipelineModule needs it
    from deepspeed.pipe import LayerSpec as DSLayerSpec   # deepspeed: optional, imported only for this side
    from deepspeed.pipe import PipelineModule as DSPipelineModule   # deepspeed: optional
    from deepspeed.pipe import TiedLayerSpec as DSTiedLayerSpec   # deepspeed: optional

    def convert(spec):
        if hasattr(spec, "key"):
            return DSTiedLayerSpec(spec.key, spec.typename, *spec.module_args, forward_fn=spec.forward_fn,
                                   tied_weight_attr=spec.tied_weight_attr, **spec.module_kwargs)
        return DSLayerSpec(spec.typename, *spec.module_args, **spec.module_kwargs)

    net = DSPipelineModule(layers=[convert(s) for s in layers], num_stages=pp, loss_fn=loss_fn,
                           partition_method=partition, seed_layers=True, base_seed=1234,
                           activation_checkpoint_interval=ckpt,
                           # DeepSpeed 0.19.8's default seed_fn calls random.seed(base_seed + layer_idx) with a
                           # numpy integer (its partition boundaries) and raises TypeError: seed torch ourselves
                           seed_fn=lambda s: torch.manual_seed(int(s)))
    cfg = {k: v for k, v in config.items() if k != "pipeline"}
    engine, *_ = deepspeed.initialize(model=net, model_parameters=[p for p in net.parameters() if p.requires_grad],
                                      config=cfg)
    return engine, net
