"""deepspeed.accelerator.get_accelerator(): the cpu or cuda accelerator, as DeepSpeed 0.19.8 answers.

    from deepspeed.accelerator import get_accelerator       (served by the runner)
    device = get_accelerator().device_name(local_rank)      # "cpu" on cpu, "cuda:1" on cuda

The kind follows DeepSpeed's own choice: DS_ACCELERATOR if set ("cpu" or "cuda"), else cuda when
torch sees a GPU, else cpu. The methods are those of deepspeed/accelerator/cpu_accelerator.py and
cuda_accelerator.py that real clients call (device names, set_device, seeds, synchronize,
memory, dtypes, the communication backend); on cpu memory is the process's resident set, as
DeepSpeed's psutil reading. Any other method raises NotServedAttributeError naming it.
deepspeed.utils.pin_memory_tracker (track_pinned_memory, pinned_memory_summary, _fmt_bytes, _tracker) is
here too: the running total of host memory pin_memory pinned, an INFO line on DeepSpeed's logger each
time it crosses 32 GB, 64 GB, ...; on cpu nothing is pinned and nothing is counted, as DeepSpeed's.
Cost: nothing; memory queries read /proc/self/statm.
"""
from __future__ import annotations

import contextlib
import functools
import logging
import os

import torch

from zero_from_scratch.as_deepspeed.finder import NotServedAttributeError, message

KINDS = ("cpu", "cuda")
logger = logging.getLogger("DeepSpeed")    # utils.py gives it DeepSpeed's handler and format


def _rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _numa_nodes_with_cores() -> int:
    """DeepSpeed's cpu device_count without LOCAL_SIZE: NUMA nodes that have cores (at least 1)."""
    base = "/sys/devices/system/node"
    try:
        nodes = [d for d in os.listdir(base) if d.startswith("node") and d[4:].isdigit()]
        lists = {open(os.path.join(base, d, "cpulist")).read().strip() for d in nodes}
    except OSError:
        return 1
    return max(1, len([c for c in lists if c]))


class Accelerator:
    """DeepSpeed's accelerator object for `kind` ("cpu" or "cuda")."""

    def __init__(self, kind: str):
        if kind not in KINDS:
            raise ValueError(f"DS_ACCELERATOR={kind!r}: ringzero serves {KINDS}")
        if kind == "cuda" and not torch.cuda.is_available():
            raise ValueError("DS_ACCELERATOR='cuda' but torch sees no CUDA device")
        self._name = kind
        self._communication_backend_name = "gloo" if kind == "cpu" else "nccl"
        self._max_rss = _rss() if kind == "cpu" else 0

    def __getattr__(self, attr):
        if attr.startswith("__"):
            raise AttributeError(attr)
        raise NotServedAttributeError(message(f"get_accelerator().{attr}", f"run the {self._name} accelerator's "
                                              f"{attr}()", "torch's own device API"))

    def __repr__(self):
        return f"<ringzero {self._name} accelerator (DeepSpeed's get_accelerator())>"

    def is_synchronized_device(self) -> bool:
        return self._name == "cpu"

    def device_name(self, device_index=None) -> str:
        if self._name == "cpu" or device_index is None:
            return self._name
        return f"cuda:{device_index}"

    def device(self, device_index=None):
        return None if self._name == "cpu" else torch.device("cuda", device_index)

    def set_device(self, device_index) -> None:
        if self._name == "cuda":
            torch.cuda.set_device(device_index)

    def current_device(self):
        return os.environ.get("LOCAL_RANK", 0) if self._name == "cpu" else torch.cuda.current_device()

    def current_device_name(self) -> str:
        return "cpu" if self._name == "cpu" else f"cuda:{torch.cuda.current_device()}"

    def device_count(self) -> int:
        if self._name == "cuda":
            return torch.cuda.device_count()
        return int(os.environ.get("LOCAL_SIZE", 0)) or _numa_nodes_with_cores()

    def is_available(self) -> bool:
        return True if self._name == "cpu" else torch.cuda.is_available()

    def synchronize(self, device_index=None) -> None:
        if self._name == "cuda":
            torch.cuda.synchronize(device_index)

    def random(self):
        return torch.random

    def manual_seed(self, seed):
        return torch.manual_seed(seed) if self._name == "cpu" else torch.cuda.manual_seed(seed)

    def manual_seed_all(self, seed):
        return torch.manual_seed(seed) if self._name == "cpu" else torch.cuda.manual_seed_all(seed)

    def initial_seed(self):
        return torch.initial_seed() if self._name == "cpu" else torch.cuda.initial_seed()

    def get_rng_state(self, device_index=None):
        return torch.get_rng_state() if self._name == "cpu" else torch.cuda.get_rng_state(device_index or "cuda")

    def set_rng_state(self, new_state, device_index=None):
        if self._name == "cpu":
            return torch.set_rng_state(new_state)
        return torch.cuda.set_rng_state(new_state, device_index or "cuda")

    def empty_cache(self) -> None:
        if self._name == "cuda":
            torch.cuda.empty_cache()

    def stream(self, stream):
        return contextlib.nullcontext() if self._name == "cpu" else torch.cuda.stream(stream)

    def current_stream(self, device_index=None):
        return None if self._name == "cpu" else torch.cuda.current_stream(device_index)

    def memory_allocated(self, device_index=None) -> int:
        if self._name == "cuda":
            return torch.cuda.memory_allocated(device_index)
        self._max_rss = max(self._max_rss, _rss())
        return _rss()

    def max_memory_allocated(self, device_index=None) -> int:
        if self._name == "cuda":
            return torch.cuda.max_memory_allocated(device_index)
        self.memory_allocated()
        return self._max_rss

    def memory_reserved(self, device_index=None) -> int:
        return torch.cuda.memory_reserved(device_index) if self._name == "cuda" else self.memory_allocated()

    def max_memory_reserved(self, device_index=None) -> int:
        return torch.cuda.max_memory_reserved(device_index) if self._name == "cuda" else self.max_memory_allocated()

    def reset_peak_memory_stats(self, device_index=None) -> None:
        if self._name == "cuda":
            torch.cuda.reset_peak_memory_stats(device_index)

    def total_memory(self, device_index=None) -> int:
        if self._name == "cuda":
            return torch.cuda.get_device_properties(device_index or 0).total_memory
        return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")

    def communication_backend_name(self) -> str:
        return self._communication_backend_name

    def is_bf16_supported(self) -> bool:
        return True if self._name == "cpu" else torch.cuda.is_bf16_supported()

    def is_fp16_supported(self) -> bool:
        if self._name == "cuda":
            return True
        try:
            return bool(torch.ops.mkldnn._is_mkldnn_fp16_supported())
        except Exception:   # DeepSpeed's cpu accelerator answers False when the probe itself fails
            return False

    def supported_dtypes(self) -> list:
        return [torch.float, torch.bfloat16] + ([torch.float16] if self.is_fp16_supported() else [])

    @property
    def FloatTensor(self):     # DeepSpeed's: a tensor constructor on the accelerator (cuda: the current device)
        return torch.FloatTensor if self._name == "cpu" else functools.partial(torch.tensor, dtype=torch.float,
                                                                                device="cuda")

    @property
    def ByteTensor(self):
        return torch.ByteTensor if self._name == "cpu" else functools.partial(torch.tensor, dtype=torch.uint8,
                                                                               device="cuda")

    @property
    def Stream(self):
        return None if self._name == "cpu" else torch.cuda.Stream

    def pin_memory(self, tensor, make_copy=True, match_shape=True):
        """DeepSpeed's (abstract_accelerator.py): a pinned copy of tensor, or with make_copy=False a fresh
        pinned buffer of its dtype (tensor is only a template), its shape or flat (numel,) with
        match_shape=False. On cpu torch cannot pin: tensor itself, nothing tracked, as DeepSpeed's."""
        if self._name == "cpu":
            return tensor
        if make_copy:
            track_pinned_memory(tensor.nbytes)
            return self._torch_pin_memory(tensor)
        shape = tensor.shape if match_shape else (tensor.numel(),)
        track_pinned_memory(tensor.numel() * tensor.element_size())
        return self._torch_empty_pinned(tensor, shape)

    def _torch_pin_memory(self, tensor):
        return tensor.pin_memory()

    def _torch_empty_pinned(self, tensor, shape):
        return tensor.new_empty(shape, pin_memory=True)

    def is_pinned(self, tensor) -> bool:
        return tensor.is_pinned()

    def on_accelerator(self, tensor) -> bool:
        return tensor.device.type == self._name

    def lazy_call(self, callback):
        return callback()


