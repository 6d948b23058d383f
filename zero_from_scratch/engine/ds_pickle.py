"""DeepSpeed's pickled classes, both ways, without importing DeepSpeed: the one reader and writer of its files.

    from zero_from_scratch.engine.ds_pickle import DS_PICKLE, load_file
    sd = load_file("ckpt/global_step3/zero_pp_rank_0_mp_rank_00_optim_states.pt")   # DeepSpeed's or ours
    torch.save(sd, "copy.pt", pickle_module=DS_PICKLE)        # its DeepSpeed classes written back by name

DeepSpeed's checkpoint files pickle a few of its own objects (the loss scaler, fragment_address dataclasses,
the ZeroStageEnum). Reading them with torch.load would import the deepspeed package (which the runner's finder
refuses once it serves `deepspeed`), so every `deepspeed.*` class reads as a stand-in: an attribute bag whose
class keeps DeepSpeed's dotted name in `_deepspeed_name` (ZeroStageEnum, an IntEnum, as an int), and writing
one back (or a writer-side object that names its DeepSpeed class the same way: checkpoint_ds's loss scaler,
checkpoint_universal_layout's FragmentAddress) puts that name in the pickle, as DeepSpeed would have.
Cost: one class per DeepSpeed name, made on first sight.
"""
from __future__ import annotations

import pickle
import types

import torch


class _Kept:
    """A pickled DeepSpeed object read without DeepSpeed: its attributes (set by unpickling), and its class's
    dotted name kept in _deepspeed_name so that DS_PICKLE writes the same class back."""

    def __init__(self, *args, **kwargs):
        self.args = args


_KEPT: dict = {}


def _kept_class(module: str, name: str) -> type:
    """ZeroStageEnum (an IntEnum) stays an int, pickled back as DeepSpeed's enum; any other class a _Kept."""
    key = (module, name)
    if key not in _KEPT:
        _KEPT[key] = type(name, (int,) if name == "ZeroStageEnum" else (_Kept,), {"_deepspeed_name": key})
    return _KEPT[key]


class _Unpickler(pickle.Unpickler):
    def find_class(self, module, name):
        if module.split(".")[0] == "deepspeed":
            return _kept_class(module, name)
        return super().find_class(module, name)


class _Pickler(pickle._Pickler):
    """torch.save's pickler, naming a class that carries _deepspeed_name by DeepSpeed's path (written as is,
    not imported)."""

    def save_global(self, obj, name=None):
        target = getattr(obj, "__dict__", {}).get("_deepspeed_name")
        if target is None:
            return super().save_global(obj, name)
        self.write(pickle.GLOBAL + f"{target[0]}\n{target[1]}\n".encode())
        self.memoize(obj)


_READ = types.SimpleNamespace(Unpickler=_Unpickler, load=pickle.load, __name__="pickle")
DS_PICKLE = types.SimpleNamespace(Pickler=_Pickler, __name__="pickle")


def load_file(path: str):
    """torch.load of a DeepSpeed (or ringzero-written DeepSpeed-layout) file, on the CPU, DeepSpeed's objects
    as stand-ins."""
    return torch.load(path, map_location="cpu", weights_only=False, pickle_module=_READ)
