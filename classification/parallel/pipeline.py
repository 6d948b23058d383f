"""DistilBERT as pipeline stages whose blocks are tensor-parallel: the layer list that
pipeline_parallel's engine runs in the 3D demo (data × pipeline × tensor).

    torchrun --standalone --nproc_per_node 8 classification/parallel/train.py --dp 2 --pp 2 --tp 2

    layers, source = distilbert_layers(model, mesh.tp_group)    # LayerSpecs: Embed, Block × L, Head
    pm = PipelineModule(layers, num_stages=pp, loss_fn=classification_loss,
                        partition_method=stage_bounds(L, pp, rank))
    engine, *_ = pipeline_parallel.initialize(model=pm, config=cfg, mesh=mesh)
    source.release()                                            # the unsharded model can go
    engine.train_batch(iter([(pack(ids, mask), labels), ...]))

The attention mask: the executor sends ONE tensor per boundary (one cached shape header, one
isend per micro-batch), so the mask rides in it as an extra feature channel: a stage boundary
carries (b, s, h + 1) floats, the hidden states and the 0/1 mask, +1/h bytes (0.26 % at h = 384).
Every Block splits it off, builds the 4-D mask exactly as DistilBertModel does
(create_bidirectional_mask), and appends it again; its gradient is zero and unused. Stage 0
receives ids and mask stacked as (b, 2, s) int64 (`pack`).

Stages: Embed (word embeddings vocab-parallel) + the first L/pp blocks on stage 0, L/pp blocks
each after, Head (pre_classifier, ReLU, dropout, classifier on [CLS]; replicated, small) on the
last stage; pp must divide L. Each rank builds only its own stage's layers (LayerSpec), sharded
over the tp group by tensor_parallel.engine.parallelize (per block: heads split, FFN column → row).
Cost per micro-batch and block: the 4 all-reduces of b·s·h of plain TP (formulas.layer_traffic),
plus one for the vocab-parallel embedding on stage 0.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from pipeline_parallel.engine.module import LayerSpec
from tensor_parallel.engine.parallelize import parallelize, tp_comm
from tensor_parallel.layers import VocabParallelEmbedding


class StageError(ValueError):
    """A pipeline split DistilBERT cannot take (pp not dividing the blocks)."""


class Source:
    """The unsharded model, held until this rank has built its stage, then released."""

    def __init__(self, model, group, tp: int):
        self.model, self.group, self.tp = model, group, tp

    def release(self):
        self.model = None


def pack(ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Stage 0's input: ids and attention mask of shape (b, s) stacked to (b, 2, s)."""
    return torch.stack([ids, mask.to(ids.dtype)], 1)


class Embed(nn.Module):
    prefix = "distilbert."

    def __init__(self, src: Source):
        super().__init__()
        self.embeddings = src.model.distilbert.embeddings
        if src.tp > 1:
            self.embeddings.word_embeddings = VocabParallelEmbedding(self.embeddings.word_embeddings,
                                                                     tp_comm(src.group, "Embed"))

    def forward(self, x):
        ids, mask = x[:, 0], x[:, 1]
        h = self.embeddings(ids)
        return torch.cat([h, mask.unsqueeze(-1).to(h.dtype)], -1)


class Block(nn.Module):
    def __init__(self, src: Source, i: int):
        super().__init__()
        self.prefix = f"distilbert.transformer.layer.{i}."
        self.config = src.model.config
        self.block = src.model.distilbert.transformer.layer[i]
        if src.tp > 1:
            parallelize(self.block, src.group)

    def forward(self, x):
        from transformers.masking_utils import create_bidirectional_mask   # optional dependency (extras: deepspeed)
        h, m = x[..., :-1], x[..., -1].detach()
        mask4 = create_bidirectional_mask(config=self.config, inputs_embeds=h, attention_mask=m.long())
        out = self.block(h, attention_mask=mask4)
        return torch.cat([out, m.unsqueeze(-1)], -1)


class Head(nn.Module):
    prefix = ""

    def __init__(self, src: Source):
        super().__init__()
        m = src.model
        self.pre_classifier, self.dropout, self.classifier = m.pre_classifier, m.dropout, m.classifier

    def forward(self, x):
        pooled = torch.relu(self.pre_classifier(x[:, 0, :-1]))     # [CLS], without the mask channel
        return self.classifier(self.dropout(pooled))


def distilbert_layers(model, group, tp: int):
    """(LayerSpecs Embed, Block 0 … L−1, Head; the Source to release once the engine is built)."""
    kind = type(model).__name__
    if kind != "DistilBertForSequenceClassification":
        raise StageError(f"distilbert_layers: expected a DistilBertForSequenceClassification, got {kind}")
    src = Source(model, group, tp)
    blocks = [LayerSpec(Block, src, i) for i in range(model.config.n_layers)]
    return [LayerSpec(Embed, src)] + blocks + [LayerSpec(Head, src)], src


def stage_bounds(n_blocks: int, pp: int, rank: int = 0) -> list[int]:
    """Layer boundaries for PipelineModule: L/pp blocks per stage, Embed first, Head last."""
    if pp < 1 or n_blocks % pp:
        raise StageError(f"rank {rank}: --pp {pp} does not divide DistilBERT's {n_blocks} transformer blocks; "
                         f"expected one of {[d for d in range(1, n_blocks + 1) if n_blocks % d == 0]}")
    k = n_blocks // pp
    return [0] + [1 + s * k for s in range(1, pp)] + [n_blocks + 2]


def classification_loss(logits, labels):
    return F.cross_entropy(logits, labels)


def accuracy(logits, labels):
    """Used as the engine's loss_fn for eval_batch, which then averages accuracy over micro-batches and dp."""
    return (logits.argmax(-1) == labels).float().mean()


def hf_named_parameters(chunks):
    """(Hugging Face name, parameter) of every parameter of this rank's chunks; a tp shard keeps
    `tp_shard` = (dim, start, end, full) to slice the unsharded parameter of the same name."""
    for ch in chunks:
        for layer in ch.layers.values():
            for name, p in layer.named_parameters():
                if isinstance(layer, Block):
                    name = name.removeprefix("block.")
                yield layer.prefix + name, p
