"""Which DeepSpeed calls a client script makes, on either side: `CLIENT_TRACE=1` on clients/run.py.

    CLIENT_TRACE=1 torchrun --nproc_per_node 2 clients/run.py ringzero recipes/hf_trainer.py --stage 3 --steps 2
    CLIENT_TRACE=1 torchrun --nproc_per_node 2 clients/run.py deepspeed recipes/hf_trainer.py --stage 3 --steps 2

`install(deepspeed)` wraps the module-level entry points in ENTRY (`deepspeed.initialize`, ...) of
whatever `deepspeed` resolves to (the installed package or ringzero's), and every public method of
the engine `initialize` returns (its class's own methods, plus forward/train/eval). A call is counted
only when it comes from outside the engine: not while another counted call runs, and not from code of
either engine (ENGINE_PACKAGES): the engine's calls to itself (step() asking
is_gradient_accumulation_boundary(), its forward hooks on the client's module, ...) are its own business. Each call is
recorded as its name and argument shape (`_` per positional argument, keyword names, and the value
of a bool/int/None keyword, which is what tells `is_boundary=True` from `is_boundary=False`). At exit
rank 0 prints a rich table: the calls in first-call order, how many times.
Cost: one dict update per counted call.
"""
from __future__ import annotations

import atexit
import functools
import inspect
import os
import sys
import threading

import torch
from rich.console import Console
from rich.table import Table

ENTRY = ("initialize", "init_distributed", "zero.Init", "zero.GatheredParameters")
MODULE_METHODS = ("forward", "train", "eval")   # nn.Module's own methods that a client calls on an engine
# code of either engine: a call from there is the engine's own, e.g. the forward hooks DeepSpeed puts on the
# client's module (they call engine methods when the Trainer runs the bare model in predict())
ENGINE_PACKAGES = {"deepspeed", "zero_from_scratch", "pipeline_parallel", "tensor_parallel", "primitives"}

_counts: dict[str, int] = {}
_depth = threading.local()


def _shape(args, kwargs) -> str:
    def show(k, v):
        return f"{k}={v!r}" if isinstance(v, (bool, int, type(None))) else f"{k}="
    return ", ".join(["_"] * len(args) + [show(k, v) for k, v in kwargs.items()])


def _counted(name: str, fn):
    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        caller = sys._getframe(1).f_globals.get("__name__", "")
        outer = getattr(_depth, "n", 0) == 0 and caller.split(".")[0] not in ENGINE_PACKAGES
        if outer:
            key = f"{name}({_shape(args, kwargs)})"
            _counts[key] = _counts.get(key, 0) + 1
        _depth.n = getattr(_depth, "n", 0) + 1
        try:
            return fn(*args, **kwargs)
        finally:
            _depth.n -= 1
    return wrapper


def _engine_methods(engine) -> list[str]:
    own = [n for n in dir(type(engine)) if not n.startswith("_") and not hasattr(torch.nn.Module, n)
           and inspect.isfunction(inspect.getattr_static(type(engine), n))]
    return own + list(MODULE_METHODS)


def _wrap_engine(engine) -> None:
    for n in _engine_methods(engine):
        setattr(engine, n, _counted(f"engine.{n}", getattr(engine, n)))   # instance attributes: isinstance unchanged


def _wrap_initialize(fn):
    @functools.wraps(fn)
    def initialize(*args, **kwargs):
        key = f"deepspeed.initialize({_shape(args, kwargs)})"
        _counts[key] = _counts.get(key, 0) + 1
        out = fn(*args, **kwargs)
        _wrap_engine(out[0])
        return out
    return initialize


def install(deepspeed, report_at_exit: bool = True) -> None:
    """Wrap ENTRY on `deepspeed` and print the counts at exit (rank 0)."""
    for dotted in ENTRY:
        *path, last = dotted.split(".")
        owner = deepspeed
        for p in path:
            owner = getattr(owner, p)
        fn = getattr(owner, last)
        setattr(owner, last, _wrap_initialize(fn) if dotted == "initialize" else _counted(f"deepspeed.{dotted}", fn))
    if report_at_exit:
        atexit.register(report)


def report() -> None:
    if os.environ.get("RANK", "0") != "0":
        return
    t = Table(title="DeepSpeed calls the script made (rank 0, in first-call order)")
    t.add_column("call")
    t.add_column("times", justify="right")
    for k, n in _counts.items():
        t.add_row(k, str(n))
    Console(width=120).print(t)
