"""parallelize(model, group=None, sequence_parallel=False): shard a model over a tensor-parallel
group in place, from its unsharded weights; gather_state_dict(model) undoes it, and
load_full_state_dict(model, sd) loads an unsharded state dict into the sharded model.

    torchrun --standalone --nproc_per_node 2 classification/parallel/train.py --tp 2

Knows two kinds of model (anything else is a TPError naming its class):
  * Hugging Face DistilBertForSequenceClassification / DistilBertModel, or one of its
    TransformerBlocks (a pipeline stage's share: classification/parallel/pipeline.py; no SP there)
      word embeddings   → VocabParallelEmbedding (rows by vocabulary id, then g)
      attention         → heads split: q/k/v column-parallel (one f for the three), out_lin
                          row-parallel (g); heads need not divide tp, each rank needs ≥ 1
      FFN               → lin1 column-parallel (f), lin2 row-parallel (g)
      position embeddings, LayerNorms, the classifier head: replicated (they are small)
  * an nn.Sequential MLP stack: consecutive Linear pairs (with elementwise modules between)
    become column → row; a last unpaired Linear stays replicated.

Per transformer layer and step (b·s·h activations): plain TP runs 4 all-reduces (2 forward g,
2 backward f); with sequence_parallel=True (Megatron-SP) each becomes a reduce-scatter or
all-gather, plus one all-gather per column-parallel input in backward (Q/K/V share one, lin1
one), since those layers save only the sequence shard: 6 all-gathers + 4 reduce-scatters of
b·s·h/N per rank (1.25× the bytes), while LayerNorm, residual, dropout and the saved inputs
of Q/K/V and lin1 hold only s/N of the sequence. SP params (LayerNorms, row
biases) see a sequence slice, so their gradients are all-reduced over the group by a hook.
Forward and backward must run on every rank of the group in the same order (or they hang
until the communicator's timeout names the missing peer).
"""
from __future__ import annotations

from torch import nn

from tensor_parallel import comm as C
from tensor_parallel.layers import (ColumnParallelLinear, RowParallelLinear, TPError, VocabParallelEmbedding,
                                    _comm, _pad_gather)

ELEMENTWISE = (nn.ReLU, nn.GELU, nn.SiLU, nn.Tanh, nn.Sigmoid, nn.Dropout, nn.Identity, nn.LeakyReLU)


def parallelize(model: nn.Module, group=None, sequence_parallel: bool = False) -> nn.Module:
    """Shard `model` in place over `group` (None = the world) and return it."""
    comm = _comm(group, "parallelize")
    if getattr(model, "tp_group_size", None) is not None:
        raise TPError(f"rank {comm.rank}: parallelize: this {type(model).__name__} is already parallelized")
    kind = type(model).__name__
    if kind in ("DistilBertForSequenceClassification", "DistilBertModel"):
        _distilbert(model, group, comm, sequence_parallel)
    elif kind == "TransformerBlock" and hasattr(model, "attention") and hasattr(model, "ffn"):
        # one DistilBERT block, as a pipeline stage holds them (classification/parallel/pipeline.py)
        if sequence_parallel:
            raise TPError(f"rank {comm.rank}: parallelize: sequence_parallel=True shards the sequence between "
                          "blocks, which needs the whole model (its entry and exit hooks); pass a "
                          "DistilBertForSequenceClassification, or False for a single TransformerBlock")
        _check_sizes(model, model.attention.config, comm)
        _block(model, group, comm, False)
    elif isinstance(model, nn.Sequential):
        if sequence_parallel:
            raise TPError(f"rank {comm.rank}: parallelize: sequence_parallel=True needs a transformer (LayerNorm "
                          "and dropout regions between TP blocks); an MLP stack has none. Pass False.")
        _mlp(model, group, comm)
    else:
        raise TPError(f"rank {comm.rank}: parallelize: no tensor-parallel plan for module {kind!r}; known: "
                      "DistilBertForSequenceClassification, DistilBertModel, a DistilBERT TransformerBlock, "
                      "nn.Sequential MLP stacks")
    model.tp_group_size, model.tp_group, model.tp_sequence_parallel = comm.size, group, sequence_parallel
    return model


def _check_sizes(model, cfg, comm):
    n, heads = comm.size, cfg.n_heads
    if heads < n:
        raise TPError(f"rank {comm.rank}: parallelize: {type(model).__name__} has {heads} attention heads, fewer "
                      f"than tp={n}: every rank needs at least one head")
    if cfg.hidden_dim < n:
        raise TPError(f"rank {comm.rank}: parallelize: FFN hidden size {cfg.hidden_dim} < tp={n}")


def _distilbert(model, group, comm, sp):
    db = model.distilbert if hasattr(model, "distilbert") else model
    _check_sizes(model, db.config, comm)
    db.embeddings.word_embeddings = VocabParallelEmbedding(db.embeddings.word_embeddings, group)
    for block in db.transformer.layer:
        _block(block, group, comm, sp)
    if sp:
        # enter the sequence-parallel region after the (replicated) embeddings, leave it before the head
        db.transformer.register_forward_pre_hook(_split_hook(group, comm), with_kwargs=True)
        db.transformer.register_forward_hook(_gather_hook(group))
        for p in model.parameters():
            if getattr(p, "tp_sequence_parallel", False):
                p.register_hook(lambda g, group=group: C.all_reduce_grad(g, group))