_ACCELERATOR: Accelerator | None = None


def is_current_accelerator_supported() -> bool:
    """DeepSpeed's check that the accelerator is one it knows: cpu and cuda both are."""
    return get_accelerator().device_name() in ("cpu", "cuda")


def get_accelerator() -> Accelerator:
    global _ACCELERATOR
    if _ACCELERATOR is None:
        kind = os.environ.get("DS_ACCELERATOR") or ("cuda" if torch.cuda.is_available() else "cpu")
        _ACCELERATOR = Accelerator(kind)
    return _ACCELERATOR


# ----------------------------------------------------------------------------- deepspeed.utils.pin_memory_tracker
_GB, _CHECKPOINT_BASE_GB = 1024**3, 32


def _fmt_bytes(num_bytes: int) -> str:
    for unit, size, fmt in (("GB", _GB, ".3f"), ("MB", 1024**2, ".2f"), ("KB", 1024, ".1f")):
        if num_bytes >= size:
            return f"{num_bytes / size:{fmt}} {unit}"
    return f"{num_bytes} B"


class _PinnedMemoryTracker:
    """The process's total of pinned host memory; an INFO line at each power-of-two multiple of 32 GB
    (logarithmically many lines), as DeepSpeed's."""

    def __init__(self):
        self.reset()

    def reset(self) -> None:
        self._bytes, self._calls, self._next_checkpoint = 0, 0, _CHECKPOINT_BASE_GB * _GB

    def track(self, num_bytes: int) -> None:
        self._bytes += num_bytes
        self._calls += 1
        logger.debug(f"pin_memory: +{_fmt_bytes(num_bytes)} (call #{self._calls}, running total: "
                     f"{_fmt_bytes(self._bytes)})")
        while self._bytes >= self._next_checkpoint:
            logger.info(f"[pinned-memory checkpoint] crossed {_fmt_bytes(self._next_checkpoint)}: "
                        f"{_fmt_bytes(self._bytes)} pinned across {self._calls} allocations")
            self._next_checkpoint *= 2

    def log_summary(self, tag: str = "") -> None:
        prefix = f"[pinned-memory {tag}] " if tag else "[pinned-memory] "
        logger.info(f"{prefix}{_fmt_bytes(self._bytes)} pinned across {self._calls} allocations")


_tracker = _PinnedMemoryTracker()


def track_pinned_memory(num_bytes: int) -> None:
    _tracker.track(num_bytes)


def pinned_memory_summary(tag: str = "") -> None:
    _tracker.log_summary(tag)
