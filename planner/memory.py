"""Peak memory per accelerator of one layout: model states, activations, buffers, working set.

    python -m planner gpt-39b --gpus 512 --hardware a100 --json plan.json

Model states: the ZeRO paper's per-rank bytes (zero_from_scratch.engine.ledger.model_state_bytes,
arXiv 1910.02054) for the parameters one (tp, pp) shard holds; offload moves the fp32 master and
Adam's m, v to the host (ZeRO-Offload, arXiv 2101.06840).
Activations per layer and micro-batch: Korthikanti et al. 2022 (arXiv 2205.05198), eq. 1-5
(tensor_parallel.engine.formulas.megatron_activation_bytes), 16-bit activations:
    none       s·b·h·(34 + 5·a·s/h)  with the tp / sp divisions
    selective  the 5·a·s/h term (attention scores, softmax, its dropout) recomputed: s·b·h·34 (/t)
    full       only each layer's input kept: 2·s·b·h (/t with sp), plus one layer's activations
               rebuilt during its backward (working set)
The first pipeline stage holds min(p, m) micro-batches in flight (1F1B), L/p layers each, so
L layers' worth; interleaving with v chunks multiplies that by 1 + (p-1)/(p·v) (Korthikanti §4.2.3).
The last stage keeps the fp32 logits of one micro-batch, 4·s·b·V/t bytes (Korthikanti §4.3).
fp32 runs of that layer (bytes_per_elem 4) double the 16-bit activation bytes.

The activation family follows the hardware (Hardware.activations): "megatron-16bit" above for
GPUs; "torch-eager-fp32" for cpu-here, where the layers that run are torch's own
(torch_layer_activation_bytes: nn.TransformerEncoderLayer, pre-norm, ReLU, no dropout, in fp32)
and the peak is taken when it happens on that engine: in the loss's backward (the saved
activations plus the logits' two gradients) or, after backward, while a flat gradient copy is
reduced (ZeRO-0), whichever is larger (torch_peak_working).
"""
from __future__ import annotations

from planner.host_memory import allocator_slack, runtime_bytes
from primitives.engine.shm_segment import BUFS, SLOT_BYTES, SLOTS, WS_BYTES
from tensor_parallel.engine.formulas import megatron_activation_bytes
from zero_from_scratch.engine.comm import RS_PIECE_BYTES
from zero_from_scratch.engine.ledger import model_state_bytes

ZERO3_MAX_LIVE = 1e9      # DeepSpeed's stage3_max_live_parameters and stage3_max_reuse_distance defaults (elements)


def stage_params(model, lay, stage: str) -> int:
    """Parameters one rank of the first or last pipeline stage holds (after tp)."""
    t, p = lay.tp, lay.pp
    n = model.layers // p * model.layer_params() // t
    if stage == "first" or p == 1:
        n += model.embedding_params() // t
    if stage == "last" or p == 1:
        n += model.head_params() // t
        if model.tied and p > 1:
            n += model.vocab * model.hidden // t      # the last stage keeps its own copy of the tied embedding
    return n


def end_params(model, lay, stage: str) -> int:
    """The stage's parameters beside its layers: the embedding, the head, the final norm (after tp)."""
    return stage_params(model, lay, stage) - model.layers // lay.pp * model.layer_params() // lay.tp


def layer_activation_bytes(model, seq: int, lay, bpe: int, recompute: str | None = None) -> float:
    rc = recompute or lay.recompute
    s, b, h, a, t = seq, lay.mb, model.hidden, model.heads, lay.tp
    if rc == "full":
        x = 2 * s * b * h / (t if lay.sp else 1)
    elif rc == "selective":
        x = megatron_activation_bytes(s, b, h, 0, t, lay.sp)      # a = 0 drops the 5·a·s/h term
    else:
        x = megatron_activation_bytes(s, b, h, a, t, lay.sp)
    return x * bpe / 2


