"""No silent key: every key DeepSpeed 0.19.8's config parser accepts is honoured, refused or warned by
each engine's KEY_STATUS, and the keys that change the gradient maths give DeepSpeed's numbers.

Reference: DeepSpeed's own schema (its pydantic models and the keys runtime/config.py reads) and
DeepSpeed's training run with the same key (fp32, losses within 1e-5 relative; slow)."""
import warnings

import pytest
import torch

from zero_from_scratch.engine.config import load_config
from zero_from_scratch.optim import ShardedAdam

BASE = {"train_batch_size": 4}
ENGINES = {"zero": "zero_from_scratch.engine.zero_keys",           # each exposes KEY_STATUS: it takes a
           "pipeline": "pipeline_parallel.engine.config",           # DeepSpeed config
           "ddp": "classification.ddp_keys"}                        # classification's --engine ddp


@pytest.mark.parametrize("raw, match", [
    ({"gradient_allreduce_op": "sum", "zero_optimization": {"stage": 3}}, r"'gradient_allreduce_op' = 'sum'.*stage 3"),
    ({"gradient_predivide_factor": 2.0, "zero_optimization": {"stage": 2}}, r"'gradient_predivide_factor'.*stage 2"),
    ({"prescale_gradients": True, "zero_optimization": {"stage": 3}}, r"'prescale_gradients'.*stage 3"),
    ({"communication_data_type": "fp16"}, r"'communication_data_type' = 'fp16' is refused"),
    ({"communication_data_type": "int8"}, r"'communication_data_type' = 'int8' is invalid"),
    ({"fp16": {"enabled": True, "auto_cast": True}}, r"'fp16.auto_cast' = true is refused"),
    ({"optimizer": {"type": "AdamW", "params": {"torch_adam": True, "bias_correction": False}}},
     r"'optimizer.params.bias_correction' is refused with torch_adam"),
])
def test_refusals_name_the_key(raw, match):
    with pytest.raises(ValueError, match=match):
        load_config({**BASE, **raw}, world_size=2)


def test_reduction_factors_follow_deepspeed():
    def red(raw, n=4):
        return load_config({"train_batch_size": 4 * n, **raw}, world_size=n).reduction
    assert (red({}).pre, red({}).post_divisor) == (1.0, 4.0)
    r = red({"prescale_gradients": True})                      # stage 0: ÷ N before the reduction
    assert (r.pre, r.post_divisor) == (0.25, 1.0)
    r = red({"gradient_predivide_factor": 2.0, "zero_optimization": {"stage": 2, "reduce_scatter": False}})
    assert (r.pre, r.post_divisor) == (0.5, 2.0)               # ÷ f before, × f/N after
    r = red({"gradient_allreduce_op": "sum", "zero_optimization": {"stage": 2}})
    assert (r.average, r.pre, r.post_divisor) == (False, 1.0, 1.0)
    with pytest.warns(UserWarning, match="no effect at stage 1"):
        c = load_config({"train_batch_size": 8, "prescale_gradients": True, "zero_optimization": {"stage": 1}}, 2)
        for n in c.zero.notes:
            warnings.warn(n)
    c = load_config({"train_batch_size": 8, "gradient_allreduce_op": "sum", "gradient_predivide_factor": 2.0}, 2)
    assert any("no effect with gradient_allreduce_op 'sum'" in n for n in c.zero.notes)
    assert (c.reduction.pre, c.reduction.post_divisor) == (1.0, 1.0)


def test_bias_correction_false_is_fused_adams_formula():
    # DeepSpeed's FusedAdam/CPUAdam with bias_correction false (csrc/adam): p -= lr · m / (sqrt(v) + eps)
    torch.manual_seed(0)
    p, lr, (b1, b2), eps = torch.randn(10), 1e-2, (0.9, 0.99), 1e-8
    opt = ShardedAdam([{"lr": lr, "betas": (b1, b2), "eps": eps, "weight_decay": 0.0, "bias_correction": False}], [10])
    want, m, v = p.clone(), torch.zeros(10), torch.zeros(10)
    for _ in range(3):
        g = torch.randn(10)
        opt.step_group(0, p, g, 0, 10, count=True)
        m = b1 * m + (1 - b1) * g
        v = b2 * v + (1 - b2) * g * g
        want -= lr * m / (v.sqrt() + eps)
    torch.testing.assert_close(p, want, rtol=1e-6, atol=1e-7)
    cfg = load_config({**BASE, "optimizer": {"type": "Adam", "params": {"bias_correction": False}}}, 1)
    assert cfg.optimizer.bias_correction is False


