"""The planner on a CPU host (cpu-here): ranks beyond the cores stretch compute, blocking collectives
wait, pipelines are paced by the session's cores, the probed speed scales every CPU second, mapped
blocks keep no slack, the probe reads the load, a rank reads the speed. No rank runs here."""
import json
import statistics

import pytest

from planner import hardware as H
from planner.layout import Layout
from planner.model import PRESETS, Model, resolve
from planner.steptime import Software, step_time


def test_ranks_beyond_the_cores_stretch_compute():
    """cpu-here: with more runnable tasks than cores each rank's CPU seconds take longer in wall
    time, (ranks + load) / cores; a GPU (cores = 0) never stretches."""
    from dataclasses import replace
    from planner.cpu_host import cpu_stretch
    hw, m = H.load("cpu-here"), PRESETS["tiny"]
    assert hw.cores >= 1
    two = replace(hw, cores=2)
    assert cpu_stretch(Layout(2, 1, 1), two) == 1.0
    assert cpu_stretch(Layout(2, 1, 2), two) == 2.0
    assert cpu_stretch(Layout(2, 1, 1), replace(two, load=2.0)) == 2.0
    assert cpu_stretch(Layout(64, 1, 1), H.A100) == 1.0
    a = step_time(m, 32, Layout(2, 1, 1, mb=2), 4, two, Software(False, False, False))
    b = step_time(m, 32, Layout(2, 1, 1, mb=2), 4, replace(two, load=4.0), Software(False, False, False))
    assert b["matmul"] == pytest.approx(3 * a["matmul"]) and b["optimizer"] == pytest.approx(3 * a["optimizer"])


def test_blocking_collectives_wait_once_ranks_outnumber_cores():
    """cpu-here: a blocking collective waits for a descheduled member only once the node's ranks
    outnumber its cores, wait_s per unit of (ranks − cores)/cores, stretched by the load, for its
    k − 1 other members of the r − 1; the step's wait term counts each tp all-reduce, pipeline
    receive and dp call; none on a GPU."""
    from dataclasses import replace
    from planner.cpu_host import wait_time
    hw, m = replace(H.load("cpu-here"), cores=2, wait_s=3e-3, load=0.0), PRESETS["tiny"]
    assert wait_time(Layout(2, 1, 1), hw, 2) == 0.0 and wait_time(Layout(1, 2, 1), replace(hw, load=6.0), 2) == 0.0
    assert wait_time(Layout(4, 1, 1), hw, 4) == pytest.approx(3e-3)
    assert wait_time(Layout(2, 2, 2), hw, 8) == pytest.approx(9e-3)
    assert wait_time(Layout(2, 2, 2), hw, 2) == pytest.approx(9e-3 / 7)          # a pair of the 8 waits for one other
    assert wait_time(Layout(4, 1, 1), replace(hw, load=2.0), 4) == pytest.approx(6e-3)
    assert wait_time(Layout(8, 8, 1), replace(H.A100, wait_s=1.0), 8) == 0.0
    sw = Software(False, False, False)
    dp, tp = (step_time(m, 32, lay, 8, hw, sw)["wait"] for lay in (Layout(4, 1, 1, mb=2), Layout(2, 2, 1, mb=2)))
    assert dp == pytest.approx(3e-3)                          # one all-reduce of the gradients
    # 2 micro-batches: 4 per layer, the ends, the loss's 3; the dp all-reduce; pairs of the 4 ranks
    assert tp == pytest.approx((2 * (4 * m.layers + 2 + 3) + 1) * 1e-3)


def test_ranks_that_time_slice_the_cores_cost_more_cpu_per_step():
    """slice_cpu = κ: once the node's r ranks outnumber its C cores the CPU seconds of a rank's
    step's ops (matmuls, elementwise, Adam) grow by 1 + κ·(1 − C/r); none with a core per rank
    (whatever the load), on a GPU, or with κ = 0."""
    from dataclasses import replace
    from planner.cpu_host import slice_factor
    hw, m = replace(H.load("cpu-here"), cores=2, slice_cpu=0.2, load=0.0), PRESETS["tiny"]
    assert slice_factor(Layout(2, 1, 1), hw) == 1.0 and slice_factor(Layout(2, 1, 1), replace(hw, load=6.0)) == 1.0
    assert slice_factor(Layout(2, 2, 1), hw) == pytest.approx(1.1) and slice_factor(Layout(2, 2, 2), hw) == pytest.approx(1.15)
    assert slice_factor(Layout(8, 8, 1), replace(H.A100, slice_cpu=0.2)) == 1.0
    assert slice_factor(Layout(2, 2, 2), replace(hw, slice_cpu=0.0)) == 1.0
    sw, lay = Software(False, False, False), Layout(2, 2, 2, mb=2)
    a, b = (step_time(m, 32, lay, 8, replace(hw, slice_cpu=k), sw) for k in (0.0, 0.2))
    for k in ("matmul", "elementwise", "optimizer"):
        assert b[k] == pytest.approx(1.15 * a[k]), k


