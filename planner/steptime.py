"""Step time of one layout: compute, exposed communication by kind, the pipeline bubble, the
optimizer.

    python -m planner gpt3-175b --gpus 1024 --hardware h100

compute      FLOPs of one micro-batch on one stage (planner.model) at peak·gemm_efficiency, plus
             the memory-bound elementwise work: each activation byte Korthikanti counts
             (planner.memory; without its s×s scores under fused attention) is written and read in
             forward and backward, ~4× its bytes (6× with full recomputation, which runs the
             forward again) at the HBM rate. On a CPU host (cpu-here) the non-matmul work is
             fitted instead (benchmarks.planner_fit): per layer a fixed op_overhead plus
             elementwise_s per byte the layer saves (planner.memory.torch_layer_activation_bytes),
             fitted on torch's layer; Hugging Face's llama layer has a line of its own
             (llama_op_overhead, llama_elementwise_s: more ops, less work per saved byte),
             and logit_s per logit element (with tp, vp_loss_s more per local logit element:
             tensor_parallel's vocab-parallel cross-entropy makes z − max, exp, the softmax and
             its gradient separate passes where torch's log-softmax fuses them); every CPU
             second is stretched by cpu_stretch when the ranks and other runnable tasks
             outnumber the cores, and the ops' rates grow by slice_factor once the ranks alone
             do (fitted on the DDP step at C, 2C and 4C ranks). A pipeline's micro-batches are
             paced by one rank while its neighbours wait (asleep on a futex, no CPU): the r/p
             pacing ranks share the session's P cores, each at most one (pipeline_stretch), and
             all ranks' CPU seconds over P bound the step (the "cores" term), whichever is larger;
             P = cores·ranks / (ranks + load), the load read just before the run (planner.probe). With the engine mapping large blocks (ZeRO-3
             here, zero_from_scratch.engine.allocator) every large block is a fresh mapping: map_layer
             bytes per saved activation byte, map_head per logit byte, mmap_s per byte (the
             "allocator" term; benchmarks.planner_fit_map fits the three); at glibc's defaults
             only a logit block of 32 MiB or more is (its dynamic threshold rises no further):
             the top's four, the logits, log-softmax and their gradients. Mapped, a step also maps
             Adam's two temporaries of the shard and ZeRO-0's flat gradient copy afresh
tp           each collective of Megatron's layer (tensor_parallel.engine.formulas.layer_traffic:
             4 all-reduces of b·s·h, or 6 all-gathers + 4 reduce-scatters with sp) at the α-β cost
             of the node's link (primitives.engine.cost.predict, ring; on a CPU host the ranks' own
             copies, stretched as their compute, group_time); full recomputation repeats
             the forward's half. Overlapped (Megatron-Core --tp-comm-overlap) it hides behind the
             layer's compute: exposed = max(0, comm − compute). Beside the layers: the
             vocab-parallel embedding's all-reduce and the output layer's input (b·s·h each) and
             the vocab-parallel cross-entropy's three all-reduces of b·s floats
pp           each stage sends one activation forward and one gradient back per micro-batch and
             chunk, b·s·h/t bytes (the scatter/gather of Narayanan §4.1); blocking sends add to
             every micro-batch, overlapped ones to the fill and drain and where a micro-batch's
             2·v sends outlast its compute
bubble       1F1B / interleaved: (p−1)/(v·m+p−1) of the pipeline's time
             (pipeline_parallel.schedules.instructions.bubble_formula) with equal stages; when the
             last stage also holds the output layer (balanced_stages=False) it paces the steady
             state and the fill and drain are the other stages' micro-batches: (p−1)/v of theirs
dp           ZeRO-0 one all-reduce of the stage's gradients; ZeRO-1 reduce-scatter + all-gather of
             the parameters; ZeRO-2 the reduce-scatter per micro-batch; ZeRO-3 all-gather forward,
             all-gather backward and reduce-scatter per micro-batch (zero_from_scratch.engine.ledger).
             ZeRO-3 per module with parameters (zero3_units per layer, + embeddings and the final
             norm), so each pays its α; each call also costs the engine's call_overhead of CPU
             (and, at ZeRO-3, zero3_module_s for the engine's per-module hooks).
             Across nodes the two-level hierarchical cost (cost.predict_2level). Overlapped, ZeRO-0..2
             hide behind the last micro-batch's backward, ZeRO-3 behind each micro-batch's compute
wait         on a CPU host whose ranks outnumber its cores (r > C), every blocking collective
             between ranks (each tp all-reduce, each pipeline receive, each dp call; at ZeRO-3
             each module's gathers and reduce-scatter) waits for a peer the scheduler has
             descheduled in favour of its siblings (wait_time), about a scheduler slice
             (hw.wait_s, fitted once by a ping-pong of 2-8 busy processes: benchmarks.planner_fit
             --waits) per unit of the ranks' oversubscription, stretched by the load, for the
             group's k − 1 other members of the r − 1. A pipeline's waits are its siblings'
             turns on the cores: its step is the longer of its path with them and the cores term
optimizer    Adam on the rank's shard, memory-bound (~36 bytes read+written per parameter); offloaded:
             the host's Adam rate plus gradients down and parameters up the host link; on cpu-here
             the host's Adam rate (torch's eager Adam on a CPU is bound by its sqrt, not memory)
"""
from __future__ import annotations