MATH_KEYS = [  # (stage, extra top-level keys, zero_optimization extras): DeepSpeed accepts each of these
    (0, {"prescale_gradients": True}, {}),
    (0, {"gradient_predivide_factor": 4.0}, {}),
    (1, {"gradient_predivide_factor": 4.0}, {"reduce_scatter": False}),
    (2, {"prescale_gradients": True}, {"reduce_scatter": False}),
    (1, {"gradient_allreduce_op": "sum"}, {}),
    (2, {"gradient_allreduce_op": "sum"}, {}),
    (2, {"communication_data_type": "fp32"}, {}),
    (2, {"optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "weight_decay": 0.1, "bias_correction": False}}}, {}),
]   # the last: DeepSpeed's FusedAdam (CPU build, ~45 s the first time, then cached) without bias correction


@pytest.mark.slow
@pytest.mark.deepspeed
def test_math_keys_match_deepspeed():
    pytest.importorskip("deepspeed")
    from parity.zero.ds_parity import make_config, run_parities
    from parity.zero.harness import Job
    pairs = []
    for stage, top, zx in MATH_KEYS:
        c = make_config(stage)
        c.update(top)
        c["zero_optimization"].update(zx)
        pairs.append((Job("deepspeed", "mlp", c, 4), Job("ours", "mlp", c, 4)))
    res = run_parities(pairs, 2, timeout=900)
    bad = []
    for (stage, top, zx), r in zip(MATH_KEYS, res):
        rel = max(abs(x["loss_ref"] - x["loss_ours"]) / abs(x["loss_ref"]) for x in r.rows)
        print(f"stage {stage} {top} {zx}: max loss rel diff {rel:.2e}, params {r.max_param_diff:.2e}, ok={r.ok}")
        fails = [f for f in r.failures if "grad norm nan (reference)" not in f]   # DeepSpeed's stage 0 keeps no norm
        if rel > 1e-5 or fails:
            bad.append(f"stage {stage} {top} {zx}: loss rel {rel:.2e}; " + "; ".join(fails))
    assert not bad, "\n".join(bad)


def deepspeed_keys() -> set[str]:
    """Every dotted key DeepSpeed 0.19.8's parser reads: the top-level keys DeepSpeedConfig looks up (recorded
    by handing it a dict that notes each lookup), and the fields of the pydantic models that parse the
    sections (with their JSON aliases, nested models too)."""
    import inspect
    import os
    import typing
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    from pydantic import BaseModel
    from deepspeed.comm.config import CommsLoggerConfig
    from deepspeed.monitor.config import CSVConfig, TensorBoardConfig
    from deepspeed.runtime.activation_checkpointing.config import ACT_CHKPT_DEFAULT
    from deepspeed.runtime.config import DeepSpeedConfig
    from deepspeed.runtime.precision_config import DeepSpeedBF16Config, DeepSpeedFP16Config
    from deepspeed.runtime.zero.config import DeepSpeedZeroConfig
    from deepspeed.profiling import constants as fp
    seen = set()

    class Keys:                                 # param_dict.keys(): `KEY in param_dict.keys()` is a lookup too
        def __init__(self, d):
            self.d = d

        def __contains__(self, k):
            seen.add(k)
            return dict.__contains__(self.d, k)

        def __iter__(self):
            return iter(dict.keys(self.d))

    class Recording(dict):
        def get(self, k, d=None):
            seen.add(k)
            return super().get(k, d)

        def __getitem__(self, k):
            seen.add(k)
            return super().__getitem__(k)

        def __contains__(self, k):
            seen.add(k)
            return super().__contains__(k)

        def keys(self):
            return Keys(self)
    DeepSpeedConfig(Recording(BASE))

    def fields(model, pre):
        out = set()
        for name, f in model.model_fields.items():
            key = pre + (f.alias or name)
            out.add(key)
            for t in (f.annotation, *typing.get_args(f.annotation)):
                if inspect.isclass(t) and issubclass(t, BaseModel):
                    out |= fields(t, key + ".")
        return out
    keys = set(seen)
    for sec, model in (("zero_optimization", DeepSpeedZeroConfig), ("fp16", DeepSpeedFP16Config),
                       ("bf16", DeepSpeedBF16Config), ("tensorboard", TensorBoardConfig),
                       ("csv_monitor", CSVConfig), ("comms_logger", CommsLoggerConfig)):
        keys |= fields(model, sec + ".")
    keys |= {f"activation_checkpointing.{k}" for k in ACT_CHKPT_DEFAULT} | {"bfloat16.enabled"}
    keys |= {"flops_profiler." + v for k, v in vars(fp).items() if k.startswith("FLOPS_PROFILER_") and
             isinstance(v, str) and v.isidentifier() and not k.endswith("_DEFAULT") and v != "flops_profiler"}
    keys |= {"optimizer.type", "optimizer.params", "optimizer.legacy_fusion", "scheduler.type", "scheduler.params",
             "checkpoint.tag_validation", "checkpoint.load_universal", "checkpoint.use_node_local_storage",
             "checkpoint.parallel_write", "checkpoint.checkpoint_serialization", "checkpoint.writer",
             "optimizer", "scheduler", "activation_checkpointing", "flops_profiler", "autotuning", "aio"}
    return keys


def _tables():
    import importlib
    out = {}
    for engine, mod in ENGINES.items():
        try:
            out[engine] = importlib.import_module(mod).KEY_STATUS
        except (ImportError, AttributeError):
            continue                            # that engine has no table yet: nothing to check
    return out


@pytest.mark.deepspeed
def test_every_deepspeed_key_is_honoured_refused_or_warned():
    pytest.importorskip("deepspeed")
    from zero_from_scratch.engine.key_status import status
    universe = deepspeed_keys()
    assert len(universe) > 150 and "zero_optimization.stage3_prefetch_bucket_size" in universe
    for engine, table in _tables().items():
        missing = sorted(k for k in universe if status(table, k) is None)
        assert not missing, f"{engine}: DeepSpeed accepts these keys and KEY_STATUS says nothing: {missing}"
        bad = sorted(k for k, v in table.items() if not v.startswith(("honoured", "refused", "warned")))
        assert not bad, f"{engine}: statuses must start honoured/refused/warned: {bad}"


def test_zero_refuses_and_warns_what_its_table_says():
    from zero_from_scratch.engine.key_status import R, W
    from zero_from_scratch.engine.zero_keys import KEY_STATUS
    checked = 0
    for key, st in KEY_STATUS.items():
        if not st.startswith((R, W)):
            continue                            # "… when …" entries are checked where the value is read
        raw = dict(BASE)
        d, *path = key.split(".")[::-1]
        cfg = {d: True}
        for k in path:
            cfg = {k: cfg}
        raw.update(cfg)
        if st.startswith(R):
            with pytest.raises(ValueError, match=f"config key '{key}' = True is refused"):
                load_config(raw, world_size=1)
        else:
            with pytest.warns(UserWarning, match=f"{key} = True"):
                load_config(raw, world_size=1)
        checked += 1
    assert checked > 60


def _instruments(rank, world):
    import zero_from_scratch
    from primitives.log import console
    from zero_from_scratch.engine.models import TinyMLP
    torch.manual_seed(0)
    model = TinyMLP()
    cfg = {"train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 2, "steps_per_print": 1,
           "wall_clock_breakdown": True, "comms_logger": {"enabled": True}, "zero_optimization": {"stage": 2},
           "dump_state": True}
    with console.capture() as cap:
        engine, *_ = zero_from_scratch.initialize(model=model, config=cfg)
        for _ in range(2 * 2):
            x = torch.randn(4, 13)
            loss = engine(x, torch.randint(0, 3, (4,))).loss
            engine.backward(loss)
            engine.step()
    return cap.get(), engine.wall_clock, engine.comms_log


def test_instruments_print_as_deepspeed_and_agree_with_the_ledger(spawn):
    # reference: the engine's ledger (primitives' measured bytes sent) and nccl-tests' bus-bandwidth factors
    text, clock, log = spawn(_instruments, 2)[0]
    assert "step=1, skipped=0, lr=[0.001], mom=[[0.9, 0.999]]" in text and "step=2, skipped=0" in text
    assert "DeepSpeedEngine:\n" in text and "  global_steps ................. 0\n" in text   # dump_state
    assert text.count("time (ms) | fwd: ") == 2 and "bwd_allreduce: " in text and "Comm. Op" in text
    assert len(clock) == 2
    for row in clock:
        assert row["fwd"] > 0 and row["step"] > 0 and 0 < row["bwd_allreduce"] <= row["bwd"]
        assert abs(row["bwd_inner"] + row["bwd_allreduce"] - row["bwd"]) < 1e-9
    by = {r["collective"]: r for r in log}
    assert {"reduce_scatter", "all_gather", "all_reduce"} <= set(by), sorted(by)
    for r in log:
        t = r["total_ms"] / 1e3
        assert r["sent"] == r["formula"]                       # the ledger's measured bytes = the ring formula
        bus_bytes = r["busbw_gbps"] * 1e9 / 8 * t               # busbw · t = bytes one ring rank sends
        assert bus_bytes == pytest.approx(r["sent"], rel=1e-9), r
        assert r["algbw_gbps"] * 1e9 / 8 * t == pytest.approx(r["bytes"], rel=1e-9)


def _flops(rank, world, out_file):
    import zero_from_scratch
    from primitives.log import console
    from zero_from_scratch.engine.models import TinyMLP
    torch.manual_seed(0)
    model = TinyMLP()
    cfg = {"train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 1, "zero_optimization": {"stage": 3},
           "flops_profiler": {"enabled": True, "profile_step": 1, "output_file": out_file}}
    engine, *_ = zero_from_scratch.initialize(model=model, config=cfg)
    with console.capture() as cap:
        for _ in range(3):
            engine.backward(engine(torch.randn(4, 13), torch.randint(0, 3, (4,))).loss)
            engine.step()
    return cap.get(), engine.flops_profile


@pytest.mark.deepspeed
def test_flops_profiler_matches_deepspeeds_module_counts(spawn, tmp_path):
    # reference: DeepSpeed's own FlopsProfiler on the same model and micro-batch shape (one process)
    pytest.importorskip("deepspeed")
    import os
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    from deepspeed.profiling.flops_profiler.profiler import FlopsProfiler, get_module_flops, get_module_macs
    from zero_from_scratch.engine.models import TinyMLP
    out = str(tmp_path / "flops.txt")
    (text, rows), none = spawn(_flops, 2, args=(out,))
    assert none[1] is None                                     # rank 0 profiles, as DeepSpeed
    assert "Profile Summary at step 1:" in text and open(out).read().strip() == text.strip()
    model = TinyMLP()
    prof = FlopsProfiler(model)
    prof.start_profile()
    model(torch.randn(4, 13), torch.randint(0, 3, (4,)))
    for name in ("fc1", "norm", "fc2"):
        m = dict(model.named_modules())[name]
        assert (rows[name]["flops"], rows[name]["macs"]) == (get_module_flops(m), get_module_macs(m)), name
        assert rows[name]["params"] == sum(p.numel() for p in m.parameters())
    prof.end_profile()
    assert rows["fc1"]["flops"] == 2 * 4 * 13 * 37 and rows[""]["flops"] == sum(rows[n]["flops"] for n in ("fc1", "norm", "fc2"))


def test_steps_per_print_inf_is_accelerates_never():
    """accelerate writes steps_per_print = inf to keep DeepSpeed quiet: accepted, and never due."""
    from zero_from_scratch.engine.wall_clock import parse
    base = {"train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 1}
    cfg = load_config({**base, "steps_per_print": float("inf")}, world_size=1)
    spp = cfg.instruments["steps_per_print"]
    assert spp == float("inf") and all(step % spp != 0 for step in (1, 10, 10**6))
    for bad in (0, -1, 1.5, True, "10"):
        with pytest.raises(ValueError, match="steps_per_print"):
            parse({"steps_per_print": bad})


def test_ddp_engine_refuses_what_it_cannot_do_and_warns_what_it_ignores():
    from classification.ddp_keys import check
    base = {"train_batch_size": 4, "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}}}
    check(base)                                                  # the plain case: silent
    for extra, words in (({"prescale_gradients": True}, "prescale_gradients"),
                         ({"optimizer": {"type": "SGD", "params": {"lr": 0.1}}}, "optimizer.type"),
                         ({"scheduler": {"type": "OneCycle", "params": {}}}, "scheduler.type"),
                         ({"optimizer": {"type": "Adam", "params": {"lr": 1e-3, "bias_correction": False}}},
                          "bias_correction")):
        with pytest.raises(ValueError, match=words):
            check({**base, **extra})
    with pytest.warns(UserWarning, match=r"zero_optimization.*without ZeRO.*steps_per_print"):
        check({**base, "zero_optimization": {"stage": 2}, "steps_per_print": 10})