def test_planner_fit_line():
    from benchmarks.planner_fit import fit_line
    assert fit_line([1.0, 2.0, 3.0], [3.0, 5.0, 7.0]) == pytest.approx((1.0, 2.0))
    assert fit_line([1.0, 2.0], [2.0, 1.0])[1] == 0.0          # a negative slope is clamped: work never shrinks


def test_llama_layers_pay_their_own_line():
    """A llama model's layers (gated: Hugging Face's decoder layer) pay llama_op_overhead +
    llama_elementwise_s per saved byte where the file has them, torch's line where it has none;
    torch's and DistilBERT's layers never read llama's."""
    from dataclasses import replace

    from benchmarks.planner_ranks import llama_planner_model
    from planner.memory import torch_layer_activation_bytes
    hw = replace(H.load("cpu-here"), cores=0, step_cpu=1.0)
    sw, lay = Software(False, False, False), Layout(1, 1, 1, mb=2)
    llama = llama_planner_model("small", 64)
    none = replace(hw, llama_op_overhead=0.0, llama_elementwise_s=0.0)
    own = replace(hw, llama_op_overhead=2e-3, llama_elementwise_s=0.5e-9)
    act = torch_layer_activation_bytes(llama, 64, lay, "none")
    diff = step_time(llama, 64, lay, 2, own, sw)["elementwise"] - step_time(llama, 64, lay, 2, none, sw)["elementwise"]
    assert diff == pytest.approx(llama.layers * (2e-3 - hw.op_overhead + act * (0.5e-9 - hw.elementwise_s)))
    flat = replace(hw, llama_op_overhead=2e-3, llama_elementwise_s=0.0)     # a slope fitted to 0 is still llama's line
    diff = step_time(llama, 64, lay, 2, flat, sw)["elementwise"] - step_time(llama, 64, lay, 2, none, sw)["elementwise"]
    assert diff == pytest.approx(llama.layers * (2e-3 - hw.op_overhead - act * hw.elementwise_s))
    from benchmarks.planner_ranks_tp import distilbert_planner_model
    for other in (PRESETS["tiny"], distilbert_planner_model("distil-mini", 4, 256, 4, 8192, 64)):
        assert step_time(other, 32, lay, 2, own, sw) == step_time(other, 32, lay, 2, none, sw), other.name


def test_the_fits_layer_matmuls_are_the_planners():
    """benchmarks.planner_fit_llama.matmul_s, which the fit subtracts from a measured layer (torch's
    and llama's), is the planner's matmul term of that layer: the step's matmuls less the head's."""
    from dataclasses import replace

    from benchmarks.planner_fit_llama import LLAMA, llama_model, matmul_s
    hw = replace(H.load("cpu-here"), cores=0, step_cpu=1.0)
    rate = hw.peak_flops * hw.gemm_efficiency
    for h, a, kv, f, s, b in LLAMA[:2]:
        for m in (llama_model(h, a, kv, f, s), Model("t", 1, h, a, 2, s, ffn=f)):
            head = 6 * s * b * m.hidden * m.vocab / rate
            got = step_time(m, s, Layout(1, 1, 1, mb=b), b, hw, Software(False, False, False))["matmul"]
            assert got - head == pytest.approx(matmul_s(m, s, b, rate)), m.name


