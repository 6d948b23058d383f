"""parallelize(model, group=None, sequence_parallel=False): shard a model over a tensor-parallel
group in place, from its unsharded weights, with the textbook layers (tensor_parallel/layers.py)
over the group's communicator. state_dict.py undoes it.

    torchrun --standalone --nproc_per_node 2 classification/parallel/train.py --tp 2

Two kinds of model (anything else is a TPError naming its class):
  * Hugging Face DistilBERT (ForSequenceClassification, Model, or one TransformerBlock: a pipeline
    stage's share, no SP there): word embeddings → VocabParallelEmbedding; attention heads split
    (q/k/v column-parallel with one f for the three, out_lin row-parallel; heads need not divide tp,
    each rank needs ≥ 1); FFN lin1 column, lin2 row; the rest replicated (small)
  * an nn.Sequential MLP stack: consecutive Linear pairs (elementwise modules between) become
    column → row; a last unpaired Linear stays replicated.
Cost per transformer layer and step: 4 all-reduces of b·s·h, or with sequence_parallel=True
(Megatron-SP) 6 all-gathers + 4 reduce-scatters of b·s·h/N per rank (formulas.py); SP parameters
(LayerNorms, row biases) see a sequence slice, so a hook all-reduces their gradients. Forward and
backward must run on every rank of the group in the same order (or the communicator's timeout
names the missing peer).
"""
from __future__ import annotations

from torch import nn

from primitives.engine.registry import get_comm
from tensor_parallel.comm import all_reduce_grad, copy_to_tp, gather_seq, gather_seq_to_replicated, split_seq
from tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear, TPError, VocabParallelEmbedding

ELEMENTWISE = (nn.ReLU, nn.GELU, nn.SiLU, nn.Tanh, nn.Sigmoid, nn.Dropout, nn.Identity, nn.LeakyReLU)


def tp_comm(group, what: str):
    """The communicator of `group` (a process group, None = the world, or a communicator); a
    rank outside the group gets a TPError naming `what`."""
    try:
        return get_comm(group)
    except ValueError as e:
        raise TPError(f"{what}: {e} (every rank that calls a parallel layer must be in its group)") from None


def parallelize(model: nn.Module, group=None, sequence_parallel: bool = False) -> nn.Module:
    """Shard `model` in place over `group` (None = the world) and return it."""
    comm = tp_comm(group, "parallelize")
    if getattr(model, "tp_comm", None) is not None:
        raise TPError(f"rank {comm.rank}: parallelize: this {type(model).__name__} is already parallelized")
    kind = type(model).__name__
    if kind in ("DistilBertForSequenceClassification", "DistilBertModel"):
        _distilbert(model, comm, sequence_parallel)
    elif kind == "TransformerBlock" and hasattr(model, "attention") and hasattr(model, "ffn"):
        # one DistilBERT block, as a pipeline stage holds them (classification/parallel/pipeline.py)
        if sequence_parallel:
            raise TPError(f"rank {comm.rank}: parallelize: sequence_parallel=True shards the sequence between "
                          "blocks, which needs the whole model (its entry and exit hooks); pass a "
                          "DistilBertForSequenceClassification, or False for a single TransformerBlock")
        _check_sizes(model, model.attention.config, comm)
        _block(model, comm, False)
    elif isinstance(model, nn.Sequential):
        if sequence_parallel:
            raise TPError(f"rank {comm.rank}: parallelize: sequence_parallel=True needs a transformer (LayerNorm "
                          "and dropout regions between TP blocks); an MLP stack has none. Pass False.")
        _mlp(model, comm)
    else:
        raise TPError(f"rank {comm.rank}: parallelize: no tensor-parallel plan for module {kind!r}; known: "
                      "DistilBertForSequenceClassification, DistilBertModel, a DistilBERT TransformerBlock, "
                      "nn.Sequential MLP stacks")
    model.tp_comm, model.tp_sequence_parallel = comm, sequence_parallel
    return model


def _check_sizes(model, cfg, comm):
    n, heads = comm.size, cfg.n_heads
    if heads < n:
        raise TPError(f"rank {comm.rank}: parallelize: {type(model).__name__} has {heads} attention heads, fewer "
                      f"than tp={n}: every rank needs at least one head")
    if cfg.hidden_dim < n:
        raise TPError(f"rank {comm.rank}: parallelize: FFN hidden size {cfg.hidden_dim} < tp={n}")


def _distilbert(model, comm, sp):
    db = model.distilbert if hasattr(model, "distilbert") else model
    _check_sizes(model, db.config, comm)
    db.embeddings.word_embeddings = VocabParallelEmbedding(db.embeddings.word_embeddings, comm)
    for block in db.transformer.layer:
        _block(block, comm, sp)
    if sp:
        # enter the sequence-parallel region after the (replicated) embeddings, leave it before the head
        db.transformer.register_forward_pre_hook(_split_hook(comm), with_kwargs=True)
        db.transformer.register_forward_hook(_gather_hook(comm))
        for p in model.parameters():
            if getattr(p, "tp_sequence_parallel", False):
                p.register_hook(lambda g, comm=comm: all_reduce_grad(g, comm))


def _block(block, comm, sp):
    """One DistilBERT TransformerBlock: heads split (q/k/v column, out_lin row), FFN column → row."""
    att = block.attention
    hd = att.config.dim // att.config.n_heads
    for name in ("q_lin", "k_lin", "v_lin"):
        setattr(att, name, ColumnParallelLinear(getattr(att, name), comm, unit=hd, input_comm=False))
    att.out_lin = RowParallelLinear(att.out_lin, comm, unit=hd, sequence_parallel=sp)
    att.register_forward_pre_hook(_enter_hook(comm, sp), with_kwargs=True)   # one f (or ḡ) for Q, K, V
    att.tp_local_heads = att.q_lin.weight.shape[0] // hd
    block.ffn.lin1 = ColumnParallelLinear(block.ffn.lin1, comm, sequence_parallel=sp)
    block.ffn.lin2 = RowParallelLinear(block.ffn.lin2, comm, sequence_parallel=sp)
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


def _enter_hook(comm, sp):
    def hook(module, args, kwargs):
        return _replace_first(args, kwargs, lambda x: gather_seq(x, comm, 1, regather=True) if sp
                              else copy_to_tp(x, comm))
    return hook


def _split_hook(comm):
    def hook(module, args, kwargs):
        def split(x):
            if x.shape[1] % comm.size:
                raise TPError(f"rank {comm.rank}: sequence parallelism needs the sequence length ({x.shape[1]}) "
                              f"divisible by tp={comm.size}; pad the batch to a multiple of {comm.size}")
            return split_seq(x, comm, 1)
        return _replace_first(args, kwargs, split)
    return hook


def _gather_hook(comm):
    def hook(module, args, kwargs_or_out, out=None):
        out = kwargs_or_out if out is None else out
        out.last_hidden_state = gather_seq_to_replicated(out.last_hidden_state, comm, 1)
        return out
    return hook


def _mlp(seq: nn.Sequential, comm):
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
        seq[a] = ColumnParallelLinear(seq[a], comm)
        seq[b] = RowParallelLinear(seq[b], comm)
