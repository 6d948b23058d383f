"""Tied layers across stages (DeepSpeed's TiedLayerSpec): one weight, held by several stages.

    (used by the engine; a GPT's token embedding on stage 0 reused as the output head on stage p−1)

At start-up the first holder sends its weights to the others (DeepSpeed broadcasts from the first
holder too), so all copies start equal. After every backward each holder exchanges the gradient
of the tied attributes (tied_weight_attr, default "weight") with every other holder and sums them
in stage order — the same sum, bit for bit, on every holder, so the copies stay equal. Cost per
step per holder: (k − 1)·Ψ_tied elements sent, k holders. Point-to-point on the pipeline group's
Communicator, each holder's sends and receives posted as one group (exchange): no extra process
group, and no per-peer order for nccl to deadlock on. For the gradient norm, copies after
the first holder are skipped (`is_replica`), as DeepSpeed's ds_pipe_replicated does.
"""
from __future__ import annotations

import torch

from pipeline_parallel.engine.module import TiedLayerSpec


class TiedWeights:
    def __init__(self, engine):
        self.e = engine
        owners = engine.module.tied_owners(engine.pp, engine.v)
        attrs = {}
        for spec in engine.module.layers:
            if isinstance(spec, TiedLayerSpec):
                attrs.setdefault(spec.key, spec.tied_weight_attr)
        local = {}
        for ch in engine.chunks:
            for k, m in ch.tied.items():
                local[k] = m
        # key -> (holders, [parameters of the tied attributes on this rank])
        self.groups = []
        for key in sorted(owners, key=str):
            holders = owners[key]
            if len(holders) < 2 or engine.stage not in holders:
                continue
            mod = local[str(key)]
            params = [_getattr(mod, a) for a in attrs[key]]
            self.groups.append((key, holders, params))
        self._replicas = {id(p) for key, holders, params in self.groups if engine.stage != holders[0]
                          for p in local[str(key)].parameters()}

    def is_replica(self, p) -> bool:
        return id(p) in self._replicas

    def _exchange(self, holders, mine):
        """Every holder's tensor: ours sent to each other holder and theirs received, posted as one
        group (the textbook Communicator.exchange), so no per-peer order can deadlock under nccl."""
        others = [h for h in holders if h != self.e.stage]
        got = {h: torch.empty_like(mine) for h in others}
        for req in self.e.comm.exchange(sends=[(mine, h) for h in others], recvs=[(got[h], h) for h in others]):
            req.wait()
        return {self.e.stage: mine, **got}

    def broadcast_initial(self):
        e = self.e
        for key, holders, params in self.groups:
            for p in params:
                if e.stage == holders[0]:
                    reqs = [e.comm.isend(p.data.contiguous(), h) for h in holders[1:]]
                    for r in reqs:
                        r.wait()
                else:
                    buf = torch.empty_like(p.data)
                    e.comm.irecv(buf, holders[0]).wait()
                    p.data.copy_(buf)

    def reduce_grads(self):
        for key, holders, params in self.groups:
            for p in params:
                g = p.grad if p.grad is not None else torch.zeros_like(p)
                got = self._exchange(holders, g.contiguous())
                total = got[holders[0]].clone()
                for h in holders[1:]:
                    total += got[h]
                p.grad = total


def _getattr(module, dotted: str):
    for part in dotted.split("."):
        module = getattr(module, part)
    return module