def test_llama_fit_points_at_the_fits_speed():
    """benchmarks.planner_fit_llama: a llama shape's CPU at the fit's speed is its ratio to the torch
    calibration layers times torch's line over them; less its matmuls, that is its point. A ratio
    built from a known line gives that line back."""
    from benchmarks.planner_fit import LAYERS, fit_line
    from benchmarks.planner_fit_llama import LLAMA, gemm_rate, llama_model, llama_points, matmul_s, torch_line, torch_shares
    from planner.memory import llama_layer_activation_bytes
    with open(H.CPU_HERE) as f:
        doc = json.load(f)
    rate = gemm_rate(doc)
    base = sum(torch_line(*shape, doc) for shape in LAYERS)
    true = []
    for h, a, kv, f, s, b in LLAMA:
        m = llama_model(h, a, kv, f, s)
        true.append(matmul_s(m, s, b, rate) + 1.5e-3 + 0.8e-9 * llama_layer_activation_bytes(m, s, Layout(1, 1, 1, mb=b)))
    line = [torch_line(*shape, doc) / base for shape in LAYERS]
    got = [{"llama": [t / base for t in true], "torch": line}] * 2          # two ranks, the same ratios
    points = llama_points(got, doc, LAYERS)
    assert fit_line([x for x, _, _ in points], [y for _, y, _ in points]) == pytest.approx((1.5e-3, 0.8e-9))
    assert [t for t, _ in torch_shares(got, doc, LAYERS)] == pytest.approx([ln for _, ln in torch_shares(got, doc, LAYERS)])


def test_partial_refits_keep_each_others_notes():
    """A partial refit's note in calibrated_on replaces its own earlier one and keeps the others'."""
    from benchmarks.planner_fit import with_note
    c = "python -m benchmarks.planner_fit (load 3.5; layers h [64]); vp_loss_s by A; links at load 1"
    assert with_note(c, "vp_loss_s by", "B") == "python -m benchmarks.planner_fit (load 3.5; layers h [64]); links at load 1; vp_loss_s by B"
    assert with_note(c, "llama's line by", "C").endswith("; vp_loss_s by A; links at load 1; llama's line by C")


def test_zero3_pays_per_module_calls():
    """ZeRO-3 gathers and reduce-scatters per module: its dp term carries 2 × modules × α per
    micro-batch (at DeepSpeed's defaults the engine keeps a small model's units gathered from
    forward to backward: no backward gather), more than ZeRO-2's one reduce-scatter and
    all-gather of the whole shard; a GPU plan gathers again in the backward. A link whose α
    (3 ms: a scheduler's slice) outweighs the tiny shard's bytes."""
    from dataclasses import replace

    from primitives.engine.cost import Params
    hw, m = replace(H.load("cpu-here"), intra=Params(alpha=3e-3, beta=3e-9, gamma=0.0)), PRESETS["tiny"]
    sw = Software(False, False, False)
    z2 = step_time(m, 32, Layout(2, 1, 1, zero=2, mb=2), 4, hw, sw)["dp comm"]
    z3 = step_time(m, 32, Layout(2, 1, 1, zero=3, mb=2), 4, hw, sw)["dp comm"]
    from planner.steptime import zero3_reused, zero3_units
    assert zero3_units(m, hw) == 5 and zero3_units(m, H.A100) == 6 and zero3_units(PRESETS["llama-7b"], H.A100) == 9
    assert z3 > 2 * hw.intra.alpha * (5 * m.layers + 3) > z2
    assert zero3_reused(1e6, hw) == 1.0 and zero3_reused(4e9, hw) == 0.25 and zero3_reused(1e6, H.A100) == 0.0


