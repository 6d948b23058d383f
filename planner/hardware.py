"""What one accelerator and its links can do: peak FLOP/s, memory, and α-β per link class.

    python -m planner llama-70b --gpus 512 --hardware h100
    python -m planner tiny --gpus 2 --hardware cpu-here          # fitted by benchmarks/planner_fit.py
    python -m planner tiny --gpus 2 --hardware cpu-now           # the same, probed for the load and speed now (~3 s)
    python -m planner tiny --gpus 2 --hardware my_cluster.json   # a file with the fields of Hardware

Links are primitives.engine.cost.Params (α seconds per message, β seconds per byte as bus
bandwidth, so a ring all-reduce of S bytes over n ranks costs 2(n-1)α + 2(n-1)/n·S·β). A node's
NICs are modelled as one link of their summed rate (cost.predict_2level's hierarchical
all-reduce sends each node's share through "one NIC"): a DGX has one NIC per GPU.
Sources of the figures: NVIDIA A100 and H100 Tensor Core GPU datasheets (dense bf16 peak, HBM
size and bandwidth, NVLink bandwidth), the DGX A100 / DGX H100 user guides (8 GPUs, 8 × HDR
200 Gb/s / 8 × NDR 400 Gb/s compute NICs), nccl-tests' bus bandwidth convention (busbw,
README_PERFORMANCE.md). The intra-node β uses the all-reduce busbw NCCL reaches on those boxes
(~230 GB/s A100, ~360 GB/s H100, below the 300 / 450 GB/s per-direction NVLink rate); α is the
order of NCCL's small-message latency per step (µs), an approximation that only matters for
small messages. `gemm_efficiency` is the one calibrated number, see its field.
"""
from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass, replace

from planner.hosts import check_cpu, fitted_path, rank_memory
from planner.probe import probe_now
from primitives.engine.cost import Params, params as fitted_params

CPU_HERE = fitted_path("cpu_here.json")     # this processor's fit, else the shipped one (planner.hosts)


@dataclass(frozen=True)
class Hardware:
    name: str
    peak_flops: float            # dense FLOP/s in the training dtype (bf16 on GPUs, fp32 on CPU)
    memory: float                # bytes of device memory per accelerator
    mem_bandwidth: float         # bytes/s of device memory (elementwise ops are bound by it)
    gpus_per_node: int
    intra: Params                # link between accelerators of one node
    inter: Params                # a node's NICs, summed
    host_link: float             # bytes/s device <-> host (offload), per accelerator
    host_adam: float             # parameters/s the host's Adam updates per accelerator (offload): an
                                 # estimate, ~1e9/s per host (ZeRO-Offload's CPU-Adam, arXiv 2101.06840)
                                 # shared by 8 accelerators
    gemm_efficiency: float       # fraction of peak the layers' matmuls reach. Calibrated: the one
                                 # free number, set from ONE published row per GPU (named in
                                 # `calibrated_on`); every other row is a prediction
    reserved: float              # bytes a framework holds before the model (context, NCCL, allocator slack)
    bytes_per_elem: int = 2      # parameters/gradients/activations (bf16); 4 for fp32 on CPU
    activations: str = "megatron-16bit"   # which layer's saved tensors (planner.memory): Megatron's
                                          # fused layer, or "torch-eager-fp32" (torch's encoder layer)
    # CPU hosts (cpu-here), where a rank is a process on shared cores; all 0 for GPUs
    cores: int = 0               # cores a node's ranks share: compute's CPU seconds stretch by
                                 # (ranks + load) / cores when more tasks than cores are runnable
    load: float = 0.0            # other runnable tasks on the node (the load the ranks compete with)
    wake_share: float = 0.0      # share of a core a task that sleeps and wakes gets while awake (planner.probe.Sleeper,
                                 # read before a run or by cpu-now); 0: what a busy task gets
    op_overhead: float = 0.0     # CPU seconds per layer and micro-batch of non-matmul work that does
    elementwise_s: float = 0.0   # not scale, and per saved activation byte that does (fitted on torch's layer)
    llama_op_overhead: float = 0.0    # the same two for Hugging Face's llama decoder layer, fitted on it (CPU
    llama_elementwise_s: float = 0.0  # hosts, where elementwise_s is fitted; both 0: torch's layer's line)
    logit_s: float = 0.0         # CPU seconds per logit element: log-softmax + cross-entropy, fwd + bwd
    vp_loss_s: float = 0.0       # beyond logit_s, per local logit element of tensor_parallel's vocab-parallel
                                 # cross-entropy (t > 1): its z − max, exp, softmax and backward are separate passes
    call_overhead: float = 0.0   # CPU seconds of one collective call through the engine
    zero3_module_s: float = 0.0  # CPU seconds of the ZeRO-3 engine's work per module fetch or release
    wait_s: float = 0.0          # wall seconds a blocking collective waits for a descheduled peer per unit of
                                 # oversubscription, (ranks − cores)/cores · (cores + load)/cores (planner.cpu_host.wait_time;
                                 # fitted by benchmarks.planner_fit --waits)
    alloc_slack: float = 0.0     # bytes the host allocator keeps resident beyond live tensors at its
                                 # defaults (glibc: freed heap blocks once its mmap threshold has risen)
    pipe_slack: float = 0.0      # bytes a pipeline stage's heap keeps per byte of its largest freed block (0: no fit;
                                 # planner.host_memory.allocator_slack)
    zero1_slack: float = 0.0     # bytes zero_from_scratch's ZeRO-1 / ZeRO-2 step keeps per byte of its largest freed
    zero2_slack: float = 0.0     # block (benchmarks.planner_fit --slack); 0: no fit, alloc_slack's rule
    slack_sigma: float = 0.0     # σ of ln(slack) from launch to launch (the slack fits' launches, pooled): how far the
                                 # fullest of a stage's ranks lies above one (planner.host_memory.worst_of); 0: no term
    mmap_s: float = 0.0          # CPU seconds per byte first touched in a freshly mapped block (page fault, mmap/munmap)
    map_layer: float = 0.0       # bytes a layer's forward + backward touches afresh per byte it saves, and the top per
    map_head: float = 0.0        # logit byte, when every large block is mapped (benchmarks.planner_fit_map)
    step_cpu: float = 1.0        # a training step's CPU seconds over the sum of its parts at the micro-benchmarks'
                                 # rates (fitted on a whole step, benchmarks.planner_fit_engine; per_step applies it)
    slice_cpu: float = 0.0       # κ: a rank's CPU seconds grow by 1 + κ·(1 − cores/ranks) once a node's ranks outnumber
                                 # its cores (planner.cpu_host.slice_factor; benchmarks.planner_fit --slices); 0: no term
    calibrated_on: str = ""
    source: str = ""


