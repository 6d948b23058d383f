"""Three training engines behind one interface, so classification/train.py has one loop.

    deepspeed  deepspeed.initialize(model, model_parameters, config)        (real DeepSpeed)
    zero       zero_from_scratch.initialize(...) - the same API and JSON     (this toolkit's ZeRO)
    ddp        ddp_examples.BucketedDataParallel + torch AdamW + the JSON's LR schedule

Each returns an object with engine(**batch), engine.backward(loss), engine.step(), engine.module,
engine.get_lr(), engine.save(dir, tag, client_state) / engine.load(dir, tag) -> client_state,
engine.full_parameters(modify=False) (a context with every parameter whole under ZeRO-3, entered by
all ranks; modify=True writes rank 0's edits back into every shard) and engine.describe() -> rows
for the configuration table. deepspeed is imported only by --engine deepspeed, so the other
two work without it. Cost per step: deepspeed / zero ZeRO-2 send reduce-scatter +
all-gather = 2(N-1)/N x 4 bytes x params per rank; ddp the same as one ring all-reduce.
"""
from __future__ import annotations

import contextlib
import os

import torch

import zero_from_scratch
from classification.config import lr_at
from classification.ddp_keys import check as check_ddp_keys
from ddp_examples.engine.wrappers import BucketedDataParallel
from zero_from_scratch.engine.atomic import atomic_write
from zero_from_scratch.engine.auto import DEFAULTS, weight_decay_default
from zero_from_scratch.engine.mpu import clip_grad_norm_, mp_prefix
from zero_from_scratch.engine.real_deepspeed import skip_shm_op_build

ENGINES = ("deepspeed", "zero", "ddp")


class EngineError(RuntimeError):
    """An engine that cannot be built here; the message says what is missing."""


def _disable_deepspeed_shm_build():
    """DeepSpeed's TorchBackend JIT-builds `deepspeed_shm_comm` (~2 min of g++ on first use) whenever
    its compatibility probe says it can. That op serves only `inference_all_reduce` (AutoTP inference);
    ZeRO training never calls it. deepspeed.ops caches the probe in a module dict that is meant to be
    edited, so marking the op incompatible skips the build. RINGZERO_DS_SHM=1 keeps DeepSpeed's
    behaviour."""
    if os.environ.get("RINGZERO_DS_SHM") == "1":
        return
    skip_shm_op_build()


def train_device() -> torch.device:
    """This rank's device: its CUDA GPU under nccl (LOCAL_RANK), else the CPU (gloo / MPI ranks
    exchange CPU tensors)."""
    nccl = torch.distributed.is_initialized() and torch.distributed.get_backend() == "nccl"
    if torch.cuda.is_available() and (nccl or not torch.distributed.is_initialized()):
        return torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
    return torch.device("cpu")


def to_device(batch: dict, device: torch.device) -> dict:
    return {k: v.to(device, non_blocking=True) if isinstance(v, torch.Tensor) else v for k, v in batch.items()}


class _Native:
    """deepspeed and zero_from_scratch engines already have the interface; add save/load/describe."""

    def __init__(self, engine, kind, device):
        self.engine, self.kind, self.device = engine, kind, device

    def __call__(self, **batch):
        return self.engine(**to_device(batch, self.device))

    def backward(self, loss):
        self.engine.backward(loss)

    def step(self):
        self.engine.step()

    @property
    def module(self):
        return self.engine.module

    def train(self):
        self.engine.train()

    def eval(self):
        self.engine.eval()

    def get_lr(self) -> float:
        return float(self.engine.get_lr()[0])

    def save(self, path, tag, client_state):
        # one key of our own: DeepSpeed returns its metadata mixed into client_state on load
        self.engine.save_checkpoint(path, tag=tag, client_state={"ringzero": client_state})

    def load(self, path, tag):
        _, client = self.engine.load_checkpoint(path, tag=tag)
        if client is None or "ringzero" not in client:
            raise EngineError(f"no {self.kind} checkpoint with tag {tag!r} under {path}")
        return client["ringzero"]

    def full_parameters(self, modify: bool = False):
        """ZeRO-3 keeps 1/N of each parameter per rank (size-0 tensors outside forward): gather them
        for save_pretrained / load_state_dict. Every rank must enter; a no-op below stage 3."""
        if _call(self.engine, "zero_optimization_stage") != 3:
            return contextlib.nullcontext()
        params, rank = list(self.engine.module.parameters()), 0 if modify else None
        if self.kind == "deepspeed":
            import deepspeed   # optional dependency: --engine deepspeed only
            return deepspeed.zero.GatheredParameters(params, modifier_rank=rank)
        return self.engine.gathered_parameters(params, modifier_rank=rank)

    def describe(self):
        e = self.engine
        opt = getattr(e, "optimizer", None)
        inner = getattr(opt, "optimizer", opt)  # ZeRO wraps the basic optimizer
        dev = "cpu"
        for g in getattr(inner, "param_groups", []):
            for p in g.get("params", []) if isinstance(g, dict) else []:
                dev = str(p.device)
                break
            break
        prec = "bf16" if _flag(e, "bfloat16_enabled", "bf16_enabled") else "fp16" if _flag(e, "fp16_enabled") else "fp32"
        return [("engine", self.kind, type(e).__module__ + "." + type(e).__name__, ""),
                ("optimizer (as built)", "", f"{type(opt).__name__} over {type(inner).__module__}.{type(inner).__name__}",
                 f"master weights and states on {dev}"),
                ("precision (as built)", "", prec, ""),
                ("global batch (as built)", "", str(_call(e, "train_batch_size")), "micro x accumulation x world"),
                ("ZeRO stage (as built)", "", str(_call(e, "zero_optimization_stage")), ""),
                ("gradient clipping (as built)", "", str(_call(e, "gradient_clipping")), "")]