from dataclasses import dataclass, replace

from pipeline_parallel.schedules.instructions import bubble_formula
from primitives.engine.cost import Links, Params, predict, predict_2level
from tensor_parallel.engine.formulas import layer_traffic

from planner.cpu_host import cpu_stretch, pipeline_stretch, session_cores, slice_factor, tp_stretch, wait_time
from planner.hardware import per_step
from planner.host_memory import GLIBC_MMAP_MAX, family
from planner.memory import ZERO3_MAX_LIVE, layer_activation_bytes, maps_blocks, stage_params, torch_layer_activation_bytes


@dataclass(frozen=True)
class Software:
    """What the training engine overlaps and in which dtype it reduces gradients."""
    overlap_dp: bool = True       # Megatron-Core --overlap-grad-reduce / --overlap-param-gather, DeepSpeed overlap_comm
    overlap_tp: bool = True       # --tp-comm-overlap
    overlap_pp: bool = True       # Megatron-Core's non-blocking p2p
    grad_bytes: int = 0           # bytes per gradient element on the wire; 0 → the hardware's dtype
    flash_attention: bool = True  # fused attention: the s×s scores never reach memory
    balanced_stages: bool = True  # the split gives the last stage fewer layers for its output layer, so the
                                  # logits' work spreads over the stages; False: L/p layers each, and the
                                  # last stage, with the whole output layer, paces the pipeline
    mapped_alloc: bool = False    # the host allocator maps every large block (glibc's mmap threshold fixed low):
                                  # nothing kept beyond live tensors, a page fault per page of each fresh block.
                                  # ringzero's ZeRO-3 engine does so on a CPU host whatever this says


def _scaled(p: Params, share: float) -> Params:
    """A link shared by `share` concurrent groups: each gets 1/share of its bandwidth."""
    return Params(p.alpha, p.beta * share, p.gamma, p.o)