GB, GiB = 1e9, 2**30
_NV = ("NVIDIA A100/H100 datasheets; DGX A100/H100 user guides; nccl-tests busbw figures "
       "(approximate, see planner/hardware.py)")
A100 = Hardware(
    "a100", peak_flops=312e12, memory=80 * GB, mem_bandwidth=2.039e12, gpus_per_node=8,
    intra=Params(alpha=3e-6, beta=1 / 230e9, gamma=0.0), inter=Params(alpha=6e-6, beta=1 / (8 * 23e9), gamma=0.0),
    host_link=25e9, host_adam=1.25e8, gemm_efficiency=0.5745, reserved=3 * GiB,
    calibrated_on="Narayanan et al. Table 1, GPT 1.7B on 32 A100s (137 TFLOP/s)", source=_NV)
A100_40G = Hardware(**{**asdict(A100), "intra": A100.intra, "inter": A100.inter, "name": "a100-40g",
                       "memory": 40 * GB, "mem_bandwidth": 1.555e12})
H100 = Hardware(
    "h100", peak_flops=989.4e12, memory=80 * GB, mem_bandwidth=3.35e12, gpus_per_node=8,
    intra=Params(alpha=3e-6, beta=1 / 360e9, gamma=0.0), inter=Params(alpha=6e-6, beta=1 / (8 * 45e9), gamma=0.0),
    host_link=50e9, host_adam=1.25e8, gemm_efficiency=0.4736, reserved=4 * GiB,
    calibrated_on="Megatron-LM README, H100 weak scaling, GPT 1.7B on 48 GPUs (MFU 41 %)", source=_NV)
BUILTIN = {h.name: h for h in (A100, A100_40G, H100)}


RECORDS = ("wait_fit", "engine_fit", "slice_fit", "slack_fit", "cpu")     # how and where a fitted file's terms were fitted, not fields


def _from_dict(d: dict) -> Hardware:
    d = {k: v for k, v in d.items() if k not in RECORDS}
    for k in ("intra", "inter"):
        d[k] = Params(**d[k]) if isinstance(d[k], dict) else d[k]
    return Hardware(**d)


def cpu_here(ranks_per_node: int = 2, load: float = 0.0, fitted: dict | None = None) -> Hardware:
    """This machine: compute from benchmarks/planner_fit.py's CPU-time micro-benchmarks
    (cpu_here.json), the shared-memory link for that many ranks from the same file (its `links`,
    the fastest all-reduce of each size: the link unimpeded, stretched by the load in
    planner.steptime; without them benchmarks.one_host's primitives.engine.cost.FITTED; across
    nodes the tbf-shaped veth of multinode/, 400 Mbit/s); `load` other runnable tasks share its cores (planner.cpu_host.cpu_stretch).
    `fitted`: the fields of cpu_here.json, given instead of read (benchmarks.planner_fit while it fits)."""
    if fitted is None and not os.path.exists(CPU_HERE):
        raise ValueError(f"{CPU_HERE} is missing: run `python -m benchmarks.planner_fit`")
    if fitted is None:
        with open(CPU_HERE) as f:
            fitted = json.load(f)
        check_cpu(CPU_HERE, fitted.get("cpu"))
    d = {k: v for k, v in fitted.items() if k not in RECORDS}
    d.update(cores=os.cpu_count(), memory=rank_memory() or d["memory"])    # the machine's, whichever processor's fit it reads
    links = d.pop("links", None) or {}
    fits = sorted(int(n) for n in links)
    n = next((k for k in fits if k >= ranks_per_node), fits[-1] if fits else 0)    # 8 ranks: the 4-rank fit
    d["intra"] = d.get("intra") or (links[str(n)] if n else asdict(fitted_params("shm", ranks_per_node)))
    d["inter"] = d.get("inter") or asdict(Params(alpha=1e-3, beta=8 / 400e6, gamma=0.0))
    return _from_dict({**d, "load": load})