def _flag(obj, *names) -> bool:
    """True only when one of the accessors exists and returns True: DeepSpeed 0.19.8 names it
    bfloat16_enabled, ours bf16_enabled; a missing accessor is not a yes."""
    for n in names:
        f = getattr(obj, n, None)
        if callable(f):
            try:
                return f() is True
            except Exception:  # describing must never stop training
                return False
    return False


def _call(obj, name):
    f = getattr(obj, name, None)
    try:
        v = f() if callable(f) else f
    except Exception:  # describing must never stop training
        v = None
    return "(not reported)" if v is None else v


class _DDP:
    """BucketedDataParallel + torch.optim.AdamW + LambdaLR(lr_at): DeepSpeed's semantics by hand
    (loss / accumulation steps, clip on the global norm, scheduler stepped after each update)."""

    def __init__(self, model, cfg, comm, mpu=None):
        check_ddp_keys(cfg)   # every DeepSpeed key: acted on, refused or warned (ddp_keys.py)
        for prec in ("fp16", "bf16"):
            if cfg.get(prec, {}).get("enabled"):
                raise EngineError(f"--engine ddp trains in fp32; set {prec}.enabled to false in the config")
        self.cfg, self.comm, self.device = cfg, comm, next(model.parameters()).device
        # --tp: average over the data-parallel group; the norm also sums over the tp group
        self.dp_rank = (mpu.get_data_parallel_rank() if mpu else comm.rank if comm is not None
                        else torch.distributed.get_rank() if torch.distributed.is_initialized() else 0)
        self.mp = (mpu.get_model_parallel_group(), mpu.get_model_parallel_rank(),
                   mpu.get_model_parallel_world_size()) if mpu and mpu.get_model_parallel_world_size() > 1 else None
        self.ddp = BucketedDataParallel(model, group=mpu.get_data_parallel_group() if mpu else None)
        o = cfg["optimizer"]
        if o.get("type", "").lower() not in ("adam", "adamw"):
            raise EngineError(f"--engine ddp supports optimizer Adam/AdamW, not {o.get('type')!r}")
        p = {k: v for k, v in o["params"].items() if k in ("lr", "betas", "eps", "weight_decay")}
        p.setdefault("weight_decay", weight_decay_default(o))  # DeepSpeed's default, not torch AdamW's own
        adamw = o["type"].lower() == "adamw" or o["params"].get("adam_w_mode", True)
        self.optimizer = (torch.optim.AdamW if adamw else torch.optim.Adam)(model.parameters(), **p)
        base = p["lr"]
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(self.optimizer, lambda s: lr_at(cfg, s) / base)
        self.gas = cfg.get("gradient_accumulation_steps", 1)
        self.clip = cfg.get("gradient_clipping", DEFAULTS["gradient_clipping"][0])  # absent: DeepSpeed clips at 1.0
        self.micro = 0

    def __call__(self, **batch):
        batch = to_device(batch, self.device)
        if (self.micro + 1) % self.gas:  # not the last micro-batch: keep gradients local
            with self.ddp.no_sync():
                return self.ddp(**batch)
        return self.ddp(**batch)

    def backward(self, loss):
        if (self.micro + 1) % self.gas:
            with self.ddp.no_sync():
                (loss / self.gas).backward()
        else:
            (loss / self.gas).backward()

    def step(self):
        self.micro += 1
        if self.micro % self.gas:
            return
        if self.clip and self.mp:  # tensor parallel: shards sum over tp, replicated params count once
            self.last_norm = clip_grad_norm_(list(self.module.parameters()), self.clip, self.mp[0], self.mp[1])
        elif self.clip:  # gradients are averaged over ranks already, so this norm is the global one
            self.last_norm = float(torch.nn.utils.clip_grad_norm_(self.module.parameters(), self.clip))
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=False)  # BucketedDataParallel keeps .grad as bucket views
        self.scheduler.step()

    @property
    def module(self):
        return getattr(self.ddp, "module", self.ddp)

    def train(self):
        self.ddp.train()

    def eval(self):
        self.ddp.eval()

    def get_lr(self):
        return float(self.optimizer.param_groups[0]["lr"])

    def full_parameters(self, modify: bool = False):
        return contextlib.nullcontext()  # every rank holds every parameter

    def _file(self, path, tag):  # one file per tensor-parallel rank, like DeepSpeed's mp_rank_XX
        return os.path.join(path, tag, f"{mp_prefix(self.mp[1], self.mp[2]) if self.mp else ''}ddp_state.pt")

    def save(self, path, tag, client_state):
        os.makedirs(os.path.join(path, tag), exist_ok=True)
        if self.dp_rank == 0:  # every rank of a dp group holds the same state in DDP
            state = {"model": self.module.state_dict(), "optimizer": self.optimizer.state_dict(),
                     "scheduler": self.scheduler.state_dict(), "micro": self.micro, "client": client_state}
            atomic_write(self._file(path, tag), lambda f: torch.save(state, f))
        torch.distributed.barrier()

    def load(self, path, tag):
        f = self._file(path, tag)
        if not os.path.isfile(f):
            raise EngineError(f"no ddp checkpoint {f}")
        s = torch.load(f, map_location="cpu", weights_only=False)
        self.module.load_state_dict(s["model"])
        self.optimizer.load_state_dict(s["optimizer"])
        self.scheduler.load_state_dict(s["scheduler"])
        self.micro = s["micro"]
        return s["client"]

    def describe(self):
        return [("engine", "ddp", f"{type(self.ddp).__module__}.{type(self.ddp).__name__}", "gradients averaged in backward"),
                ("optimizer (as built)", "", f"{type(self.optimizer).__module__}.{type(self.optimizer).__name__}",
                 "full states on every rank (no sharding)"),
                ("precision (as built)", "", "fp32", ""),
                ("gradient clipping (as built)", "", str(self.clip), "")]