def _block(block, group, comm, sp):
    """One DistilBERT TransformerBlock: heads split (q/k/v column, out_lin row), FFN column → row."""
    att = block.attention
    hd = att.config.dim // att.config.n_heads
    for name in ("q_lin", "k_lin", "v_lin"):
        setattr(att, name, ColumnParallelLinear(getattr(att, name), group, unit=hd, input_comm=False))
    att.out_lin = RowParallelLinear(att.out_lin, group, unit=hd, sequence_parallel=sp)
    att.register_forward_pre_hook(_enter_hook(group, sp), with_kwargs=True)   # one f (or ḡ) for Q, K, V
    att.tp_local_heads = att.q_lin.weight.shape[0] // hd
    block.ffn.lin1 = ColumnParallelLinear(block.ffn.lin1, group, sequence_parallel=sp)
    block.ffn.lin2 = RowParallelLinear(block.ffn.lin2, group, sequence_parallel=sp)
    if sp:
        for ln in (block.sa_layer_norm, block.output_layer_norm):
            for p in ln.parameters():
                p.tp_sequence_parallel = True


def _replace_first(args, kwargs, fn):
    if args:
        return (fn(args[0]),) + tuple(args[1:]), kwargs
    kwargs = dict(kwargs)
    kwargs["hidden_states"] = fn(kwargs["hidden_states"])
    return args, kwargs


def _enter_hook(group, sp):
    def hook(module, args, kwargs):
        return _replace_first(args, kwargs, lambda x: C.gather_seq(x, 1, group, regather=True) if sp
                              else C.copy_to_tp(x, group))
    return hook


def _split_hook(group, comm):
    def hook(module, args, kwargs):
        def split(x):
            if x.shape[1] % comm.size:
                raise TPError(f"rank {comm.rank}: sequence parallelism needs the sequence length ({x.shape[1]}) "
                              f"divisible by tp={comm.size}; pad the batch to a multiple of {comm.size}")
            return C.split_seq(x, 1, group)
        return _replace_first(args, kwargs, split)
    return hook


def _gather_hook(group):
    def hook(module, args, kwargs_or_out, out=None):
        out = kwargs_or_out if out is None else out
        out.last_hidden_state = C.gather_seq_to_replicated(out.last_hidden_state, 1, group)
        return out
    return hook


def _mlp(seq: nn.Sequential, group, comm):
    names = list(seq._modules)
    linears = [i for i, k in enumerate(names) if isinstance(seq[i], nn.Linear)]
    for i, k in enumerate(names):
        if not isinstance(seq[i], (nn.Linear,) + ELEMENTWISE):
            raise TPError(f"rank {comm.rank}: parallelize: MLP stack entry {k!r} is a {type(seq[i]).__name__}; an "
                          f"MLP plan handles Linear and elementwise modules ({', '.join(c.__name__ for c in ELEMENTWISE)})")
    if len(linears) < 2:
        raise TPError(f"rank {comm.rank}: parallelize: an MLP stack needs at least two Linear layers to pair "
                      f"column → row, found {len(linears)}")
    for a, b in zip(linears[0::2], linears[1::2]):
        seq[a] = ColumnParallelLinear(seq[a], group)
        seq[b] = RowParallelLinear(seq[b], group, input_is_parallel=True)


def gather_state_dict(model: nn.Module) -> dict:
    """The full (unsharded) state dict, on every rank. Collective: every rank of the group calls it."""
    group = getattr(model, "tp_group", None)
    if getattr(model, "tp_group_size", None) is None:
        raise TPError("gather_state_dict: this model was not parallelized (call tensor_parallel.engine.parallelize first)")
    shards = {name: (*p.tp_shard, p.tp_unit) for name, p in model.named_parameters() if hasattr(p, "tp_shard")}
    out = {}
    for name, t in model.state_dict().items():
        if name in shards:
            dim, _, _, full, unit = shards[name]
            t = _pad_gather(t.detach().movedim(dim, -1), full, group, unit).movedim(-1, dim).contiguous()
        out[name] = t.detach().clone()
    return out


def load_full_state_dict(model: nn.Module, state_dict: dict) -> None:
    """The inverse of gather_state_dict: load an unsharded state dict (a save_pretrained
    checkpoint) into a parallelized model, each sharded tensor narrowed to this rank's slice.
    Local: no communication (every rank reads the full tensors)."""
    if getattr(model, "tp_group_size", None) is None:
        raise TPError("load_full_state_dict: this model was not parallelized (call tensor_parallel.engine.parallelize first)")
    shards = {name: p.tp_shard for name, p in model.named_parameters() if hasattr(p, "tp_shard")}
    local = {}
    for name, t in state_dict.items():
        if name in shards:
            dim, lo, hi, full = shards[name]
            if t.shape[dim] != full:
                raise TPError(f"load_full_state_dict: {name} has {t.shape[dim]} rows along dim {dim}, the "
                              f"unsharded model has {full}")
            t = t.narrow(dim, lo, hi - lo)
        local[name] = t
    model.load_state_dict(local)


def sharded_numel(model: nn.Module) -> tuple[int, int]:
    """(elements this rank holds, elements of the unsharded model)."""
    local = full = 0
    for p in model.parameters():
        local += p.numel()
        full += p.numel() // (p.tp_shard[2] - p.tp_shard[1]) * p.tp_shard[3] if hasattr(p, "tp_shard") else p.numel()
    return local, full


__all__ = ["parallelize", "gather_state_dict", "load_full_state_dict", "sharded_numel", "TPError"]
