"""A script that patches DeepSpeed's module-level names, under the runner and under real DeepSpeed 0.19.8.

    python -m pytest -q tests/test_ds_patching.py        # 11-40 s on 2 cores by load (4 interpreters, 2 import DeepSpeed)

Scripts (and DeepSpeed's own tests) replace a module's function to steer or watch it: a patch must either act
as it does on DeepSpeed or fail saying why it cannot. (a) ds_to_universal's main calls its steps by DeepSpeed's
names, so a patched step is seen: the same script prints the same outcome under both `deepspeed`s.
(b) the ZeRO stage modules' count_used_parameters_in_backward is served (the runtime.utils function it aliases):
imported from a stage module and called from a gradient hook, it counts what real DeepSpeed's counts; REPLACING
it there (ringzero's hooks never call it) raises the runner's one-line NotServedError.
"""
import sys
import textwrap

import pytest

from conftest import run_cmd

pytest.importorskip("deepspeed")

PATCHED_STEPS = """
from types import SimpleNamespace
import deepspeed.checkpoint.ds_to_universal as m
info = {"autotp_unsupported_parameter_patterns": {"^qkv.weight$": "unsupported layout"}}
class Ck:
    global_state = {}
    def get_checkpoint_info(self, key):
        return self.global_state.get(key, info)
seen = []
m._get_optim_files = lambda d: seen.append(("optim", d)) or ["optim.pt"]
m._filter_zero3_optim_files = lambda files: seen.append(("filter", files)) or []
m._get_zero_stage = lambda files: seen.append(("stage", files)) or 1
m.DeepSpeedCheckpoint = lambda d: seen.append(("ckpt", d)) or Ck()
m._inject_missing_state = lambda ck: seen.append("inject")
for inject in (True, False):
    try:
        m.main(SimpleNamespace(input_folder="in", output_folder="out", inject_missing_state=inject))
    except Exception as e:
        seen.append((type(e).__name__, str(e)))
m._check_for_required_state = lambda ck: seen.append("checked")
try:      # past the checks both read the (absent) folder's files, each its own way: the steps so far only
    m.main(SimpleNamespace(input_folder="in", output_folder="out", inject_missing_state=False))
except Exception:
    print(seen)
"""


def _both(code: str):
    """(stdout under real DeepSpeed, stdout under the runner) of one script."""
    ds = run_cmd(f"{sys.executable} -c {_q(code)}").stdout
    path = "/tmp/_rz_patch_script.py"
    with open(path, "w") as f:
        f.write(code)
    rz = run_cmd(f"{sys.executable} -m zero_from_scratch.as_deepspeed {path}")
    assert "ringzero" in rz.stderr
    return ds, rz.stdout


def _q(s: str) -> str:
    return "'" + s.replace("'", "'\"'\"'") + "'"


def _seen(out: str) -> str:
    return [ln for ln in out.splitlines() if ln.startswith("[")][-1]


def test_ds_to_universal_main_sees_a_scripts_patched_steps():
    ds, rz = _both(PATCHED_STEPS)
    assert _seen(ds).startswith("[('optim', 'in'), ('filter', ['optim.pt']), ('stage', ['optim.pt']), ('ckpt', 'in'), "
                                "'inject', ('ValueError', 'AutoTP universal checkpoint conversion is not supported for")
    assert _seen(ds).endswith("('ckpt', 'in'), 'checked']")
    assert _seen(ds) == _seen(rz), (ds, rz)


HOOK_COUNT = """
import torch
from unittest.mock import patch
import deepspeed.runtime.utils as u
from deepspeed.runtime.zero.stage3 import count_used_parameters_in_backward as count3
from deepspeed.runtime.zero.stage_1_and_2 import count_used_parameters_in_backward as count12
lin, unused = torch.nn.Linear(3, 2), torch.nn.Linear(3, 2)
counts = []
lin.weight.register_hook(lambda g: counts.extend(f([lin.weight, lin.bias, unused.weight])
                                                 for f in (u.count_used_parameters_in_backward, count3, count12)))
lin(torch.ones(1, 3)).sum().backward()
print("count", counts)
try:
    with patch("deepspeed.runtime.zero.stage3.count_used_parameters_in_backward",
               wraps=u.count_used_parameters_in_backward):
        print("patched")
except NotImplementedError as e:
    print("refused", type(e).__name__, e)
import deepspeed.runtime.zero.stage3 as s3
print("after", s3.count_used_parameters_in_backward is count3)
"""


def test_stage_alias_of_count_used_parameters_served_replacing_it_refused():
    ds, rz = _both(HOOK_COUNT)
    assert "count [2, 2, 2]" in ds and "count [2, 2, 2]" in rz      # the two parameters this backward reaches
    assert "patched" in ds and "after True" in ds and "after True" in rz
    assert ("refused NotServedError replacing deepspeed.runtime.zero.stage3.count_used_parameters_in_backward is not "
            "served by ringzero" in rz and "ringzero's ZeRO engine ends a backward" in rz), rz