def torch_layer_activation_bytes(model, seq: int, lay, recompute: str | None = None) -> float:
    """Bytes autograd saves for one torch.nn.TransformerEncoderLayer(norm_first=True, dropout=0,
    activation=relu) in fp32, per micro-batch of b sequences of s tokens:

        4·s·b·(8h + f + a + 4)

    derived from what each op saves for its backward (tests/test_planner_formulas.py counts the saved
    storages with torch.autograd.graph.saved_tensors_hooks and finds this exactly):
        LayerNorm 1        its input x (s·b·h) and mean, rstd (2·s·b)
        in_proj            its input, LayerNorm 1's output (s·b·h); its weight is a parameter
        attention          CPU scaled_dot_product_attention (the flash kernel; need_weights=False):
                           q, k, v (3·s·b·h), its output (s·b·h) and the log-sum-exp (a·s·b);
                           no s×s scores are kept
        out_proj           its input, the heads merged into a contiguous copy (s·b·h)
        LayerNorm 2        its input, x + attention (s·b·h), mean, rstd (2·s·b)
        linear1            its input, LayerNorm 2's output (s·b·h)
        ReLU + linear2     one tensor: ReLU keeps its output, linear2 the same one as input (s·b·f)
    Korthikanti's 34·s·b·h for Megatron's layer also keeps dropout masks, GELU's input beside its
    output and 16-bit copies; here: 8h + f = 12h with f = 4h. Selective recomputation saves
    nothing on this layer (there are no s×s scores to drop). With tensor parallelism the
    tensors inside the parallel region (q, k, v, the attention output and its copy, the ReLU
    output, a) divide by t; the norms and the linears' inputs stay whole; full recomputation keeps
    the layer's input (4·s·b·h). (tp and recomputation are this formula's extrapolation: the
    local checks run tp = 1 without recomputation.)
    """
    rc = recompute or lay.recompute
    s, b, h, a, f, t = seq, lay.mb, model.hidden, model.heads, model.f, lay.tp
    if rc == "full":
        return 4 * s * b * h / (t if lay.sp else 1)
    if model.gated:
        return llama_layer_activation_bytes(model, seq, lay)
    if model.family == "distilbert":
        return distilbert_layer_activation_bytes(model, seq, lay)
    return 4 * s * b * (4 * h + 4 + (4 * h + f + a) / t)


def distilbert_layer_activation_bytes(model, seq: int, lay) -> float:
    """Bytes autograd saves for one Hugging Face DistilBERT TransformerBlock (post-norm, GELU,
    eager attention, dropout 0, fp32), sharded by tensor_parallel.parallelize over t ranks:

        4·s·b·(4h + 4 + (4h + 2f + a·s)/t)

    Korthikanti et al.'s per-layer terms (arXiv 2205.05198 §4.1) where they apply, in fp32 and
    without dropout (so none of their masks, and the softmax's output is the one s×s tensor kept
    for both its own backward and the product with V):
        outside the parallel region  q/k/v's shared input (s·b·h), out_lin + residual → LayerNorm 1
                                     input and its mean, rstd (s·b·h + 2·s·b), lin1's input (s·b·h),
                                     LayerNorm 2's input, mean, rstd (s·b·h + 2·s·b)
        inside, divided by t         Q and Kᵀ for QKᵀ (2·s·b·h), the softmax output (a·s²·b), V and
                                     the context, out_lin's input (2·s·b·h), GELU's input and its
                                     output, lin2's input (2·s·b·f)
    tests/test_planner_formulas.py counts the saved storages at t = 1 and finds exactly this."""
    s, b, h, a, f, t = seq, lay.mb, model.hidden, model.heads, model.f, lay.tp
    return 4 * s * b * (4 * h + 4 + (4 * h + 2 * f + a * s) / t)


