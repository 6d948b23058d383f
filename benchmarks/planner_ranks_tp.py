"""What one rank of benchmarks.planner_local runs for Hugging Face's DistilBERT split by
tensor_parallel.parallelize: tensor parallel (× data parallel) in one loop, and on the stages of
pipeline_parallel's engine (3D: pp × tp × dp), each step timed and its peak resident set read as
benchmarks/planner_ranks.py does.

    python -m benchmarks.planner_local --only tp2        # these rows, with the planner's prediction beside

Cost: the ranks' training steps; the resident-set reads are a /proc read per step.
"""
from __future__ import annotations

import torch
from transformers import DistilBertConfig, DistilBertModel
from transformers.models.distilbert.modeling_distilbert import Embeddings, TransformerBlock

import primitives as P
from benchmarks.planner_ranks import _timed, _warm
from pipeline_parallel import LayerSpec, PipelineModule
from pipeline_parallel import initialize as pipe_initialize
from planner.model import Model
from primitives.mesh import Mesh
from tensor_parallel.comm import copy_to_tp
from tensor_parallel.cross_entropy import vocab_parallel_cross_entropy
from tensor_parallel.engine.parallelize import parallelize, tp_comm
from tensor_parallel.layers import VocabParallelEmbedding


def distilbert_planner_model(name: str, layers: int, hidden: int, heads: int, vocab: int, seq: int) -> Model:
    """The planner's Model of a Hugging Face DistilBERT with a head tied to its word embedding."""
    return Model(name, layers, hidden, heads, vocab, seq, positions=seq, family="distilbert")


class DistilLM(torch.nn.Module):
    """Hugging Face's DistilBertModel (eager attention, dropout 0) and a head tied to its word
    embedding, tensor-parallel by tensor_parallel.parallelize: the embedding vocab-parallel, so the
    head's logits are this rank's vocabulary slice and the loss is vocab-parallel too."""

    def __init__(self, m: Model):
        super().__init__()
        cfg = DistilBertConfig(vocab_size=m.vocab, dim=m.hidden, n_heads=m.heads, hidden_dim=m.f, n_layers=m.layers,
                               dropout=0.0, attention_dropout=0.0, max_position_embeddings=m.positions)
        cfg._attn_implementation = "eager"
        self.vocab, self.db = m.vocab, DistilBertModel(cfg)

    def loss(self, x):
        h = self.db(input_ids=x).last_hidden_state
        comm = self.db.tp_comm
        logits = copy_to_tp(h, comm) @ self.db.embeddings.word_embeddings.weight.t()
        return vocab_parallel_cross_entropy(logits.flatten(0, 1), x.flatten(), self.vocab, comm)


