"""What one rank of benchmarks.planner_local runs and measures: the model (planner.model.Model
built in torch), its steps through torch, zero_from_scratch's or pipeline_parallel's engine, and
the step's time, CPU seconds and peak resident memory, and the machine's speed between the steps
(benchmarks.planner_local's docstring says how each is measured).

    python -m benchmarks.planner_local          # runs these on 2-4 ranks, with the planner's prediction beside

Cost: the ranks' training steps; the resident-set reads are a /proc read per step; the speed
readings READ_S (0.2) CPU seconds per step and rank, outside the timed step.
"""
from __future__ import annotations

import ctypes
import statistics
import time

import torch

import primitives as P
import zero_from_scratch
from planner.layout import Layout
from planner.memory import stage_params
from planner.model import Model
from planner.probe import Rate
from pipeline_parallel import LayerSpec, PipelineModule, TiedLayerSpec
from pipeline_parallel import initialize as pipe_initialize
from pipeline_parallel.engine.model import Embed, FinalNorm, head, lm_loss
from pipeline_parallel.models.llama import LlamaBlockPipe, LlamaEmbedPipe, LlamaHeadPipe, LlamaNormPipe, llama_config, llama_loss
from transformers.models.llama.modeling_llama import LlamaDecoderLayer, LlamaRMSNorm

SHAPES = [Model("gpt-mini", 4, 256, 4, 8192, 128, positions=128), Model("gpt-small", 6, 384, 6, 16384, 128, positions=128)]


def _vm(key: str) -> int:
    with open("/proc/self/status") as f:
        return next(int(ln.split()[1]) * 1024 for ln in f if ln.startswith(key))


class Net(torch.nn.Module):
    def __init__(self, m: Model):
        super().__init__()
        self.emb = torch.nn.Embedding(m.vocab, m.hidden)
        self.pos = torch.nn.Embedding(m.positions, m.hidden)
        # GPT-2's N(0, 0.02), as pipeline_parallel's Embed: at torch's N(0, 1) the tied head's logit of a
        # token's own input is |e|² ≈ h, the loss 0 and the gradients mostly zero or subnormal (≤ 1e-29), so
        # the backward multiplies subnormal floats, which some CPUs do 10-30× slower (no planner term has it)
        for e in (self.emb, self.pos):
            torch.nn.init.normal_(e.weight, std=0.02)
        self.layers = torch.nn.ModuleList(torch.nn.TransformerEncoderLayer(
            m.hidden, m.heads, m.f, dropout=0.0, batch_first=True, norm_first=True) for _ in range(m.layers))
        self.norm = torch.nn.LayerNorm(m.hidden)

    def forward(self, x):
        h = self.emb(x) + self.pos(torch.arange(x.shape[1]))
        for layer in self.layers:
            h = layer(h)
        return self.norm(h) @ self.emb.weight.t()


def _reset_peak() -> None:
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")          # VmHWM := VmRSS


_RATE: list[Rate] = []     # this rank's speed reader, made before the baseline (_warm)
READ_S = 0.2     # CPU seconds per reading: the guest's dips of 0.05-0.2 s count for their length, as in a step


def _warm(tuned: bool = False) -> int:
    """Load what a first step loads and make this rank's speed reader, then return the baseline RSS
    (benchmarks.planner_local's docstring)."""
    if tuned:
        ctypes.CDLL("libc.so.6").mallopt(-3, 64 * 1024)     # M_MMAP_THRESHOLD: the labelled tuned rows only
    warm = Net(Model("warm", 1, 64, 4, 64, 16, positions=16))     # torch's modules and pools load here, not below
    wopt = torch.optim.AdamW(warm.parameters())
    warm(torch.zeros(1, 16, dtype=torch.long)).sum().backward()
    wopt.step()
    P.all_reduce(torch.zeros(16))
    del warm, wopt
    _RATE[:] = [Rate(cpu_s=READ_S)]
    _reset_peak()
    return _vm("VmRSS")