def llama_layer_activation_bytes(model, seq: int, lay) -> float:
    """Bytes autograd saves for one Hugging Face LlamaDecoderLayer (SDPA attention, causal, fp32;
    pipeline_parallel/models/llama.py's block), per micro-batch of b sequences of s tokens,
    d = h/a, kv key-value heads:

        4·(s·b·(8h + 4f + 2·kv·d + a + 2) + 2·s·d)

    op by op (tests/test_planner_formulas.py counts it with saved_tensors_hooks):
        RMSNorm 1          its input, its normalized input before the weight, the weighted output
                           the q, k, v projections share as input (3·s·b·h), rstd (s·b)
        rotary             cos and sin, one s × d table each, shared by the batch (2·s·d)
        attention          SDPA's flash kernel: q (s·b·h), k and v (2·s·b·kv·d), its output, also
                           o_proj's input as a view (s·b·h), the log-sum-exp (a·s·b)
        RMSNorm 2          as RMSNorm 1 on x + attention (3·s·b·h + s·b)
        SwiGLU             gate's output (SiLU's input), up's output, SiLU's output, and their
                           product, down's input (4·s·b·f)
    With tensor parallelism the tensors inside the parallel region (q, k, v, the attention
    output, the log-sum-exp, the four f-wide ones) divide by t (an extrapolation: the local
    checks run t = 1)."""
    s, b, h, a, f, t = seq, lay.mb, model.hidden, model.heads, model.f, lay.tp
    d = h // a
    return 4 * (s * b * (6 * h + 2 + (2 * h + 4 * f + 2 * model.kv * d + a) / t) + 2 * s * d)


def torch_head_bytes(model, seq: int, lay) -> tuple[float, float]:
    """(saved, transient) bytes of the last stage's top in fp32: the final LayerNorm keeps its input,
    mean, rstd, the logits matmul its input (2·s·b·h + 2·s·b), cross-entropy's log-softmax its
    output (s·b·V) and nll_loss its total weight (one fp32 scalar) (DistilBERT with
    tensor_parallel's vocab-parallel loss: the head's input and the local softmax, 4·s·b·(h + V/t));
    in the loss's backward the log-softmax's incoming gradient and its output
    gradient (2·s·b·V) live beside them: the step's peak for a small model. A gated (llama) model:
    RMSNorm's three s·b·h and rstd, and HF's shifted causal loss over b·(s−1) rows."""
    s, b, h, V = seq, lay.mb, model.hidden, model.vocab / lay.tp
    if model.family == "distilbert":    # the tied head's input and the vocab-parallel softmax (tensor_parallel.cross_entropy)
        return 4 * s * b * (h + V), 4 * 2 * s * b * V
    if model.gated:    # llama: RMSNorm keeps 3·s·b·h + s·b; HF's causal loss shifts by one, b·(s−1) rows
        return 4 * (3 * s * b * h + s * b + b * (s - 1) * V) + 4, 4 * 2 * s * b * V
    return 4 * s * b * (2 * h + 2 + V) + 4, 4 * 2 * s * b * V



def _states(lay, psi: float, mixed: bool) -> dict:
    """Model-state bytes per GPU (the ZeRO ledger's formula); the optimizer's leave with offload."""
    st = model_state_bytes(lay.zero, psi, lay.dp, mixed)
    return {"params": float(st["params"]), "grads": float(st["grads"]),
            "optimizer": 0.0 if lay.offload else float(st["master"] + st["optimizer"])}


def _heavier(best, out: dict, work: float, hw, stage: str) -> dict:
    """out completed (working set, the hardware's reserve, total) if it outweighs best, else best."""
    out = {**out, "working": work, "reserved": hw.reserved}
    out["total"] = sum(out.values())
    return {**out, "stage": stage} if best is None or out["total"] > best["total"] else best