# CPU seconds per unit of a step's ops, fitted on micro-benchmarks (with peak_flops and host_adam, units per CPU
# second); a page fault (mmap_s) and zero3_module_s are fitted on whole steps, so step_cpu does not scale them
MICRO = ("op_overhead", "elementwise_s", "llama_op_overhead", "llama_elementwise_s", "logit_s", "vp_loss_s",
         "call_overhead")


def at_speed(hw: Hardware, speed: float) -> Hardware:
    """hw with every CPU-second rate scaled by `speed`: the FLOPs a CPU second buys now over what
    the fit measured (planner.probe); work per CPU second (FLOP/s, Adam's parameters/s) × speed,
    CPU seconds per unit of work ÷ speed. One factor for matmuls and the memory-bound work alike."""
    if speed == 1.0:
        return hw
    return replace(hw, peak_flops=hw.peak_flops * speed, host_adam=hw.host_adam * speed,
                   **{k: getattr(hw, k) / speed for k in (*MICRO, "mmap_s", "zero3_module_s")})


def per_step(hw: Hardware) -> Hardware:
    """hw with the micro-benchmarks' rates scaled to a step's by step_cpu, the whole-step ratio
    benchmarks.planner_fit_engine measures on a DDP step at its calibration shape: the parts are
    fitted repeating one op or layer on warm caches and a reused heap block, a step's data has
    left the caches and glibc returns and takes back pages between its ops. One ratio for every
    layout and model (what makes it up is not measured); applied once (step_cpu becomes 1)."""
    k = hw.step_cpu
    if k == 1.0:
        return hw
    return replace(hw, step_cpu=1.0, peak_flops=hw.peak_flops / k, host_adam=hw.host_adam / k,
                   **{name: getattr(hw, name) * k for name in MICRO})


def cpu_now(ranks_per_node: int = 2, seconds: float = 2.0) -> Hardware:
    """cpu-here as this machine is now: planner.probe's processes, one per core in a session of
    their own, measure for `seconds` the cores other tasks take (→ `load`), the share a woken
    task gets and the FLOPs a CPU second buys (→ at_speed over the fitted rate). A run predicted with it should start in a
    session of its own (a terminal of its own), as the probe did."""
    hw = cpu_here(ranks_per_node)
    p, wake, used = probe_now(seconds)
    speed = p.rate() / (hw.peak_flops * hw.gemm_efficiency)
    return replace(at_speed(replace(hw, load=p.load(used), wake_share=wake), speed), name="cpu-now",
                   calibrated_on=f"{hw.calibrated_on}; probed now: a session got {p.share():.2f} cores, a task "
                                 f"that sleeps and wakes {wake:.2f} of a core awake, a CPU second "
                                 f"{p.rate() / 1e9:.1f} GFLOP of matmul, ×{speed:.2f} the fit's")


def load(name: str, ranks_per_node: int = 2) -> Hardware:
    if name in BUILTIN:
        return BUILTIN[name]
    if name == "cpu-here":
        return cpu_here()
    if name == "cpu-now":
        return cpu_now(ranks_per_node)
    if os.path.exists(name):
        try:
            with open(name) as f:
                hw = _from_dict(json.load(f))
        except (OSError, json.JSONDecodeError, TypeError, KeyError, AttributeError) as e:
            raise ValueError(f"--hardware {name}: not a hardware file ({type(e).__name__}: {e}); expected "
                             f"planner.hardware.Hardware's fields, as planner/cpus/*/cpu_here.json hold them") from e
        unread = [k for k in ("op_overhead", "llama_op_overhead", "llama_elementwise_s") if getattr(hw, k)]
        if unread and not hw.elementwise_s:     # planner.steptime reads a fitted layer line only with elementwise_s
            raise ValueError(f"--hardware {name}: {', '.join(unread)} set without elementwise_s; a CPU host's fitted "
                             "layer line is read only with it: set elementwise_s or leave them 0")
        return hw
    raise ValueError(f"unknown hardware {name!r}: one of {', '.join([*BUILTIN, 'cpu-here', 'cpu-now'])} or a JSON file")


def to_dict(hw: Hardware) -> dict:
    return asdict(hw)