def test_a_pipeline_is_paced_by_its_ranks_on_the_sessions_cores():
    """cpu-here under load: the ranks' session gets P = cores·r / (r + load) cores; a pipeline's
    waiting ranks sleep, so its pacing ranks (one per pipeline) share P, each at most one core,
    and all ranks' CPU seconds over P bound the step (the cores term); the bubble is the stages
    without the output layer. Nothing fitted enters."""
    from dataclasses import replace
    from planner.cpu_host import cpu_stretch, pipeline_stretch, session_cores
    hw, m = replace(H.load("cpu-here"), cores=2), PRESETS["tiny"]
    busy = replace(hw, load=6.0)                 # the ranks' session gets 2·2/8 = 0.5 cores
    assert session_cores(Layout(1, 1, 2), busy) == pytest.approx(0.5)
    assert cpu_stretch(Layout(2, 1, 1), busy) == 4.0
    assert pipeline_stretch(Layout(1, 1, 2), busy) == pytest.approx(2.0)               # one pacing rank on 0.5 cores
    assert pipeline_stretch(Layout(2, 1, 2), replace(hw, load=12.0)) == pytest.approx(4.0)   # two pipelines on 0.5
    assert pipeline_stretch(Layout(2, 1, 2), hw) == 1.0           # idle: two pacing ranks, two cores
    assert pipeline_stretch(Layout(1, 1, 2), hw) == 1.0           # never faster than a core
    sw = Software(False, False, False, flash_attention=False, balanced_stages=False)
    t = step_time(m, 32, Layout(1, 1, 2, mb=1), 8, busy, sw)
    even = step_time(m, 32, Layout(1, 1, 2, mb=1), 8, busy, replace(sw, balanced_stages=True))
    assert t["bubble"] < t["matmul"] + t["elementwise"]           # the first stage has no output layer
    assert even["bubble"] == pytest.approx((even["matmul"] + even["elementwise"] + even["pp comm"]) / 8)   # (p−1)/m of the busy time
    four = step_time(m, 32, Layout(2, 1, 2, mb=1), 16, replace(hw, cores=1, wait_s=0.0), sw)
    assert four["cores"] > 0                                      # 4 ranks' CPU seconds on one core
    waits = step_time(m, 32, Layout(2, 1, 2, mb=1), 16, replace(hw, cores=1, wait_s=1e-3), sw)
    assert waits["wait"] > 0             # a pacing rank's waits are its siblings' turns: the longer of the two
    assert waits["total"] == pytest.approx(max(four["total"], four["total"] - four["cores"] + waits["wait"]))


def test_the_vocab_parallel_loss_costs_its_own_rate_per_local_logit():
    """With tp the loss is tensor_parallel's vocab-parallel cross-entropy: vp_loss_s more per local
    logit element (b·s·V/t per micro-batch) on the stage holding the output layer; tp = 1 runs
    torch's fused loss and pays logit_s alone."""
    from dataclasses import replace
    hw, m = replace(H.load("cpu-here"), cores=2, vp_loss_s=0.0, step_cpu=1.0, slice_cpu=0.0), PRESETS["tiny"]
    sw = Software(False, False, False, balanced_stages=False)
    for lay, m_count in ((Layout(1, 2, 1, mb=2), 2), (Layout(1, 2, 2, mb=2), 4)):
        a = step_time(m, 32, lay, 8 if lay.pp > 1 else 4, hw, sw)
        b = step_time(m, 32, lay, 8 if lay.pp > 1 else 4, replace(hw, vp_loss_s=1e-9), sw)
        assert b["elementwise"] - a["elementwise"] == pytest.approx(m_count * 2 * 32 * m.vocab / 2 * 1e-9)
    one = Layout(2, 1, 1, mb=2)
    assert step_time(m, 32, one, 4, replace(hw, vp_loss_s=1e-9), sw) == step_time(m, 32, one, 4, hw, sw)


def test_probed_speed_scales_every_cpu_second():
    """cpu-now: a CPU second that buys half the fitted FLOPs doubles every CPU-second term."""
    from dataclasses import replace
    hw, m = replace(H.load("cpu-here"), cores=2), PRESETS["tiny"]
    sw = Software(False, False, False)
    lay = Layout(2, 1, 1, zero=3, mb=2)
    a, b = step_time(m, 32, lay, 4, hw, sw), step_time(m, 32, lay, 4, H.at_speed(hw, 0.5), sw)
    for k in ("matmul", "elementwise", "allocator", "optimizer"):
        assert b[k] == pytest.approx(2 * a[k]), k
    assert H.at_speed(hw, 1.0) is hw
    slow = H.at_speed(hw, 0.5)      # llama's line too
    assert (slow.llama_op_overhead, slow.llama_elementwise_s) == pytest.approx((2 * hw.llama_op_overhead, 2 * hw.llama_elementwise_s))