def memory(model, seq: int, lay, global_batch: int, hw, sw=None) -> dict:
    """{term: bytes} of the heavier of the first and last pipeline stage; 'total' their sum."""
    bpe = hw.bytes_per_elem
    mixed = bpe == 2
    m = lay.micro_batches(global_batch)
    if hw.activations == "torch-eager-fp32":
        return torch_memory(model, seq, lay, global_batch, hw, sw)
    best = None
    for stage in ("first", "last"):
        psi = stage_params(model, lay, stage)
        out = _states(lay, psi, mixed)
        per_layer = layer_activation_bytes(model, seq, lay, bpe)
        if stage == "first":
            inflight = min(lay.pp, m)
            inter = 1 + (lay.pp - 1) / (lay.pp * lay.v) if lay.v > 1 else 1.0
            out["activations"] = model.layers / lay.pp * inflight * per_layer * inter \
                + inflight * seq * lay.mb * model.hidden * bpe / lay.tp     # embedding output
        else:
            out["activations"] = model.layers / lay.pp * per_layer + 4 * seq * lay.mb * model.vocab / lay.tp
        work = 0.0
        if lay.recompute == "full":
            work += layer_activation_bytes(model, seq, lay, bpe, "selective")
        if lay.zero == 3:   # two gathered layers: the one computing and the one prefetched
            work += 2 * model.layer_params() / lay.tp * bpe
        if lay.sp or lay.tp > 1:     # an all-gathered (or all-reduced) b·s·h input
            work += seq * lay.mb * model.hidden * bpe
        work += seq * lay.mb * model.f / lay.tp * bpe                  # the widest matmul output
        best = _heavier(best, out, work, hw, stage)
    return best


def zero_unit(model, lay, psi: int, bucket: int = 500_000_000) -> int:
    """Elements of the largest unit zero_from_scratch communicates as one flat buffer
    (zero_from_scratch/sharding.py): ZeRO-0..2 buckets of consecutive parameters up to
    reduce_bucket_size (DeepSpeed's default 5e8: the whole stage for any model here), ZeRO-3 one
    module's parameters (the largest: the embedding, in_proj's 3h × h or the MLP's h × f)."""
    if lay.zero < 3:
        return min(psi, bucket)
    h = model.hidden
    return max(model.vocab * h, 3 * h * h, h * model.f) // lay.tp