def _timed(one_step, steps: int, base: int) -> dict:
    """Run `steps` steps, the peak reset before each. Step: the median after the first, wall and CPU.
    Rates: the FLOPs per CPU second of planner.probe's products read before each step and after the
    last (outside the timed step, allocating nothing): the machine's speed while the row ran.
    Times, cpus: every step's wall and CPU seconds."""
    times, cpus, peaks, rates = [], [], [], []
    for _ in range(steps):
        rates.append(_RATE[0].read())
        _reset_peak()
        t0, c0 = time.perf_counter(), time.thread_time()
        one_step()
        times.append(time.perf_counter() - t0)
        cpus.append(time.thread_time() - c0)
        peaks.append(_vm("VmHWM") - base)
    rates.append(_RATE[0].read())
    return {"step": statistics.median(times[1:]), "cpu": statistics.median(cpus[1:]), "peak": max(peaks), "peaks": peaks,
            "rates": rates, "times": times, "cpus": cpus}


def _rank(rank, world, m: Model, mb: int, steps: int, zero: int | None = None, tuned: bool = False,
          offload: bool = False):
    base = _warm(tuned)
    torch.manual_seed(0)
    net = Net(m)
    assert sum(p.numel() for p in net.parameters()) == m.params(), "torch model ≠ planner's count"
    x = torch.randint(0, m.vocab, (mb, m.seq), generator=torch.Generator().manual_seed(rank))
    if zero is not None:
        return _zero_steps(net, x, zero, mb, steps, base, offload)
    opt = torch.optim.AdamW(net.parameters(), lr=1e-4)

    def step():
        loss = torch.nn.functional.cross_entropy(net(x).flatten(0, 1), x.flatten())
        loss.backward()
        flat = torch.cat([p.grad.flatten() for p in net.parameters()])
        P.all_reduce(flat)
        off = 0
        for p in net.parameters():
            p.grad.copy_(flat[off:off + p.numel()].view_as(p)).div_(world)
            off += p.numel()
        del flat              # the copy lives only while it is reduced (planner.memory: ZeRO-0's working)
        opt.step()
        opt.zero_grad(set_to_none=False)
    return _timed(step, steps, base)


def _zero_steps(net, x, zero: int, mb: int, steps: int, base: int, offload: bool):
    """The same steps through zero_from_scratch's DeepSpeed-API engine at ZeRO `zero` (fp32, AdamW)."""
    if zero == 3:     # the tied output layer reads the embedding's weight outside the embedding's forward
        zero_from_scratch.register_external_parameter(net, net.emb.weight)
        for layer in net.layers:   # nn.MultiheadAttention reads out_proj's tensors without calling it
            for p in layer.self_attn.out_proj.parameters():
                zero_from_scratch.register_external_parameter(layer.self_attn, p)
    engine, *_ = zero_from_scratch.initialize(model=net, model_parameters=net.parameters(), dist_init_required=False, config={
        "train_micro_batch_size_per_gpu": mb, "gradient_accumulation_steps": 1,
        "zero_optimization": {"stage": zero, "overlap_comm": False,
                              **({"offload_optimizer": {"device": "cpu"}} if offload else {})},
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-4}}})

    def step():
        loss = torch.nn.functional.cross_entropy(engine(x).flatten(0, 1), x.flatten())
        engine.backward(loss)
        engine.step()
    return _timed(step, steps, base)


def _pp_rank(rank, world, m: Model, mb: int, micro: int, steps: int):
    """pp = 2 (× dp = world / 2) through pipeline_parallel's DeepSpeed-API engine (1F1B, `micro`
    micro-batches of mb): the same layers as Net (token + position embedding tied to the head,
    torch's encoder layer)."""
    if m.layers % 2:
        raise ValueError(f"rank {rank}: {m.name} has {m.layers} layers; pp 2 needs an even count (the planner "
                         "counts L/2 layers per stage and refuses this layout)")
    base = _warm()
    layers = ([TiedLayerSpec("embed", Embed, m.vocab, m.hidden, m.positions)]
              + [LayerSpec(torch.nn.TransformerEncoderLayer, m.hidden, m.heads, m.f, dropout=0.0, batch_first=True,
                           norm_first=True) for _ in range(m.layers)]
              + [LayerSpec(FinalNorm, m.hidden), TiedLayerSpec("embed", Embed, m.vocab, m.hidden, m.positions, forward_fn=head)])
    half = m.layers // 2      # the planner's split: L/p layers per stage, the embedding first, norm and head last
    pm = PipelineModule(layers, num_stages=2, loss_fn=lm_loss, partition_method=[1 + half, m.layers - half + 2])
    engine, *_ = pipe_initialize(model=pm, config={
        "train_micro_batch_size_per_gpu": mb, "gradient_accumulation_steps": micro,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-4, "torch_adam": True}},
        "pipeline": {"schedule": "1f1b"}}, dp=world // 2)
    x = torch.randint(0, m.vocab, (mb, m.seq), generator=torch.Generator().manual_seed(rank))
    return _timed(lambda: engine.train_batch(data_iter=iter([(x, x)] * micro)), steps, base)