def test_mapped_blocks_keep_no_slack_and_cost_faults():
    """With large blocks mapped (ZeRO-3 on this host, or Software.mapped_alloc) the allocator keeps
    nothing beyond live tensors, and each step's fresh mappings cost mmap_s per byte."""
    from dataclasses import replace
    from planner.memory import memory
    hw = replace(H.load("cpu-here"), alloc_slack=40 * 2**20, zero1_slack=0.0, zero2_slack=0.0, mmap_s=1e-9)
    m, sw = PRESETS["distilbert"], Software(False, False, False)
    z0, z1, z2, z3 = (memory(m, 32, Layout(2, 1, 1, zero=z, mb=2), 4, hw, sw)["allocator"] for z in (0, 1, 2, 3))
    assert z0 == z1 == z2 > 0.0 == z3
    assert memory(m, 32, Layout(2, 1, 1, mb=2), 4, hw, replace(sw, mapped_alloc=True))["allocator"] == 0.0
    assert step_time(m, 32, Layout(2, 1, 1, zero=1, mb=2), 4, hw, sw)["allocator"] == 0.0
    assert step_time(m, 32, Layout(2, 1, 1, zero=3, mb=2), 4, hw, sw)["allocator"] > 0.0


def test_fresh_pages_cost_per_byte_and_logit_blocks_past_glibcs_maximum_are_mapped_anyway():
    """The allocator term: a mapped step touches map_layer bytes afresh per saved layer byte and
    map_head per logit byte, each at mmap_s (ZeRO-3 on this host), and once a step Adam's two
    temporaries of the rank's shard and ZeRO-0's flat gradient copy (the tuned DDP row); at glibc's
    defaults only a logit block of 32 MiB or more is mapped (its dynamic threshold stops there): the
    top's four such blocks (logits, log-softmax, their gradients) pay, nothing else."""
    from dataclasses import replace
    from planner.memory import torch_layer_activation_bytes
    from planner.model import Model
    hw = replace(H.load("cpu-here"), map_layer=5.0, map_head=4.0, mmap_s=1e-9, step_cpu=1.0)
    sw = Software(False, False, False)
    small, big = (Model("g", 2, 64, 4, V, 128, positions=128) for V in (4096, 16384))     # 4·512·V: 8 and 32 MiB
    for m in (small, big):
        lay = Layout(2, 1, 1, zero=3, mb=4)
        act = torch_layer_activation_bytes(m, 128, lay)
        layers_top = (2 * act * 5.0 + 4 * 512 * m.vocab * 4.0) * 1e-9
        assert step_time(m, 128, lay, 8, hw, sw)["allocator"] == pytest.approx(layers_top + 2 * 4 * m.params() / 2 * 1e-9)
        ddp = step_time(m, 128, Layout(2, 1, 1, mb=4), 8, hw, replace(sw, mapped_alloc=True))["allocator"]
        assert ddp == pytest.approx(layers_top + 3 * 4 * m.params() * 1e-9)     # Adam's two of Ψ, the flat copy
        z1 = step_time(m, 128, Layout(2, 1, 1, zero=1, mb=4), 8, hw, replace(sw, mapped_alloc=True))["allocator"]
        assert z1 == pytest.approx(layers_top + 2 * 4 * m.params() / 2 * 1e-9)     # ZeRO-1 makes no flat copy
    assert step_time(small, 128, Layout(2, 1, 1, mb=4), 8, hw, sw)["allocator"] == 0.0
    assert step_time(big, 128, Layout(2, 1, 1, mb=4), 8, hw, sw)["allocator"] == pytest.approx(4 * (512 * 16384 * 4) * 1e-9)


def test_a_steps_cpu_scales_the_micro_benchmarks_rates_only():
    """step_cpu = k: every term of a step's ops (matmul, elementwise, optimizer) costs k times its
    micro-benchmark rate; a page fault (mmap_s) and ZeRO-3's per-call cost are fitted on whole
    steps: neither scales; per_step applies it once."""
    from dataclasses import replace
    hw, m = replace(H.load("cpu-here"), cores=2, step_cpu=1.0), PRESETS["tiny"]
    sw = Software(False, False, False)
    lay = Layout(2, 1, 1, zero=3, mb=2)
    a, b = step_time(m, 32, lay, 4, hw, sw), step_time(m, 32, lay, 4, replace(hw, step_cpu=1.5), sw)
    for k in ("matmul", "elementwise", "optimizer"):
        assert b[k] == pytest.approx(1.5 * a[k]), k
    assert b["allocator"] == pytest.approx(a["allocator"]) and a["allocator"] > 0
    scaled = H.per_step(replace(hw, step_cpu=1.5))
    assert scaled.step_cpu == 1.0 and H.per_step(scaled) is scaled
    assert (scaled.zero3_module_s, scaled.mmap_s) == (hw.zero3_module_s, hw.mmap_s)
    assert scaled.peak_flops == pytest.approx(hw.peak_flops / 1.5) and scaled.logit_s == pytest.approx(1.5 * hw.logit_s)
    assert (scaled.llama_op_overhead, scaled.llama_elementwise_s) == pytest.approx((1.5 * hw.llama_op_overhead,
                                                                                   1.5 * hw.llama_elementwise_s))