def shm_bytes(model, seq: int, lay, hw, piece: float = RS_PIECE_BYTES) -> float:
    """Bytes of the shared-memory transport's segments a rank touches (primitives.engine.shm_segment),
    resident in each process that maps them; ranks on other hosts share none. A collective's group of
    k ranks on the host uses each member's BUFS workspaces of WS_BYTES up to its message per round
    (k·BUFS·min(WS_BYTES, S)); zero_from_scratch's dp rings (its comm forces them) and a pipeline's
    sends (activations, gradients, the tied weights' gradients; a tp rank sends its stage's whole
    b·s·h) go point to point through one channel each way, SLOTS slots of SLOT_BYTES up to the
    largest send (2·SLOTS·min(SLOT_BYTES, send); the ring's, `piece`). Measured (RssShmem) on the
    rows of benchmarks.planner_local."""
    G, t = hw.gpus_per_node, lay.tp
    S = seq * lay.mb * model.hidden * hw.bytes_per_elem          # one micro-batch's b·s·h
    out = 0.0
    k_dp = min(lay.dp, max(1, G // t))                            # a dp group's ranks on this host
    if k_dp > 1:                                                  # the gradients' reduction: buckets ≥ a workspace or a channel
        out += 2 * SLOTS * min(SLOT_BYTES, piece) if lay.zero >= 1 else k_dp * BUFS * WS_BYTES
    if min(t, G) > 1:                                             # the layers' all-reduces of b·s·h
        out += min(t, G) * BUFS * min(WS_BYTES, S)
    if lay.pp > 1 and t * lay.dp * lay.pp <= G:
        msg = max(S, model.vocab * model.hidden * hw.bytes_per_elem / t if model.tied else 0.0)   # whole b·s·h per tp rank
        out += 2 * SLOTS * min(SLOT_BYTES, msg)
    return out


def maps_blocks(lay, hw, sw) -> bool:
    """Whether the host allocator maps every large block: asked for (Software.mapped_alloc), or
    ringzero's ZeRO-3 engine on a CPU host, which fixes glibc's mmap threshold at 64 KiB
    (zero_from_scratch.engine.allocator)."""
    return bool(sw and sw.mapped_alloc) or (lay.zero == 3 and hw.activations == "torch-eager-fp32")


def torch_memory(model, seq: int, lay, global_batch: int, hw, sw=None) -> dict:
    """memory() for torch's eager fp32 layers (module docstring). Model states from the ZeRO
    ledger (fp32: 4 + 4 + 8 bytes per parameter, sharded by stage). Activations: L/p layers ×
    in-flight micro-batches (1F1B: min(p, m) on the first stage); the embedding keeps only its
    indices (DistilBERT's also its LayerNorm's input, mean and rstd), the last stage its top
    (torch_head_bytes). Working, what lives beside them at the peak:
      the loss backward's two logit gradients (last stage), or for ZeRO-0 the flat gradient copy
        that is all-reduced after backward when the activations are gone (4Ψ minus the
        activations it outlives), whichever is larger;
      the shared-memory transport's segments the rank touches (shm_bytes);
      ZeRO ≥ 1 through zero_from_scratch (u = zero_unit, its largest flat unit): the ring
        reduce-scatter's scratch, kept by comm.scratch and written in turn, one per step of N − 1,
        each a block 4u/N or the engine's piece (RS_PIECE_BYTES) when smaller (reduce_scatter.py::
        ring, engine/comm.py::_rs_pieces); ZeRO-2/3 the gradient bucket pool's one buffer of
        4u (zero_from_scratch/engine/stages.py::BucketPool, overlap_comm off); ZeRO-3 the
        gathered units' pool (engine/pools.py): at DeepSpeed's defaults the engine keeps each
        unit gathered from its forward to its backward up to ZERO3_MAX_LIVE elements
        (engine/prefetch.py), so the pool holds 4·min(Ψ, ZERO3_MAX_LIVE) bytes at the peak.
    Runtime: what the first steps map beside the tensors, per layer family and the ZeRO engine
    (runtime_bytes: kernel code pages, the runtime's small blocks), probed once on this machine.
    Allocator: glibc's slack at its defaults, per layer family and engine (allocator_slack); nothing
    when large blocks are mapped (maps_blocks: a freed block leaves the resident set at once)."""
    m = lay.micro_batches(global_batch)
    best = None
    for stage in ("first", "last"):
        psi = stage_params(model, lay, stage)
        out = _states(lay, psi, False)
        if lay.offload:     # the host is the device: the fp32 master and Adam's m, v stay in the rank's memory
            out["optimizer"] = 12.0 * psi / lay.dp
        per_layer = torch_layer_activation_bytes(model, seq, lay)
        inflight = min(lay.pp, m) if stage == "first" else 1
        acts = model.layers / lay.pp * inflight * per_layer * (1 + (lay.pp - 1) / (lay.pp * lay.v) if lay.v > 1 else 1.0)
        if model.family == "distilbert" and (stage == "first" or lay.pp == 1):   # the embedding's LayerNorm input, mean, rstd
            acts += inflight * 4 * seq * lay.mb * (model.hidden + 2)
        transient = 0.0
        if stage == "last" or lay.pp == 1:
            saved, transient = torch_head_bytes(model, seq, lay)
            acts += saved
        out["activations"] = acts
        work = transient
        if lay.zero == 0 and lay.dp > 1:
            work = max(work, 4 * psi - acts)
        u = zero_unit(model, lay, psi)
        piece = min(4 * u / lay.dp, RS_PIECE_BYTES)          # one send of the ring reduce-scatter
        work += shm_bytes(model, seq, lay, hw, piece)
        if lay.zero >= 1:
            work += min(2, lay.dp - 1) * piece + (4 * u if lay.zero >= 2 else 0) + (4 * min(psi, ZERO3_MAX_LIVE) if lay.zero == 3 else 0)
        out["runtime"] = runtime_bytes(model, lay)
        blocks = {"activations": acts, "logit_grads": transient, "ends": 4 * end_params(model, lay, stage)}
        out["allocator"] = 0.0 if maps_blocks(lay, hw, sw) else allocator_slack(model, lay, seq, blocks, hw, m)
        best = _heavier(best, out, work, hw, stage)
    return best