def build(kind: str, model, cfg: dict, comm=None, mpu=None):
    """The engine `kind` around `model`, configured by the resolved DeepSpeed dict `cfg`. The model
    moves to train_device() first (DeepSpeed would move it anyway; ours keep it where it is), and
    every engine moves each batch there. mpu (DeepSpeed's protocol, primitives.mesh.Mesh.mpu()):
    a tensor-parallel model; the engine then works over its data-parallel group."""
    device = train_device()
    model = model.to(device)
    params = [p for p in model.parameters() if p.requires_grad]
    if kind == "deepspeed":
        try:
            import deepspeed   # optional dependency: the `deepspeed` extra
        except ImportError:
            raise EngineError("--engine deepspeed needs `pip install deepspeed` (or `pip install -e .[deepspeed]`); "
                              "--engine zero and --engine ddp do not") from None
        _disable_deepspeed_shm_build()
        # plain `python train.py` is a world of one that init_from_env already set up; DeepSpeed
        # still insists on the launcher's LOCAL_RANK
        os.environ.setdefault("LOCAL_RANK", "0")
        engine, *_ = deepspeed.initialize(model=model, model_parameters=params, config=cfg, mpu=mpu)
        return _Native(engine, kind, device)
    if kind == "zero":
        engine, _opt, _, sched = zero_from_scratch.initialize(model=model, model_parameters=params, config=cfg, mpu=mpu)
        if cfg.get("scheduler") and sched is None:
            raise EngineError(f"zero_from_scratch.initialize built no scheduler for {cfg['scheduler']['type']}")
        return _Native(engine, kind, device)
    if kind == "ddp":
        return _DDP(model, cfg, comm, mpu)
    raise EngineError(f"--engine {kind!r}: expected one of {ENGINES}")
