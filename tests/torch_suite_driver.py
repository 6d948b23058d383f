"""Runs torch's own collective test bodies (torch/testing/_internal/distributed/distributed_test.py,
the gloo suite) with torch.distributed's collectives replaced by ringzero's. Used by
tests/test_torch_distributed_suite.py; runs on a rank spawned by primitives.launch.spawn.

How: the module's global `dist` (its `import torch.distributed as dist`) becomes a proxy that
answers the collectives (OURS) with primitives' functions and everything else (new_group,
get_rank, barrier, isend, ...) with torch.distributed itself. Each test method of torch's
`DistributedTest._DistTestBase` then runs unchanged on every rank. One patch: `call_dist_op`
runs the op as torch's does but without its profiler assertion, which wants one
`gloo:<op>` event per call, an event only gloo's own kernels emit.

Outcomes per test and rank: ("pass", ""), ("skip", why) for torch's own skips (a
`__unittest_skip__` reason, or the TEST_SKIPS exit code its decorators use), ("fail", traceback).
"""
from __future__ import annotations

import importlib
import os
import traceback
import types
import unittest

import torch.distributed as dist

import primitives as P

OURS = ("broadcast", "reduce", "all_reduce", "all_gather", "all_gather_single", "all_gather_into_tensor",
        "reduce_scatter", "reduce_scatter_single", "reduce_scatter_tensor", "scatter", "gather", "all_to_all",
        "all_to_all_single", "all_reduce_coalesced", "all_gather_coalesced", "all_gather_object",
        "broadcast_object_list", "gather_object", "scatter_object_list")

# torch's tests of those collectives, by name prefix (test_reduce_ also covers test_reduce_scatter_)
PREFIXES = ("test_broadcast", "test_reduce", "test_all_reduce", "test_scatter", "test_gather", "test_all_gather",
            "test_all_to_all")


# torch skips these bodies on gloo because gloo lacks the collective (all-to-all), because it runs
# its sub-group tests only at >= 8 ranks (a sub-group of ranks [1, 2] needs 3), or because the test
# fails in torch's own CI (broadcast_object_list, which its body exercises on CPU as on GPU).
# ringzero's collectives run on any CPU group, so the driver runs these bodies (outcome "pass*").
SMALL = "Skipped due to small world size."
UNLOCK = ("Only MPI supports CPU all_to_all_single", "Only MPI supports all_to_all", SMALL,
          "Test is failing, see https://github.com/pytorch/pytorch/pull/113620")


def _module(world_size: int, temp_dir: str):
    os.environ.update(BACKEND="gloo", WORLD_SIZE=str(world_size), TEMP_DIR=temp_dir)
    # imported here, after the environment it reads at import time (BACKEND, WORLD_SIZE, TEMP_DIR)
    return importlib.import_module("torch.testing._internal.distributed.distributed_test")


def proxy() -> types.ModuleType:
    """torch.distributed with OURS replaced by primitives' functions."""
    mod = types.ModuleType("ringzero_as_torch_distributed")
    mod.__getattr__ = lambda name: getattr(dist, name)
    for name in OURS:
        setattr(mod, name, getattr(P, name))
    return mod


def names(world_size: int, temp_dir: str) -> list[str]:
    base = _module(world_size, temp_dir).DistributedTest._DistTestBase
    return sorted(n for n in dir(base) if n.startswith(PREFIXES) and callable(getattr(base, n)))


def _body(fn):
    """The test's own function under its decorators (each sets __wrapped__: functools.wraps)."""
    while getattr(fn, "__wrapped__", None) is not None:
        fn = fn.__wrapped__
    return fn


def _case_class(DT):
    # torch's TestCase: its assertEqual compares tensors (imported with DT, after its environment)
    from torch.testing._internal.common_utils import TestCase

    class Case(DT.DistributedTest._DistTestBase, TestCase):
        world_size = property(lambda self: os.environ["WORLD_SIZE"])     # as torch's TestDistBackend

        def call_dist_op(self, profiling_title_postfix, is_async, op, *args, expect_event=True,
                         secondary_op_call=None, profile_cuda=False, tensor_shapes=None, **kwargs):
            works = [op(*args, **kwargs)] + ([secondary_op_call()] if secondary_op_call is not None else [])
            if is_async:
                for w in works:
                    w.wait()
    return Case


def run(rank: int, world_size: int, temp_dir: str, tests: list[str], strict: bool = False) -> dict:
    """On one rank: run every test of `tests` in order; {name: (outcome, detail)}."""
    DT = _module(world_size, temp_dir)
    from torch.testing._internal.common_distributed import TEST_SKIPS  # loaded by DT just above
    P.set_strict_p2p(strict)
    DT.dist = proxy()
    Case = _case_class(DT)
    skips = {v.exit_code: v.message for v in TEST_SKIPS.values()}
    DT.Barrier.sync(timeout=300)                     # every rank has imported torch's module
    out = {}
    for i, name in enumerate(tests, 1):
        fn = getattr(Case, name)
        why = getattr(fn, "__unittest_skip_why__", "") if getattr(fn, "__unittest_skip__", False) else ""
        if why and why not in UNLOCK:
            out[name] = ("skip", why)
            continue
        case = Case(name)
        case.rank = rank
        try:
            try:
                getattr(case, name)()
            except (SystemExit, unittest.SkipTest) as e:   # torch's decorators skip by raising or exiting
                why = skips.get(e.code, f"exit code {e.code}") if isinstance(e, SystemExit) else str(e)
                if why not in UNLOCK or (why == SMALL and world_size < 3):
                    raise
                _body(fn)(case)                      # the body, under none of its gates
            out[name] = ("pass*", why) if why else ("pass", "")
        except unittest.SkipTest as e:
            out[name] = ("skip", str(e))
        except SystemExit as e:
            out[name] = ("skip", skips.get(e.code, f"exit code {e.code}"))
        except Exception:
            out[name] = ("fail", traceback.format_exc()[-3000:])
        if os.environ.get("RINGZERO_SUITE_VERBOSE"):
            print(f"rank {rank}: {name}: {out[name][0]} {out[name][1][-300:]}", flush=True)
        DT.Barrier.barrier_id = 10_000 * i          # line the ranks up again, even after a test that
        DT.Barrier.sync(timeout=120)                 # failed before its own barriers
    return out