def test_map_fit_counts_a_layers_fresh_pages():
    """benchmarks.planner_fit_map in one process with glibc's threshold at 64 KiB: a layer's forward
    and backward touch afresh several times the bytes it saves (its products and their gradients),
    a head several times its logits; a layer whose blocks are all under 64 KiB is not counted; the
    calibration step's fresh bytes include what a step maps beside its layers and top."""
    from benchmarks.planner_fit_map import huge_pages_always, map_sweep
    from planner.host_memory import SLACK_CAL
    from primitives.launch import spawn
    if huge_pages_always():
        pytest.skip("transparent huge pages are 'always': a fault does not count one 4 KiB page")
    got, = spawn(map_sweep, 1, args=(((64, 4, 256, 16, 2), (128, 4, 512, 64, 4)), 1, True), timeout=120)
    assert 3.0 < got["map_layer"] < 10.0 and 3.0 < got["map_head"] < 8.0, got
    # beside its layers and top the calibration step maps afresh its flat gradient copy and Adam's two
    # temporaries, 12 bytes a parameter (planner.steptime's mapped step; its few small tensors stay in the heap)
    psi = SLACK_CAL.params()
    assert got["tail_fresh"] == pytest.approx(12 * psi, rel=0.03), (got, 12 * psi)
    assert got["step_s"] > 0.0 and got["step_fresh"] > got["tail_fresh"]


