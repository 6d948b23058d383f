"""zero.Init and GatheredParameters (zero_from_scratch/engine/zero_init.py, zero_partition.py, zero_gathered.py).

    python -m pytest -x -q tests/test_zero_init.py            (+ -m slow: T5, DistilBERT, resize, the runner)

Every multi-rank test runs 2 ranks and compares against the same constructor run without Init under
the same seed: values must be bit-equal (Init changes where tensors live, not a single RNG draw),
and training through initialize() gives the plain model's losses exactly (the engine's shards hold
the same bits either way, so every collective and every step is the same). Also: GatheredParameters
reads and writes (modifier_rank) on Init's and on the engine's parameters, the bodies of DeepSpeed's
own zero.Init unit tests, peak memory (VmHWM) against M/N + one module, transformers' ZeRO-3 paths
(from_pretrained, _from_config, resize_token_embeddings) with `import deepspeed` answered by a minimal
module exposing ours (and, slow, by the runner), and ZeRO-Infinity (offload_param + offload_optimizer in files).
"""
import functools
import importlib.machinery
import sys
import types

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn

import zero_from_scratch
from primitives.launch import spawn as _spawn
from zero_from_scratch.engine import zero_init
from zero_from_scratch.engine.zero_init import GatheredParameters, Init, ZeroParamStatus

