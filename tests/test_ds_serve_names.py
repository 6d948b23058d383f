"""Small DeepSpeed names the runner serves, each against DeepSpeed 0.19.8's own object in this process.

    python -m pytest -q tests/test_ds_serve_names.py

Pure functions (expert-parallel rank lists, byte formats, log levels, the checkpoint's parallel
degrees, the checkpoint constants, IPGBucket) are compared over grids of inputs with the installed
DeepSpeed's; what needs the runner (the logger's level, the pin-memory tracker on CPU, stage_1_and_2's
`dist`, a refused class's instance) runs under the `served_ds` fixture, DeepSpeed's values cited.
"""
import dataclasses
import logging
from types import SimpleNamespace

import pytest
import torch

from tests.test_as_deepspeed_names import served_ds  # noqa: F401  (the fixture)
from zero_from_scratch.as_deepspeed import accelerator, constants, finder, more_layout, utils
from zero_from_scratch.engine.mpu import checkpoint_parallel_metadata

pytest.importorskip("deepspeed")


def _outcome(f, *args):
    try:
        return f(*args)
    except (AssertionError, ValueError) as e:
        return type(e).__name__, str(e)


def test_pure_helpers_equal_deepspeeds():
    from deepspeed.checkpoint import constants as theirs_constants
    from deepspeed.runtime.engine import _checkpoint_parallel_metadata
    from deepspeed.runtime.zero.stage_1_and_2 import IPGBucket
    from deepspeed.utils.groups import _get_expert_parallel_ranks
    from deepspeed.utils.logging import get_log_level_from_string
    from deepspeed.utils.pin_memory_tracker import _fmt_bytes
    grid = [(w, tp, ep, pp, d) for w in (1, 2, 4, 6, 8, 16) for tp in (1, 2, 3) for ep in (1, 2, 4)
            for pp in (1, 2) for d in (False, True)]
    assert [_outcome(utils._get_expert_parallel_ranks, *a) for a in grid] == \
        [_outcome(_get_expert_parallel_ranks, *a) for a in grid]
    sizes = [0, 1, 1023, 1024, 2047, 2**20 - 1, 2**20, 3 * 2**20 + 5, 2**30 - 1, 2**30, 7 * 2**30 + 3]
    assert [accelerator._fmt_bytes(b) for b in sizes] == [_fmt_bytes(b) for b in sizes]
    levels = ["debug", "INFO", "Warning", "error", "critical", "verbose"]
    assert [_outcome(utils.get_log_level_from_string, s) for s in levels] == \
        [_outcome(get_log_level_from_string, s) for s in levels]
    mpus = [None, SimpleNamespace(get_pipe_parallel_world_size=lambda: 2, get_slice_parallel_world_size=lambda: 3),
            SimpleNamespace(get_pipeline_model_parallel_world_size=lambda: 4,
                            get_tensor_model_parallel_world_size=lambda: 2, get_model_parallel_world_size=lambda: 8),
            SimpleNamespace(get_model_parallel_world_size=lambda: 2)]     # ringzero's mpu (engine/mpu.py)
    assert [checkpoint_parallel_metadata(m) for m in mpus] == [_checkpoint_parallel_metadata(m) for m in mpus]
    assert constants.CHECKPOINT_KEYS == {k: getattr(theirs_constants, k) for k in constants.CHECKPOINT_KEYS}
    fields = lambda c: [(f.name, f.default, f.default_factory) for f in dataclasses.fields(c)]  # noqa: E731
    assert fields(more_layout.IPGBucket) == fields(IPGBucket)
    ours, theirs = more_layout.IPGBucket(), IPGBucket()
    for b in (ours, theirs):
        b.params.append(1), b.copy_streams.add(2), b.reuse_events.update(a=3), b.ready_events.update(b=4)
        b.elements, b.index, b.has_moe_params = 5, 6, True
        b.clear()
    assert dataclasses.asdict(ours) == dataclasses.asdict(theirs)