def group_time(name: str, n: int, nbytes: float, stride: int, hw, stretch: float = 1.0) -> float:
    """One collective over n ranks `stride` apart (Megatron placement) on hw's links. Within a
    CPU host the link is the ranks' own copies and reductions through shared memory, fitted
    unimpeded (planner.hardware.cpu_here), so it stretches as their compute does (`stretch`, 1
    on a GPU); a wire between nodes does not."""
    if n <= 1 or nbytes <= 0:
        return 0.0
    G = hw.gpus_per_node
    k = max(1, min(n, G // stride)) if stride < G else 1        # members of the group per node
    if k >= n:
        return predict(name, "ring", n, int(nbytes), hw.intra) * stretch
    m = n // k
    inter = _scaled(hw.inter, G / k)                           # G/k such groups share the node's NICs
    return predict_2level(name.replace("_single", ""), "hierarchical", m, k, int(nbytes), Links(hw.intra, inter))


def zero3_units(model, hw) -> int:
    """Modules a layer's ZeRO-3 fetches gather one by one (each a blocking all-gather): Megatron's
    layer 6 (fused qkv, proj, fc1, fc2, 2 norms); a llama layer 9 (q, k, v, o, gate, up, down, 2
    norms); DistilBERT's 8 (q, k, v, out, lin1, lin2, 2 norms); torch's encoder layer on a CPU
    host 5 (self_attn with its out_proj, which it reads without calling: one unit; linear1,
    linear2, 2 norms)."""
    if model.gated:
        return 9
    if model.family == "distilbert":
        return 8
    return 5 if hw.activations == "torch-eager-fp32" else 6


def zero3_reused(psi: float, hw) -> float:
    """Fraction of a stage's units ZeRO-3 keeps gathered from their forward to their backward, so
    the backward does not gather them again: ringzero's engine (the host's, cpu-here) at
    DeepSpeed's defaults, stage3_max_reuse_distance = stage3_max_live_parameters = 1e9 elements
    (zero_from_scratch/engine/prefetch.py), keeps up to that many; the GPU plans assume an engine
    that frees each layer after use and gathers it again (0)."""
    return min(1.0, ZERO3_MAX_LIVE / psi) if hw.activations == "torch-eager-fp32" and psi else 0.0


def layer_rates(model, hw) -> tuple[float, float]:
    """(CPU seconds per layer, per saved byte) of a layer's non-matmul work on a CPU host: llama's
    own line where the hardware file has one, else torch's layer's (DistilBERT's too)."""
    if family(model) == "llama" and (hw.llama_op_overhead or hw.llama_elementwise_s):
        return hw.llama_op_overhead, hw.llama_elementwise_s
    return hw.op_overhead, hw.elementwise_s


def step_time(model, seq: int, lay, global_batch: int, hw, sw: Software = Software()) -> dict:
    """{term: seconds} for one optimizer step; 'total' their sum."""
    hw = per_step(replace(hw, step_cpu=hw.step_cpu * slice_factor(lay, hw)))     # × ranks time-slicing the cores
    bpe, t, p, v = hw.bytes_per_elem, lay.tp, lay.pp, lay.v
    m = lay.micro_batches(global_batch)
    tokens = lay.mb * seq
    rate = hw.peak_flops * hw.gemm_efficiency
    Ls = model.layers / p
    full = lay.recompute == "full"
    fwd_layer = 2 * model.layer_linear_params() + 4 * seq * model.hidden
    passes = 4 if full else 3
    if lay.recompute == "selective":
        passes_attn = 1            # the attention core's forward again, 4·s·h per token
    else:
        passes_attn = 0
    head_share = 1 / p if sw.balanced_stages else 1.0       # of the output layer's work, on the pacing stage
    flops = tokens * (Ls * (passes * fwd_layer + passes_attn * 4 * seq * model.hidden)
                      + 6 * model.hidden * model.vocab * head_share) / t
    stretch = cpu_stretch(lay, hw)
    if hw.activations == "torch-eager-fp32":
        act = torch_layer_activation_bytes(model, seq, lay, "none")
    else:
        act = layer_activation_bytes(model, seq, lay, bpe, "selective" if sw.flash_attention else "none")
    logit_s = hw.logit_s + (hw.vp_loss_s if t > 1 else 0.0)     # t > 1: the vocab-parallel loss's own passes
    if hw.elementwise_s:    # fitted per layer: a fixed cost of its ops, and one per saved byte
        op_s, byte_s = layer_rates(model, hw)
        elem = Ls * (op_s + act * byte_s) * (4 / 3 if full else 1) \
            + tokens * model.vocab * head_share / t * logit_s
    else:
        elem = Ls * act * (6 if full else 4) / hw.mem_bandwidth
    head_flops = tokens * 6 * model.hidden * model.vocab * head_share / t
    head_elem = tokens * model.vocab * head_share / t * logit_s if hw.elementwise_s else 0.0
    mapped = maps_blocks(lay, hw, sw)
    logit_block = tokens * model.vocab * head_share / t * 4
    if mapped:
        head_mapped = logit_block * hw.map_head * hw.mmap_s
    else:    # glibc maps a block that large at its defaults too: the logits, log-softmax and their gradients
        head_mapped = 4 * logit_block * hw.mmap_s * (tokens * model.vocab / t * 4 >= GLIBC_MMAP_MAX)
    alloc = (Ls * act * hw.map_layer * hw.mmap_s if mapped else 0.0) + head_mapped
    cpu_mb = flops / rate + elem + alloc             # CPU seconds of one micro-batch on the pacing stage
    other_mb = cpu_mb - (head_flops / rate + head_elem + head_mapped
                         if not sw.balanced_stages and p > 1 else 0.0)     # a stage without the output layer
    pace = pipeline_stretch(lay, hw) if p > 1 else tp_stretch(lay, hw)
    flops_s, elem, alloc = flops / rate * pace, elem * pace, alloc * pace
    compute_mb = flops_s + elem + alloc

    # tensor parallel, per micro-batch and stage
    calls, _ = layer_traffic(lay.mb, seq, model.hidden, t, 0, lay.sp)
    S = tokens * model.hidden * bpe
    tp_mb = 0.0
    for name, count in calls.items():
        one = group_time(name, t, S, 1, hw, pace)
        tp_mb += count * one * (1.5 if full else 1.0)
    tp_mb *= Ls
    blocking_mb = Ls * sum(calls.values()) * (1.5 if full else 1.0) if t > 1 else 0.0   # tp collectives a micro-batch waits on
    if t > 1:   # the vocab-parallel embedding's forward all-reduce (first stage), the head's input (f, backward)
        ends = 2 if p == 1 else 1     # on the pacing (last) stage, and the vocab-parallel loss's 3 of b·s floats
        tp_mb += ends * group_time("all_reduce", t, S, 1, hw, pace) + 3 * group_time("all_reduce", t, tokens * 4, 1, hw, pace)
        blocking_mb += ends + 3
    recvs_mb = 2 * v if p > 1 else 0          # the pacing stage's receives: an activation, a gradient per chunk
    tp_exposed_mb = max(0.0, tp_mb - compute_mb) if sw.overlap_tp else tp_mb

    # pipeline p2p: b·s·h/t bytes per send
    if p > 1:
        G = hw.gpus_per_node
        same_node = t * lay.dp * p <= G
        link = hw.intra if same_node else _scaled(hw.inter, G)
        hop = (link.alpha + S / t * link.beta) * (pace if same_node else 1.0)
    else:
        hop = 0.0
    # each micro-batch crosses 2·v chunk boundaries per stage; overlapped sends hide behind its compute
    per_mb_p2p = max(0.0, 2 * v * hop - compute_mb) if sw.overlap_pp else 2 * v * hop
    t_mb = compute_mb + tp_exposed_mb + per_mb_p2p
    busy = m * t_mb
    bubble_frac = bubble_formula(p, m, v) if p > 1 else 0.0
    t_other = t_mb - (cpu_mb - other_mb) * pace        # fill and drain: the stages without the output layer
    bubble = m * t_other * bubble_frac / (1 - bubble_frac)
    pp_fill = 2 * (p - 1) * hop + m * per_mb_p2p if sw.overlap_pp else m * per_mb_p2p

    # data parallel over the stage's parameters
    psi = max(stage_params(model, lay, "first"), stage_params(model, lay, "last"))
    gb = sw.grad_bytes or bpe
    stride = t
    dp_t = 0.0
    exposed_dp = 0.0
    dp_calls = 0.0                           # blocking dp collectives per step
    calls = hw.call_overhead * stretch       # the engine's CPU per collective call
    if lay.dp > 1:
        ag_p = group_time("all_gather", lay.dp, psi * bpe, stride, hw, stretch)
        rs_g = group_time("reduce_scatter", lay.dp, psi * gb, stride, hw, stretch)
        if lay.zero == 3:     # one gather (forward), one (backward), one reduce-scatter per module with parameters
            units = zero3_units(model, hw) * Ls + 3
            calls += hw.zero3_module_s * stretch
            gather = units * group_time("all_gather", lay.dp, psi * bpe / units, stride, hw, stretch)
            ag_p = gather + units * calls
            rs_g = units * (group_time("reduce_scatter", lay.dp, psi * gb / units, stride, hw, stretch) + calls)
        else:
            ag_p, rs_g = ag_p + calls, rs_g + calls
        if lay.zero == 0:
            dp_t = group_time("all_reduce", lay.dp, psi * gb, stride, hw, stretch) + calls
            dp_calls = 1
        elif lay.zero == 1:
            dp_t = rs_g + ag_p
            dp_calls = 2
        elif lay.zero == 2:
            dp_t = m * rs_g + ag_p
            dp_calls = m + 1
        else:     # the backward's gathers, less the units the engine kept since their forward
            z3_mb = 2 * ag_p + rs_g - zero3_reused(psi, hw) * gather
            dp_t = m * z3_mb
            dp_calls = m * units * (3 - zero3_reused(psi, hw))
        if not sw.overlap_dp:
            exposed_dp = dp_t
        elif lay.zero == 3:
            exposed_dp = m * max(0.0, z3_mb - compute_mb)
        else:
            backward_last = compute_mb * 2 / 3 * v       # a stage's whole backward of the last micro-batch
            exposed_dp = max(0.0, dp_t - (m - 1) * rs_g - backward_last) if lay.zero == 2 else max(0.0, dp_t - backward_last)
    shard = psi / (lay.dp if lay.zero >= 1 else 1)
    if lay.offload:
        opt = (shard / hw.host_adam + 2 * shard * bpe / hw.host_link) * stretch
    elif hw.activations == "torch-eager-fp32":   # the device is the host: Adam at the host's rate
        opt = shard / hw.host_adam * stretch
    else:
        opt = shard * 36 / hw.mem_bandwidth
    # mapped, beside the layers and the top a step maps afresh Adam's two temporaries of the shard (torch's
    # single-tensor AdamW and the ZeRO engine's: the denominator's square root and quotient) and ZeRO-0's flat copy
    alloc_step = (2 * shard * bpe + (psi * gb if lay.zero == 0 and lay.dp > 1 else 0.0)) * hw.mmap_s * stretch if mapped else 0.0
    out = {"matmul": m * flops_s, "elementwise": m * elem, "allocator": m * alloc + alloc_step, "tp comm": m * tp_exposed_mb,
           "pp comm": pp_fill, "bubble": bubble, "dp comm": exposed_dp, "optimizer": opt,
           "wait": m * (blocking_mb * wait_time(lay, hw, t) + recvs_mb * wait_time(lay, hw, 2)) + dp_calls * wait_time(lay, hw, lay.dp)}
    if hw.cores and p > 1:   # the session's cores bound its ranks' CPU seconds together: r/p pipelines of p stages
        r = min(lay.gpus, hw.gpus_per_node)
        work = r / p * m * (cpu_mb + (p - 1) * other_mb)
        out["cores"] = max(0.0, work / session_cores(lay, hw) - (m * compute_mb + bubble + out["wait"]))   # a rank's
        # waits are its siblings' turns on the cores: the step is the longer of its path with them and all ranks' work
    out["total"] = sum(out.values())
    out["dp comm (all)"] = dp_t          # before overlap, for the record
    out["tp comm (all)"] = m * tp_mb
    return out