def _tp_rank(rank, world, m: Model, tp: int, mb: int, steps: int):
    """dp = world / tp × tp through tensor_parallel.parallelize (DistilBERT, Megatron's split:
    heads and the MLP column → row, the vocabulary split over the embedding, the head and the
    loss), the dp group's gradients in one flat all-reduce after backward, AdamW."""
    base = _warm()
    mesh = Mesh.build(dp=world // tp, tp=tp)
    torch.manual_seed(0)
    net = DistilLM(m)
    assert sum(p.numel() for p in net.parameters()) == m.params(), "torch model ≠ planner's count"
    parallelize(net.db, mesh.tp_group)    # the norms, positions and row-parallel biases stay whole: the planner's Ψ/t is a bit below
    x = torch.randint(0, m.vocab, (mb, m.seq), generator=torch.Generator().manual_seed(mesh.coords[1]))
    opt = torch.optim.AdamW(net.parameters(), lr=1e-4)

    def step():
        net.loss(x).backward()
        if world > tp:
            flat = torch.cat([p.grad.flatten() for p in net.parameters()])
            P.all_reduce(flat, group=mesh.dp_group)
            off = 0
            for p in net.parameters():
                p.grad.copy_(flat[off:off + p.numel()].view_as(p)).div_(world // tp)
                off += p.numel()
            del flat
        opt.step()
        opt.zero_grad(set_to_none=False)
    return _timed(step, steps, base)


class _DistilEmbed(torch.nn.Module):
    """DistilBERT's embeddings (words vocab-parallel, positions, LayerNorm): the first stage's layer."""

    def __init__(self, cfg, group):
        super().__init__()
        self.emb = Embeddings(cfg)
        self.emb.word_embeddings = VocabParallelEmbedding(self.emb.word_embeddings, tp_comm(group, "embed"))

    def forward(self, ids):
        return self.emb(ids)


class _DistilBlock(torch.nn.Module):
    def __init__(self, cfg, group):
        super().__init__()
        self.block = parallelize(TransformerBlock(cfg), group)

    def forward(self, x):
        return self.block(x)


def head_table(cfg, std: float | None = None) -> torch.nn.Embedding:
    """The last stage's own word-embedding table, initialised as Hugging Face initialises DistilBERT's
    (normal, std cfg.initializer_range), as the tied rows' table is. torch's default, N(0, 1), gives
    logits of std ~17: 4 % of the loss's exp inputs fall below ln(FLT_MIN) ≈ −87.3, where float32
    exp underflows and takes its slow path (python -m benchmarks.planner_logits); in the pp2·tp2
    row that table made the last stage's loss forward 24-45 ms of CPU a step instead of 15-18
    (python -m benchmarks.planner_phases --head-std 1), work the planner does not model."""
    table = torch.nn.Embedding(cfg.vocab_size, cfg.dim)
    torch.nn.init.normal_(table.weight, std=cfg.initializer_range if std is None else std)
    return table


class _DistilHead(torch.nn.Module):
    """The last stage's output layer: its own vocab-parallel copy of a word-embedding table (the
    planner counts a tied embedding's copy on the last stage), logits = xEᵀ on this rank's slice."""

    def __init__(self, cfg, group):
        super().__init__()
        self.comm = tp_comm(group, "head")
        self.table = VocabParallelEmbedding(head_table(cfg), self.comm)

    def forward(self, x):
        return copy_to_tp(x, self.comm) @ self.table.weight.t()


def _tp_pp_rank(rank, world, m: Model, tp: int, mb: int, micro: int, steps: int):
    """pp = 2 × tp × dp = world / (2·tp) (3D): Hugging Face's DistilBERT blocks (eager attention)
    sharded by tensor_parallel.parallelize on each stage of pipeline_parallel's engine (1F1B,
    `micro` micro-batches of mb) over one primitives.mesh; the embedding vocab-parallel on the
    first stage, the output layer and the vocab-parallel loss on the last."""
    base = _warm()
    mesh = Mesh.build(dp=world // (2 * tp), pp=2, tp=tp)
    cfg = DistilBertConfig(vocab_size=m.vocab, dim=m.hidden, n_heads=m.heads, hidden_dim=m.f, n_layers=m.layers,
                           dropout=0.0, attention_dropout=0.0, max_position_embeddings=m.positions)
    cfg._attn_implementation = "eager"
    torch.manual_seed(0)
    g, half = mesh.tp_group, m.layers // 2
    layers = ([LayerSpec(_DistilEmbed, cfg, g)] + [LayerSpec(_DistilBlock, cfg, g) for _ in range(m.layers)]
              + [LayerSpec(_DistilHead, cfg, g)])
    comm = tp_comm(g, "loss")
    pm = PipelineModule(layers, num_stages=2, partition_method=[1 + half, m.layers - half + 1],
                        loss_fn=lambda logits, y: vocab_parallel_cross_entropy(logits.flatten(0, 1), y.flatten(), m.vocab, comm))
    engine, *_ = pipe_initialize(model=pm, config={
        "train_micro_batch_size_per_gpu": mb, "gradient_accumulation_steps": micro,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-4, "torch_adam": True}},
        "pipeline": {"schedule": "1f1b"}}, mesh=mesh)
    x = torch.randint(0, m.vocab, (mb, m.seq), generator=torch.Generator().manual_seed(mesh.coords[1]))
    return _timed(lambda: engine.train_batch(data_iter=iter([(x, x)] * micro)), steps, base)