def test_log_level_and_pin_tracker_under_the_runner(served_ds):
    from deepspeed.accelerator import get_accelerator
    from deepspeed.utils import logger, set_log_level_from_string
    from deepspeed.utils.pin_memory_tracker import _tracker, pinned_memory_summary, track_pinned_memory
    levels = (logger.level, [h.level for h in logger.handlers])
    h = None
    try:
        set_log_level_from_string("info")
        assert logger.level == logging.INFO and all(h.level == logging.INFO for h in logger.handlers)
        other = logging.getLogger("ringzero-test-custom")
        set_log_level_from_string("error", custom_logger=other)
        assert other.level == logging.ERROR and logger.level == logging.INFO
        seen = []
        h = logging.Handler()
        h.emit = lambda rec: seen.append(rec.getMessage())
        logger.addHandler(h)
        _tracker.reset()
        if get_accelerator().device_name() == "cpu":     # DeepSpeed's CPU accelerator pins nothing, counts nothing
            get_accelerator().pin_memory(torch.ones(1024))
            assert (_tracker._bytes, _tracker._calls) == (0, 0)
        track_pinned_memory(33 * 2**30)                   # crosses 32 GB: one INFO line
        track_pinned_memory(2**30)
        pinned_memory_summary("t")
        assert seen == ["[pinned-memory checkpoint] crossed 32.000 GB: 33.000 GB pinned across 1 allocations",
                        "[pinned-memory t] 34.000 GB pinned across 2 allocations"]
        assert _tracker._next_checkpoint == 64 * 2**30
    finally:
        if h is not None:
            logger.removeHandler(h)
        _tracker.reset()
        logger.setLevel(levels[0])
        for handler, lvl in zip(logger.handlers, levels[1]):
            handler.setLevel(lvl)


def test_stage_1_and_2_module_and_a_refused_instance(served_ds):
    import deepspeed.comm
    import deepspeed.runtime.zero.stage_1_and_2 as zero12
    assert zero12.dist is deepspeed.comm and zero12.IPGBucket is more_layout.IPGBucket
    opt = zero12.DeepSpeedZeroOptimizer.__new__(zero12.DeepSpeedZeroOptimizer)    # as DeepSpeed's unit tests do
    opt.overlap_comm = True
    assert opt.overlap_comm is True
    with pytest.raises(finder.NotServedAttributeError, match="DeepSpeedZeroOptimizer.allreduce_and_copy is not served"):
        opt.allreduce_and_copy
    assert not hasattr(opt, "__wrapped__")


def test_pin_memory_equals_deepspeeds_accelerator():
    """pin_memory(tensor, make_copy, match_shape), positional too, against DeepSpeed's abstract accelerator
    (cuda's) with the two torch pinning primitives replaced by unpinned equivalents on both sides (no GPU
    here): the same shape, dtype, copy or fresh buffer, and bytes tracked. On cpu: the tensor itself.
    FloatTensor / ByteTensor: the same constructors as DeepSpeed's cpu and cuda accelerators'."""
    import inspect

    from deepspeed.accelerator.abstract_accelerator import DeepSpeedAccelerator
    from deepspeed.accelerator.cpu_accelerator import CPU_Accelerator
    from deepspeed.utils import pin_memory_tracker as their_tracker
    assert inspect.signature(accelerator.Accelerator.pin_memory) == inspect.signature(DeepSpeedAccelerator.pin_memory)
    assert inspect.signature(accelerator.Accelerator.pin_memory) == inspect.signature(CPU_Accelerator.pin_memory)

    def unpinned(cls):
        cls._torch_pin_memory = lambda self, t: t.clone()
        cls._torch_empty_pinned = lambda self, t, shape: t.new_empty(shape)
        return cls

    class Theirs(DeepSpeedAccelerator):
        def __init__(self):
            pass
    Theirs.__abstractmethods__ = frozenset()
    theirs = unpinned(Theirs)()
    ours = object.__new__(unpinned(type("Ours", (accelerator.Accelerator,), {})))
    ours._name = "cuda"
    cpu = object.__new__(accelerator.Accelerator)
    cpu._name = "cpu"
    t = torch.arange(12.0).reshape(3, 4)
    for args, kw in [((), {}), ((False,), {}), ((), {"make_copy": False, "match_shape": False}),
                     ((True, False), {}), ((False, True), {})]:
        got = []
        for acc, tracker in ((ours, accelerator._tracker), (theirs, their_tracker._tracker)):
            tracker.reset()
            out = acc.pin_memory(t, *args, **kw)
            got.append((out.shape, out.dtype, out is t, out.data_ptr() == t.data_ptr(),
                        torch.equal(out, t) if out.shape == t.shape else None, tracker._bytes))
        assert got[0] == got[1], (args, kw, got)
        assert cpu.pin_memory(t, *args, **kw) is t
    accelerator._tracker.reset()
    their_tracker._tracker.reset()
    from deepspeed.accelerator.cuda_accelerator import CUDA_Accelerator    # the tensor constructors, as theirs
    for name in ("FloatTensor", "ByteTensor"):
        assert getattr(cpu, name) is getattr(CPU_Accelerator, name).fget(None)
        mine, cuda = getattr(ours, name), getattr(CUDA_Accelerator, name).fget(None)
        assert (mine.func, mine.args, mine.keywords) == (cuda.func, cuda.args, cuda.keywords)