class _LlamaEmbed(LlamaEmbedPipe):
    def __init__(self, cfg):
        super().__init__(torch.nn.Embedding(cfg.vocab_size, cfg.hidden_size))


class _LlamaBlock(LlamaBlockPipe):
    def __init__(self, cfg, i: int):
        super().__init__(LlamaDecoderLayer(cfg, i), cfg)


class _LlamaNorm(LlamaNormPipe):
    def __init__(self, cfg):
        super().__init__(LlamaRMSNorm(cfg.hidden_size, eps=cfg.rms_norm_eps))


class _LlamaHead(LlamaHeadPipe):
    def __init__(self, cfg):
        super().__init__(torch.nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False))


def llama_planner_model(preset: str, seq: int) -> Model:
    """The planner's Model of pipeline_parallel.models.llama's preset (untied head, no biases)."""
    c = llama_config(preset)
    return Model(f"llama-{preset}", c.num_hidden_layers, c.hidden_size, c.num_attention_heads, c.vocab_size, seq,
                 ffn=c.intermediate_size, kv_heads=c.num_key_value_heads, gated=True, bias=False, tied=False)


def llama_pp_engine(rank, world, preset: str, seq: int, mb: int, micro: int):
    """(engine, one step, the batch) of pp = 2 (× dp = world / 2) of pipeline_parallel.models.llama's
    preset through the pipeline engine (1F1B, `micro` micro-batches of mb): its embedding, HF
    LlamaDecoderLayer blocks (SDPA), the final RMSNorm and the untied head, each built by a
    LayerSpec on its own stage only."""
    cfg = llama_config(preset)
    m = llama_planner_model(preset, seq)
    L = cfg.num_hidden_layers
    torch.manual_seed(0)
    layers = ([LayerSpec(_LlamaEmbed, cfg)] + [LayerSpec(_LlamaBlock, cfg, i) for i in range(L)]
              + [LayerSpec(_LlamaNorm, cfg), LayerSpec(_LlamaHead, cfg)])
    half = L // 2      # the planner's split: L/p layers per stage, the embedding first, norm and head last
    pm = PipelineModule(layers, num_stages=2, loss_fn=llama_loss, partition_method=[1 + half, L - half + 2])
    stage = sum(p.numel() for p in pm.parameters())
    want = {stage_params(m, Layout(world // 2, 1, 2), k) for k in ("first", "last")}
    assert stage in want, f"stage parameters {stage} ≠ the planner's {want}"
    engine, *_ = pipe_initialize(model=pm, config={
        "train_micro_batch_size_per_gpu": mb, "gradient_accumulation_steps": micro,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-4, "torch_adam": True}},
        "pipeline": {"schedule": "1f1b"}}, dp=world // 2)
    x = torch.randint(0, cfg.vocab_size, (mb, seq), generator=torch.Generator().manual_seed(rank))
    return engine, lambda: engine.train_batch(data_iter=iter([(x, x)] * micro)), x


def _llama_pp_rank(rank, world, preset: str, seq: int, mb: int, micro: int, steps: int):
    """llama_pp_engine's steps, timed (_timed) after the warm-up."""
    base = _warm()
    return _timed(llama_pp_engine(rank, world, preset, seq, mb, micro)[1], steps, base)