def test_shm_segments_a_rank_touches():
    """The shared-memory transport's pages a rank maps (RssShmem on the rows of planner_local:
    DDP 12.0 MiB, ZeRO-1/2 8.0, DistilBERT tp2 3.1, pp2·dp2 20.1, the llama pipelines 1.1 and 4.1): a group's
    collectives use each member's BUFS workspaces up to the message, a pipeline one channel each
    way up to its largest send; ranks on other hosts share no segment."""
    from dataclasses import replace
    from planner.memory import shm_bytes
    from primitives.engine.shm_segment import BUFS, SLOT_BYTES, SLOTS, WS_BYTES
    hw, MiB = H.load("cpu-here"), 2**20
    gpt = PRESETS["tiny"]
    llama = resolve(None, layers=4, hidden=64, heads=4, ffn=176, kv_heads=2, vocab=256, seq=128, gated=True, bias=False, tied=False)
    assert (BUFS, WS_BYTES, SLOTS, SLOT_BYTES) == (3, 2 * MiB, 8, MiB // 2)    # the sizes the measurements were made at
    assert shm_bytes(gpt, 128, Layout(2, 1, 1, mb=4), hw) == 12 * MiB
    assert shm_bytes(gpt, 128, Layout(2, 1, 1, zero=1, mb=4), hw) == 8 * MiB    # ZeRO's rings: one channel each way
    assert shm_bytes(gpt, 128, Layout(2, 1, 1, zero=1, mb=4), hw, piece=64 << 10) == 1 * MiB      # up to the ring's send
    assert shm_bytes(llama, 128, Layout(1, 1, 2, mb=2), hw) == 1 * MiB          # 64 KiB sends, 8 slots each way
    assert shm_bytes(gpt, 128, Layout(2, 1, 1, mb=4), replace(hw, gpus_per_node=1)) == 0.0


def test_woken_ranks_get_the_sleepers_share():
    """Ranks that wait inside the step (a pipeline's, tensor parallel's) run at the share a task
    that sleeps and wakes gets (hw.wake_share, planner.probe.Sleeper), never below a busy task's,
    never above a core, and together never above the cores."""
    from dataclasses import replace
    from planner.cpu_host import cpu_stretch, pipeline_stretch, tp_stretch
    hw = replace(H.load("cpu-here"), cores=2, load=6.0)          # busy tasks get 0.25 of a core
    assert tp_stretch(Layout(2, 2, 1), hw) == cpu_stretch(Layout(2, 2, 1), hw)     # no Sleeper reading
    woken = replace(hw, wake_share=0.4)
    assert tp_stretch(Layout(2, 2, 1), woken) == pytest.approx(2.5)   # 4 ranks on 2 cores: the transport sleeps
    assert tp_stretch(Layout(1, 2, 1), woken) == 4.0               # a core per rank: it polls, busy
    assert tp_stretch(Layout(4, 1, 1), woken) == cpu_stretch(Layout(4, 1, 1), woken)   # data parallel ranks do not wait
    assert pipeline_stretch(Layout(1, 1, 2), woken) == 2.0         # the session's 0.5 cores beat 0.4
    assert pipeline_stretch(Layout(1, 1, 2), replace(woken, wake_share=0.8)) == pytest.approx(1.25)
    assert tp_stretch(Layout(2, 2, 1), replace(woken, load=0.0, wake_share=1.0)) == 2.0   # 4 ranks, 2 cores


def test_probe_counts_other_tasks_not_its_own():
    """planner.probe read alone (the ranks run while it is paused): as many busy processes as
    cores, so what neither they nor the Sleeper got went to other tasks, counted as busy tasks;
    an idle machine reads load 0 whatever the probe's own processes are; a window that spans a
    pause is dropped."""
    from planner.probe import Probe

    p = Probe.__new__(Probe)          # the readings only: no processes started
    cores = __import__("os").cpu_count()
    p.procs = cores

    def read(q, windows=((0.0, 10.0),)):
        p.samples = [(1.0, 1.1, pid, q, 1e9) for pid in range(cores)] + [(9.5, 10.5, 0, 0.01, 1e9)]
        p.within(windows)

    read(1.0)
    assert p.load() == 0.0                       # each busy process a core: nothing else runnable
    read(0.25)
    assert p.load() == pytest.approx(cores * 0.75 / 0.25)    # 3 other tasks per core
    read(0.75)
    assert p.load(beside=cores * 0.25) == pytest.approx(0.0)  # the Sleeper took the rest, not another task
    assert len(p.samples) == cores               # the sample over the window's end was dropped


def test_ranks_read_the_speed_between_their_steps_and_the_row_is_predicted_at_it():
    """planner.probe.Rate inside a rank: the probe's products into outputs made once (a reading
    changes no output's storage and computes the products); benchmarks.planner_ranks._timed reads
    it before each step and after the last; planner_rows.in_row_speed is the harmonic mean of the
    readings bracketing the timed steps (not the first), every rank's, over the fit's rate (or
    a mean given); median_step's the median step of the slower rank's times."""
    import torch

    from benchmarks import planner_ranks as R
    from benchmarks.planner_local import median_step
    from benchmarks.planner_rows import in_row_speed
    from planner.probe import PRODUCTS, Rate

    rate = Rate(cpu_s=0.005)
    ptrs = [out.data_ptr() for _, _, out, _ in rate.mats]
    assert rate.read() > 0 and [out.data_ptr() for _, _, out, _ in rate.mats] == ptrs
    a, b, out, _ = rate.mats[0]
    torch.testing.assert_close(out, a @ b)
    assert rate.per_round == sum(8 * t * h * h * k for t, h, k in PRODUCTS)
    calls = []

    class Reader:
        def read(self):
            calls.append("read")
            return float(len(calls))

    R._RATE[:] = [Reader()]
    got = R._timed(lambda: calls.append("step"), 3, 0)         # every reading outside a step
    assert calls == ["read", "step"] * 3 + ["read"] and got["rates"] == [1.0, 3.0, 5.0, 7.0]
    R._RATE.clear()
    ranks = [{"rates": [9.0, 1.0, 2.0]}, {"rates": [9.0, 2.0, 2.0]}]
    assert in_row_speed(ranks, 2.0) == pytest.approx(1.6 / 2.0)                       # harmonic mean of 1, 2, 2, 2
    assert in_row_speed(ranks, 2.0, statistics.median) == pytest.approx(2.0 / 2.0)
    assert in_row_speed([{"step": 1.0}], 2.0) is None                 # a run that read none
    # steps 2-4 (the first is not counted); the slower rank's: 1.0, 3.0, 2.0 -> step 4 (index 3), 2.0 s
    ranks = [{"times": [9.0, 1.0, 3.0, 2.0]}, {"times": [9.0, 0.5, 2.0, 1.9]}]
    assert median_step(ranks) == (3, 2.0)
    assert median_step([{"step": 1.0, "rates": [1.0]}]) is None       # a rank that kept no times


def test_least_worst_is_the_best_any_one_figure_can_do_against_every_run():
    """planner_rows.least_worst: against runs measuring 200 and 250 MiB the figure 222.2 is 11.1 % from
    both, and any other figure is farther from one of them; one run (or equal ones) allows 0."""
    from benchmarks.planner_rows import least_worst
    got = least_worst([200.0, 240.0, 250.0])
    p = 2 * 200.0 * 250.0 / 450.0
    assert got == pytest.approx(1 / 9) and abs(p / 200 - 1) == pytest.approx(got) == pytest.approx(1 - p / 250)
    assert all(max(abs(q / 200 - 1), abs(q / 250 - 1)) > got for q in (p - 1, p + 1))
    assert least_worst([210.0]) == least_worst([5.0, 5.0]) == 0.0


def test_the_3d_rows_head_keeps_the_loss_exp_above_underflow():
    """benchmarks.planner_local's 3D rows build their last stage's head table as Hugging Face
    initialises DistilBERT's (std 0.02): the loss's exp(z − max z) then never sees an input below
    ln(FLT_MIN), where float32 exp takes its slow path (benchmarks.planner_logits); torch's
    default N(0, 1) table would put some there."""
    from benchmarks.planner_logits import UNDERFLOW, loss_inputs
    assert loss_inputs(None).min() > UNDERFLOW / 10
    assert (loss_inputs(1.0) < UNDERFLOW).any()


REFUSALS = """
    planner_local --steps 1  =>  --steps 1: expected at least 2
    planner_local --quick --steps 0  =>  --steps 0: expected at least 2
    planner_local --only nosuchrow  =>  --only 'nosuchrow': no row's layout contains it
    planner_local --repredict /nonexistent/rows.json  =>  --repredict /nonexistent/rows.json: no such file
    planner_local --quick --json /nonexistent-folder/rows.json  =>  expected a file in a writable folder
    planner_local --quick --json /tmp  =>  --json /tmp: expected a file in a writable folder
    planner_slack --only nosuchrow  =>  --only 'nosuchrow': no row's name contains it; the rows: gpt-cal dp2
    planner_slack --steps 1  =>  --steps 1: expected at least 2
    planner_slack --mb 0  =>  --mb 0: expected a positive micro-batch
    planner_slack --arenas -1  =>  --arenas -1: expected 0
    planner_slack --variant foo  =>  --variant: a threshold in bytes, trim-bwd or reuse, got ['foo']
    planner_mem --only '2 nodes'  =>  no row contains it; the rows (the 2-node row is not split)
    planner_slack_replay --only nosuchrow  =>  --only 'nosuchrow': no row of benchmarks.planner_slack
    planner_mem --steps 0  =>  --steps 0: expected at least 2
    planner_phases --dp 0  =>  --dp 0: expected at least 1
    planner_fit --ranks 0  =>  --ranks 0: expected at least 1
    planner_fit --out /nonexistent-folder/cpu.json  =>  expected a file in a writable folder
    planner_fit --llama --out /tmp/ringzero-no-such-fit.json  =>  does not exist: a partial refit updates a whole fit's file
    planner_fit --links --llama  =>  --links runs on its own: expected it without another
    planner_fit --links --links-median  =>  --links runs on its own
    planner_mem_probe --vocab 0  =>  --vocab 0: expected a positive vocabulary size
    planner_slack_seeds --seeds 0  =>  --seeds 0 --steps 4: expected positive counts
    planner_pipe_cpu --rounds 2  =>  --rounds 2: expected at least 3
"""     # module and arguments  =>  what its error says


@pytest.mark.parametrize("case", REFUSALS.strip().splitlines())
def test_planner_benchmarks_refuse_bad_arguments_before_running(case, capsys):
    """The planner's measuring commands stop at once, naming the argument and what was expected,
    where they would otherwise run for minutes and then fail (an unwritable --json), print an empty
    table or find no row (--only), quietly change --steps, or take 0 for the default
    (planner_mem_probe --vocab 0 ran the whole sweep and rewrote cpu_mem.json)."""
    import importlib
    import shlex
    command, said = (x.strip() for x in case.split("=>"))
    module, *args = shlex.split(command)
    main = importlib.import_module(f"benchmarks.{module}").main
    with pytest.raises(SystemExit) as e:
        main(args)
    assert e.value.code == 2 and said in " ".join(capsys.readouterr().err.split())