spawn_fn = functools.partial(_spawn, timeout=180.0)
CFG = {"train_micro_batch_size_per_gpu": 2, "gradient_clipping": 1.0,
       "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "weight_decay": 0.01}},
       "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0}}


class Net(nn.Module):
    """Children initialise themselves; the parent then edits their (already partitioned) weights."""

    def __init__(self, d=8):
        super().__init__()
        self.emb = nn.Embedding(10, d, padding_idx=0)
        self.a, self.b = nn.Linear(d, 2 * d), nn.Linear(2 * d, 3)
        nn.init.normal_(self.a.weight, std=0.02)
        self.b.bias.data.zero_()
        self.emb.weight.data[self.emb.padding_idx].fill_(3.0)

    def forward(self, ids):
        return self.b(torch.relu(self.a(self.emb(ids)))).mean(1)


def build(init: bool, ctor=Net, **kw):
    torch.manual_seed(0)
    if not init:
        return ctor()
    with Init(dtype=torch.float32, **kw):
        return ctor()


def _full(model) -> dict:
    out = {}
    for n, p in model.named_parameters():
        with GatheredParameters(p):
            out[n] = p.detach().clone()
    return out


def _construct(rank, world):
    ref, m = build(False), build(True)
    shapes = {n: (tuple(p.shape), tuple(p.ds_shape), p.ds_tensor.numel(), p.ds_status) for n, p in m.named_parameters()}
    full = _full(m)
    same = {n: torch.equal(full[n], p) for n, p in ref.named_parameters()}
    ids = [p.ds_id for p in m.parameters()]
    return shapes, same, ids, all(p.ds_status is ZeroParamStatus.NOT_AVAILABLE for p in m.parameters())


def test_init_partitions_as_built_and_equals_plain_constructor(spawn):
    res = spawn(_construct, 2)
    for shapes, same, ids, released in res:
        assert all(same.values()), same
        for n, (shape, ds_shape, shard, status) in shapes.items():
            numel = torch.Size(ds_shape).numel()
            assert shape == (0,) and shard == -(-numel // 2), (n, shape, shard)
            assert status is ZeroParamStatus.NOT_AVAILABLE
        assert released
    assert res[0][2] == res[1][2] == sorted(res[0][2])     # ds_id: creation order, same on every rank


def _modify(rank, world):
    m = build(True)
    with GatheredParameters([m.a.weight, m.b.bias], modifier_rank=1):
        assert m.a.weight.shape == (16, 8)
        m.a.weight.data.fill_(0.5 if rank == 1 else -9.0)     # only rank 1's edit may survive
        m.b.bias.data.fill_(rank + 1.0)
    shard = m.a.weight.ds_tensor.clone()
    with GatheredParameters(m.a.weight):                       # read only: nothing written back
        m.a.weight.data.fill_(7.0)
    full = _full(m)
    return shard, full["a.weight"], full["b.bias"]


def test_gathered_parameters_modifier_rank_on_init_params(spawn):
    for shard, w, b in spawn(_modify, 2):
        assert torch.equal(shard, torch.full((64,), 0.5))
        assert torch.equal(w, torch.full((16, 8), 0.5)) and torch.equal(b, torch.full((3,), 2.0))


def mlp():
    return nn.Sequential(nn.Linear(5, 16), nn.ReLU(), nn.Linear(16, 3))


def _train(rank, world, variant: str):
    """(plain, Init) runs of one variant in this process: fp32; an edit through GatheredParameters
    at step 2; bf16 (Init's dtype from the config); a frozen weight (frozen.py adopts it)."""
    cfg = {**CFG, "bf16": {"enabled": True}} if variant == "bf16" else CFG
    out = []
    for init in (False, True):
        torch.manual_seed(0)
        with Init(config_dict_or_path=cfg, enabled=init):
            model = mlp() if variant == "bf16" else Net()
        if variant == "frozen":
            model.a.weight.requires_grad_(False)
        engine, *_ = zero_from_scratch.initialize(model=model, config=cfg)
        losses = []
        for step in range(4):
            if variant == "edit" and step == 2:                # rank 0 writes, every shard follows
                with GatheredParameters(model.a.weight, modifier_rank=0):
                    if rank == 0:
                        model.a.weight.data.mul_(0.5)
            g = torch.Generator().manual_seed(10 * step + rank)
            x = torch.randn(2, 5, generator=g).bfloat16() if variant == "bf16" else torch.randint(0, 10, (2, 5), generator=g)
            loss = engine(x).float().pow(2).mean()
            engine.backward(loss)
            engine.step()
            losses.append(loss.item())
        out.append((losses, {n: v.float().tolist() for n, v in _full(model).items()}))
    return out


def test_initialize_adopts_init_model_and_trains_like_plain(spawn):
    runs = {v: spawn(_train, 2, args=(v,)) for v in ("fp32", "edit", "bf16", "frozen")}
    for v, per_rank in runs.items():
        for (lp, fp), (li, fi) in per_rank:
            assert lp == li, v                                 # exact: same shards, same collectives
            assert fp == fi, v
    for r in range(2):                                         # the edit was seen by rank 1 too
        assert runs["edit"][r][1][0][:2] == runs["fp32"][r][1][0][:2]
        assert runs["edit"][r][1][0][2] != runs["fp32"][r][1][0][2]
    start = build(False).a.weight.tolist()
    assert runs["frozen"][0][1][1]["a.weight"] == start != runs["fp32"][0][1][1]["a.weight"]   # frozen: untouched


def test_init_peak_memory_is_a_shard_plus_one_module(spawn):
    """VmHWM above the RSS before construction (benchmarks/zero_init_memory.py, glibc's mmap threshold
    fixed so frees reach the OS): M = 4Ψ = 32 MiB, one module L = 4 MiB, N = 2. Every row also holds
    first-use allocations made inside the window (measured 1-12 MiB, depending on the process), so
    the check is on what Init saves against the plain build: M - (M/N + L) = 12 MiB, less 2 MiB."""
    from benchmarks.zero_init_memory import ROWS, peaks   # a benchmark script's helpers, only this test needs them
    mib, layers, dim = 2 ** 20, 8, 1024
    m, big = 4 * layers * dim ** 2, 4 * dim ** 2
    per_rank = spawn(peaks, 2, args=(layers, dim))
    got = {row: max(r[i] for r in per_rank) for i, row in enumerate(ROWS)}
    plain, init, adopted = got[False, False], got[True, False], got[True, True]
    assert plain >= 0.95 * m, plain / mib
    assert plain - init >= m - (m / 2 + big) - 2 * mib, (plain / mib, init / mib)   # a shard and one module, not M
    overhead = max(plain - m, 0)
    assert adopted <= 4 * m / 2 + big + overhead + 6 * mib, adopted / mib   # the engine's 16Ψ/N + one unit, never + M


def _infinity(rank, world, init: bool, path):
    """A model built under Init, its shards and Adam state in files (offload_param + offload_optimizer
    nvme, ZeRO-Infinity), an edit through GatheredParameters: losses vs plain ZeRO-3 in memory."""
    z = {"stage": 3, "stage3_param_persistence_threshold": 0}
    if path:
        z["offload_param"] = {"device": "nvme", "nvme_path": path, "max_in_cpu": 0}
        z["offload_optimizer"] = {"device": "nvme", "nvme_path": path}
    cfg = {**CFG, "zero_optimization": z}
    torch.manual_seed(0)
    with Init(config_dict_or_path=cfg, enabled=init):
        model = nn.Sequential(nn.Linear(5, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 3))
    engine, *_ = zero_from_scratch.initialize(model=model, config=cfg)
    losses = []
    for step in range(4):
        if step == 2:
            with GatheredParameters(model[2].weight, modifier_rank=0):
                if rank == 0:
                    model[2].weight.data.mul_(0.5)
        x = torch.randn(2, 5, generator=torch.Generator().manual_seed(10 * step + rank))
        loss = engine(x).pow(2).mean()
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    return losses


def test_init_with_parameter_and_optimizer_offload_to_files(spawn, tmp_path):
    with pytest.raises(ValueError, match="nvme_path"):
        Init(config_dict_or_path={"zero_optimization": {"offload_param": {"device": "nvme"}}})
    plain = spawn(_infinity, 2, args=(False, None))
    assert spawn(_infinity, 2, args=(True, str(tmp_path))) == plain     # exact


# ---------------------------------------------------------------------- transformers
def fake_deepspeed():
    """`import deepspeed` answered by a minimal module exposing our Init / GatheredParameters: the
    names transformers' ZeRO-3 paths use (zero.Init, zero.GatheredParameters, comm.get_rank,
    accelerator.get_accelerator, partition_parameters' arange hooks for prevent_arange_dtype_change)."""
    def mod(name, **kw):
        m = types.ModuleType(name)
        m.__spec__ = importlib.machinery.ModuleSpec(name, None)
        m.__dict__.update(kw)
        sys.modules[name] = m
        return m

    class Accelerator:
        def current_device_name(self):
            return "cpu"

    ds = mod("deepspeed", __version__="0.19.8")
    ds.zero = mod("deepspeed.zero", Init=zero_init.Init, GatheredParameters=zero_init.GatheredParameters,
                  register_external_parameter=zero_init.register_external_parameter)
    ds.comm = mod("deepspeed.comm", get_rank=dist.get_rank, get_world_size=dist.get_world_size)
    ds.accelerator = mod("deepspeed.accelerator", get_accelerator=Accelerator)
    ds.runtime = mod("deepspeed.runtime")
    ds.runtime.zero = mod("deepspeed.runtime.zero")
    ds.runtime.zero.partition_parameters = mod("deepspeed.runtime.zero.partition_parameters",
                                               _orig_torch_arange=torch.arange,
                                               zero_wrapper_for_fp_tensor_constructor=lambda fn, *a, **k: fn)


def tiny_llama_config():
    import transformers as T   # optional dependency: imported in the rank processes, after the skip check
    return T.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, pad_token_id=0)


def _differ(ref, model) -> list:
    full = _full(model)
    return [n for n, p in ref.named_parameters() if not torch.equal(full[n], p)]


def _llama_steps(model, rank) -> list:
    engine, *_ = zero_from_scratch.initialize(model=model, config=CFG)
    losses = []
    for step in range(3):
        g = torch.Generator().manual_seed(10 * step + rank)
        ids = torch.randint(1, 64, (2, 8), generator=g)
        loss = engine(input_ids=ids, labels=ids).loss
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    return losses


def _served_deepspeed():
    """`import deepspeed` answered by the ringzero runner (zero_from_scratch.as_deepspeed)."""
    from zero_from_scratch.as_deepspeed import finder   # present only where the runner is in the tree
    finder.install()


def _hf(rank, world, ckpt, train, runner=False):
    import transformers as T   # optional dependency: imported in the rank processes, after the skip check
    from transformers import initialization   # (same)
    from transformers.integrations import HfDeepSpeedConfig, is_deepspeed_zero3_enabled   # (same)
    out = {}
    # 1. our Init around the constructor: post_init's _init_weights runs on gathered weights
    plain, built = build(False, lambda: T.LlamaForCausalLM(tiny_llama_config())), \
        build(True, lambda: T.LlamaForCausalLM(tiny_llama_config()))
    out["construct"] = _differ(plain, built)
    if train:
        out["train"] = (_llama_steps(plain, rank), _llama_steps(built, rank))
    # 2. transformers' own ZeRO-3 paths, `import deepspeed` answered by our module
    _served_deepspeed() if runner else fake_deepspeed()
    ref = T.LlamaForCausalLM.from_pretrained(ckpt)
    torch.manual_seed(0)
    with initialization.no_init_weights():       # transformers' ZeRO-3 recipe, in one process:
        recipe = T.LlamaForCausalLM(tiny_llama_config())
    recipe.initialize_weights()                  # no init while building, then post-order init
    keep = HfDeepSpeedConfig({"zero_optimization": {"stage": 3}, "train_micro_batch_size_per_gpu": 1})
    assert is_deepspeed_zero3_enabled()
    loaded = T.LlamaForCausalLM.from_pretrained(ckpt)
    out["pretrained_empty"] = all(p.numel() == 0 for p in loaded.parameters())
    out["pretrained"] = _differ(ref, loaded)
    torch.manual_seed(0)
    out["from_config"] = _differ(recipe, T.LlamaForCausalLM._from_config(tiny_llama_config()))
    if not train:
        return out
    torch.manual_seed(2)                         # resize: transformers' GatheredParameters paths
    loaded.resize_token_embeddings(80)
    del keep                                     # ZeRO-3 off: the same calls on the plain model
    torch.manual_seed(2)
    ref.resize_token_embeddings(80)
    out["resized"] = _differ(ref, loaded)
    out["pretrained_train"] = (_llama_steps(ref, rank), _llama_steps(loaded, rank))
    return out


def _hf_run(tmp_path, train: bool, runner: bool = False) -> list:
    T = pytest.importorskip("transformers")
    torch.manual_seed(1)
    T.LlamaForCausalLM(tiny_llama_config()).save_pretrained(tmp_path)
    outs = spawn_fn(_hf, 2, args=(str(tmp_path), train, runner), timeout=400)
    for out in outs:
        assert out["construct"] == [], out["construct"]
        assert out["pretrained_empty"] and out["pretrained"] == [], out["pretrained"]
        assert out["from_config"] == [], out["from_config"]
    return outs


def test_transformers_llama_under_init_and_from_pretrained(tmp_path):
    """~30 s: transformers' import in each rank dominates."""
    _hf_run(tmp_path, train=False)


@pytest.mark.slow
def test_transformers_llama_trains_after_init_from_pretrained_and_resize(tmp_path):
    for out in _hf_run(tmp_path, train=True):
        plain, built = out["train"]
        assert plain == built                                  # exact
        assert out["resized"] == [], out["resized"]
        plain, loaded = out["pretrained_train"]
        assert plain == loaded


@pytest.mark.slow
def test_transformers_zero3_paths_through_the_deepspeed_runner(tmp_path):
    """The same, with `import deepspeed` served by the runner's table (it must serve zero.Init,
    GatheredParameters, comm.get_rank, accelerator, and partition_parameters' _orig_torch_arange /
    zero_wrapper_for_fp_tensor_constructor, which transformers' prevent_arange_dtype_change swaps)."""
    for out in _hf_run(tmp_path, train=True, runner=True):
        assert out["train"][0] == out["train"][1] and out["pretrained_train"][0] == out["pretrained_train"][1]
        assert out["resized"] == []


# ---------------------------------------------------------------------- DeepSpeed's own unit tests
class ConvX(nn.Conv1d):
    def __init__(self, *args):
        super().__init__(*args)
        self.param_in = nn.Parameter(torch.FloatTensor(5).uniform_())


class ConvNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv1 = ConvX(1, 3, 4)
        self.param = nn.Parameter(torch.FloatTensor(5).uniform_())


class GrandPa(nn.Module):
    def __init__(self, *args):
        super().__init__(*args)
        self.param_grandpa = nn.Parameter(torch.ones(5))
        self.param_grandpa.data = (self.param_grandpa.data + 1).data


class Pa(GrandPa):
    def __init__(self, *args):
        super().__init__(*args)
        self.param_pa = nn.Parameter(torch.ones(5))
        self.param_pa.data = (self.param_pa.data + 1).data
        self.param_grandpa.data = (self.param_grandpa.data + 1).data


class Son(Pa):
    def __init__(self):
        super().__init__()
        self.param = nn.Parameter(torch.ones(5))
        self.param.data = (self.param.data + 1).data
        self.param_pa.data = (self.param_pa.data + 1).data
        self.param_grandpa.data = (self.param_grandpa.data + 1).data


def _deepspeed_bodies(rank, world):
    """Bodies of DeepSpeed's tests/unit/runtime/zero/test_zero_context*.py and test_zero_nesting_init.py
    (their DistributedTest harness replaced by spawn), deepspeed.zero → ours."""
    NA, AV = ZeroParamStatus.NOT_AVAILABLE, ZeroParamStatus.AVAILABLE
    ds_config = {"train_batch_size": 2, "zero_optimization": {"stage": 3}}
    # TestZeroGatheredParametersFree
    with Init(config_dict_or_path=ds_config):
        m = nn.Sequential(nn.Linear(10, 10))
    with GatheredParameters(list(m.parameters())):
        assert m[0].weight.numel() != 0
    assert m[0].weight.numel() == 0
    # TestSerialContext.test_subclass_param
    with Init(config_dict_or_path=ds_config):
        net = ConvNet()
    assert net.param.ds_status == NA and net.conv1.param_in.ds_status == NA
    # TestScatterGather
    with Init(config_dict_or_path=ds_config):
        lin = nn.Linear(6, 3)
    assert lin.weight.ds_status == NA and lin.weight.shape == torch.Size([0])
    l2 = nn.Linear(6, 3)                                  # no effect outside the context
    assert not hasattr(l2.weight, "ds_status") and l2.weight.numel() == 18
    with GatheredParameters(lin.weight):
        assert lin.weight.ds_status == AV and lin.weight.numel() == 18
    # TestGatherUpdate
    with Init(config_dict_or_path=ds_config):
        lin = nn.Linear(4, 2)
    with GatheredParameters(lin.weight, modifier_rank=1):
        assert lin.weight.ds_status == AV
        if rank == 1:
            with torch.no_grad():
                lin.weight.zero_()
    with GatheredParameters(lin.weight):
        assert torch.equal(lin.weight, torch.zeros_like(lin.weight))
    # test_zero_context_ancestry: edits inside each __init__ of a class chain need no gathering
    with Init(config_dict_or_path=ds_config):
        son = Son()
    assert all(p.ds_status == NA for p in son.parameters())
    with GatheredParameters(list(son.parameters(recurse=False))):
        ones = torch.ones(5)
        assert torch.equal(son.param, ones + 1) and torch.equal(son.param_pa, ones + 2)
        assert torch.equal(son.param_grandpa, ones + 3)
    # TestNestingInit / TestShutdownInNestingInit: nested contexts, initialize() inside one
    with Init(config_dict_or_path=ds_config):
        with Init(config_dict_or_path=ds_config):
            m1 = nn.Linear(4, 4)
        assert hasattr(m1.weight, "ds_id")
        e1, *_ = zero_from_scratch.initialize(model=m1, config=CFG)
        with Init(config_dict_or_path=ds_config):
            m2 = nn.Linear(4, 4)
    assert hasattr(m2.weight, "ds_id")
    try:                                                  # Init's shards need ZeRO-3
        zero_from_scratch.initialize(model=m2, config={**CFG, "zero_optimization": {"stage": 2}})
        raise AssertionError("stage 2 accepted a model built under Init")
    except ValueError as e:
        assert "stage=2" in str(e) and f"rank {rank}" in str(e)
    e2, *_ = zero_from_scratch.initialize(model=m2, config=CFG)
    assert m2.weight.ds_shape == (4, 4) and m2.weight.ds_numel == 16 and m2.weight.ds_tensor.shape == (-(-16 // world),)
    # GatheredParameters on engine parameters: status follows, edits reach every rank
    with GatheredParameters(m2.weight, modifier_rank=0):
        assert m2.weight.ds_status == AV and m2.weight.shape == (4, 4)
        if rank == 0:
            m2.weight.data.fill_(1.5)
    assert m2.weight.ds_status == NA
    with GatheredParameters(m2.weight):
        return m2.weight.sum().item()


def test_single_process_without_torch_distributed_and_classes_restored():
    """No process group: one rank holds every shard. On exit every wrapped __init__ is the original."""
    before = (nn.Linear.__init__, Net.__init__, nn.Module.__dict__.get("__init_subclass__"))
    m = build(True)
    assert all(p.numel() == 0 and p.ds_tensor.numel() == p.ds_numel for p in m.parameters())
    assert (nn.Linear.__init__, Net.__init__, nn.Module.__dict__.get("__init_subclass__")) == before
    full, ref = _full(m), build(False)
    assert all(torch.equal(full[n], p) for n, p in ref.named_parameters())
    lin = nn.Linear(3, 3)
    Init(module=lin)                          # DeepSpeed's module=: partition a model already built
    assert lin.weight.numel() == 0 and lin.weight.ds_shape == (3, 3)
    with pytest.raises(ValueError, match="nvme_path"):
        Init(remote_device="nvme", dtype=torch.float32)
    with pytest.raises(NotImplementedError, match="zero_quantized_weights"):
        Init(zero_quantized_weights=True)


def test_deepspeed_unit_test_bodies(spawn):
    assert spawn(_deepspeed_bodies, 2) == [24.0, 24.0]


def _t5_distilbert(rank, world):
    import transformers as T   # optional dependency: imported in the rank processes, after the skip check
    t5 = T.T5Config(vocab_size=64, d_model=32, d_kv=8, d_ff=64, num_layers=2, num_heads=4, decoder_start_token_id=0)
    db = T.DistilBertConfig(vocab_size=64, dim=32, n_layers=2, n_heads=4, hidden_dim=64, max_position_embeddings=32)
    out = {}
    for name, ctor in (("t5", lambda: T.T5ForConditionalGeneration(t5)),
                       ("distilbert", lambda: T.DistilBertForSequenceClassification(db))):
        plain, built = build(False, ctor), build(True, ctor)
        out[name] = _differ(plain, built)
        if name == "t5":                           # `shared` is held by encoder, decoder and head
            losses = []
            for model in (plain, built):
                engine, *_ = zero_from_scratch.initialize(model=model, config=CFG)
                torch.manual_seed(5)                   # T5's dropout draws from the RNG
                ls = []
                for step in range(3):
                    g = torch.Generator().manual_seed(10 * step + rank)
                    ids = torch.randint(1, 64, (2, 6), generator=g)
                    loss = engine(input_ids=ids, labels=ids).loss
                    engine.backward(loss)
                    engine.step()
                    ls.append(loss.item())
                losses.append(ls)
            out["t5_train"] = losses
    return out


@pytest.mark.slow
def test_transformers_t5_and_distilbert_under_init():
    pytest.importorskip("transformers")
    for out in spawn_fn(_t5_distilbert, 2, timeout=400):
        assert out["t5"] == [] and out["distilbert"] == [], out
        assert out["t5_train"][0] == out["t5_train"][1]


class Reassign(nn.Module):
    """A parent that replaces a built child's parameter data, and edits another child afterwards."""

    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(4, 4), nn.Linear(4, 4)
        self.b.weight.data.mul_(2.0)                       # b gathered (the mode)
        self.a.weight.data = torch.full((4, 4), 0.5)       # then a's data replaced
        self.a.bias.data = torch.ones(4)                   # while a.weight is gathered: same module
        self.b.bias.data.zero_()


def test_data_reassigned_during_construction_is_partitioned_on_exit():
    ref, m = build(False, Reassign), build(True, Reassign)
    assert all(p.numel() == 0 for p in m.parameters())
    full = _full(m)
    assert all(torch.equal(full[n], p) for n, p in ref.named_parameters())


class External(nn.Module):
    """`a.weight` is used again by the parent's forward (DeepSpeed's GatheredParameters fwd_module example)."""

    def __init__(self, use_ctx: bool):
        super().__init__()
        self.a, self.b = nn.Linear(8, 8), nn.Linear(8, 3)
        self.use_ctx = use_ctx

    def forward(self, x):
        h = self.a(x)
        if self.use_ctx:
            with GatheredParameters(self.a.weight, fwd_module=self):
                h = torch.nn.functional.linear(h, self.a.weight)
        else:
            h = torch.nn.functional.linear(h, self.a.weight)
        return self.b(h).pow(2).mean()


def _external(rank, world, init: bool):
    torch.manual_seed(0)
    with Init(config_dict_or_path=CFG, enabled=init):
        model = External(use_ctx=init)
    if not init:                                   # the reference registers it the documented way
        zero_from_scratch.register_external_parameter(model, model.a.weight)
    engine, *_ = zero_from_scratch.initialize(model=model, config=CFG)
    losses = []
    for step in range(3):
        loss = engine(torch.randn(2, 8, generator=torch.Generator().manual_seed(10 * step + rank)))
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    return losses


def test_gathered_parameters_fwd_module_inside_forward(spawn):
    assert spawn(_external, 2, args=(True,)) == spawn(_external, 2, args=(False,))


def test_init_with_nvme_writes_each_shard_to_a_file_as_it_is_built(tmp_path):
    """offload_param "nvme" in Init's config (init_swap.py): no shard stays in memory (ds_tensor
    empty, ds_numel kept), the file holds exactly the shards, reads give the plain model's values,
    an edit through GatheredParameters is rewritten in place, and initialize deletes the file."""
    cfg = {"train_micro_batch_size_per_gpu": 2, "optimizer": {"type": "AdamW"},
           "zero_optimization": {"stage": 3, "offload_param": {"device": "nvme", "nvme_path": str(tmp_path)}}}
    m = build(True, config_dict_or_path=cfg)
    (f,) = list(tmp_path.iterdir())
    assert all(p.numel() == 0 and p.ds_tensor.numel() == 0 for p in m.parameters())
    assert f.stat().st_size == sum(4 * p.ds_tensor.ds_numel for p in m.parameters())
    full, ref = _full(m), build(False)
    assert all(torch.equal(full[n], p) for n, p in ref.named_parameters())
    with GatheredParameters(m.a.weight, modifier_rank=0):
        m.a.weight.data.mul_(2)
    assert f.stat().st_size == sum(4 * p.ds_tensor.ds_numel for p in m.parameters())   # in place
    assert torch.equal(_full(m)["a.weight"], 2 * ref.a.weight)
    zero_from_scratch.initialize(model=m, config=cfg)
    assert not f.exists()


def _coalesced(rank, world):
    torch.manual_seed(0)
    ref = [torch.randn(n) for n in (5, 7, 4)]                      # 5 and 7 leave padding at 2 ranks
    with Init(dtype=torch.float32):
        m = nn.ParameterList([nn.Parameter(t.clone()) for t in ref])
    before = [p.ds_status for p in m]
    m[0].all_gather_coalesced(list(m)).wait()                      # DeepSpeed's per-parameter call
    return before, [p.ds_status for p in m], [torch.equal(p.data, t) for p, t in zip(m, ref)]


def test_all_gather_coalesced_installs_each_full_value(spawn):
    for before, after, equal in spawn(_coalesced, 2):
        assert before == [ZeroParamStatus.NOT_AVAILABLE] * 3 and after == [ZeroParamStatus.AVAILABLE] * 3
        assert all(equal)
