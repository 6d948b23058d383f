"""Run DeepSpeed's own unit-test files (tests/ds_bulk/upstream, unchanged) under both `deepspeed`s.

    python -m tests.ds_bulk.run                      # every copied file, installed DeepSpeed then ringzero
    python -m tests.ds_bulk.run --mode ringzero unit/runtime/pipe/test_topology.py
    python -m tests.ds_bulk.run --mode ringzero --compared-only unit/runtime/pipe/test_topology.py
    # --compared-only: only the cases DeepSpeed passed (results/deepspeed.json)

One pytest process per (file, mode), rooted at tests/ds_bulk/upstream with DeepSpeed's own
conftest.py and pytest.ini, so DeepSpeed's DistributedTest spawns the ranks (forkserver, gloo on
the CPU accelerator). Mode "ringzero" puts tests/ds_bulk/site first on PYTHONPATH with
RINGZERO_DEEPSPEED=1: its sitecustomize installs the runner's finder in pytest and in every rank,
so `import deepspeed` is ringzero's, as under `python -m zero_from_scratch.as_deepspeed`, except that
a name ringzero does not serve fails where a test uses it, not at the file's imports
(RINGZERO_DEEPSPEED_DEFER, finder.py): each test is judged by what it uses.
Each test's outcome (and a failure's last line) goes to tests/ds_bulk/results/<mode>.json;
table.py reads them. dist_fixtures.py (a pytest plugin, both modes) registers DeepSpeed's
DistributedFixture classes as fixtures, which pytest >= 8.4 no longer finds by itself (the plugin
needs pytest >= 9.1). A file that binds a fixed MASTER_PORT in pytest's own process runs in a network
namespace of its own (own_network), so other runs on the machine cannot hold its port.
Cost: the tests' own, serial (2 cores); a few seconds of imports per file.
"""
from __future__ import annotations

import argparse
import fcntl
import glob
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import xml.etree.ElementTree as ET

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
UP = os.path.join(HERE, "upstream")
RESULTS = os.path.join(HERE, "results")
MODES = ("deepspeed", "ringzero")


def test_files() -> list[str]:
    found = glob.glob(os.path.join(UP, "unit", "**", "test_*.py"), recursive=True)
    return sorted(os.path.relpath(p, UP) for p in found)


def environment(mode: str) -> dict:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([os.path.join(HERE, "site"), ROOT])
    env.update(OMP_NUM_THREADS="1", DS_ACCELERATOR="cpu", LOCAL_SIZE="4",  # 4 CPU "devices": world sizes > 4 skip
               DS_DISABLE_REUSE_DIST_ENV="1", RINGZERO_DEEPSPEED="1" if mode == "ringzero" else "0",
               RINGZERO_DEEPSPEED_DEFER="1")   # an unserved name fails the test that uses it, not the whole file
    return env


def last_line(text: str) -> str:
    lines = [ln.strip() for ln in (text or "").splitlines() if ln.strip()]
    errs = [ln for ln in lines if ln.startswith("E ")]
    return (errs[-1] if errs else lines[-1] if lines else "")[:500]


def parse(xml_path: str, file: str) -> dict:
    out = {}
    for case in ET.parse(xml_path).getroot().iter("testcase"):
        name = case.get("name")
        outcome, why = "passed", ""
        for tag in ("failure", "error", "skipped"):
            el = case.find(tag)
            if el is not None:
                outcome = {"failure": "failed", "error": "error", "skipped": "skipped"}[tag]
                why = last_line((el.get("message") or "") + "\n" + (el.text or "")) if tag != "skipped" else \
                    (el.get("message") or "")[:300]
                break
        cls = case.get("classname", "").rpartition(".")[2]
        key = f"{file}::{cls + '::' if cls.startswith('Test') else ''}{name}"
        out[key] = [outcome, why]
    return out


def deepspeed_passed(file: str) -> list[str]:
    """The node ids of `file`'s cases the installed DeepSpeed passed here (the only ones compared)."""
    path = os.path.join(RESULTS, "deepspeed.json")
    ds = json.load(open(path)) if os.path.exists(path) else {}
    return [k for k, v in ds.items() if k.startswith(file + "::") and v[0] == "passed"]


def own_network(file: str) -> bool:
    """A file that starts torch.distributed in pytest's own process on a fixed MASTER_PORT (DeepSpeed's
    test_zero_grad_clip.py: 29500) meets any other run on this machine holding that port; it runs in a
    fresh network namespace of its own (loopback only: `unshare -n`, as root), the file unchanged."""
    src = open(os.path.join(UP, file)).read()
    return re.search(r"""environ\[['"]MASTER_PORT['"]\]\s*=""", src) is not None


def run_file(file: str, mode: str, timeout: int, select: str | None = None, ids: list[str] | None = None) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        xml = os.path.join(tmp, "r.xml")
        cmd = [sys.executable, "-m", "pytest", "-c", "pytest.ini", "--confcutdir=.", "-p", "no:cacheprovider", "-q",
               "-p", "tests.ds_bulk.dist_fixtures",   # DistributedFixture classes as fixtures (pytest >= 9.1)
               "-o", "addopts=", "-m", "not sequential and not nightly and not inference", f"--junitxml={xml}",
               "--timeout", "600", *(ids or [file])] + (["-k", select] if select else [])
        env = environment(mode)
        if own_network(file):
            if os.geteuid() != 0 or not (shutil.which("unshare") and shutil.which("ip")):
                return {f"{file}::<file>": ["error", "needs a network namespace of its own (unshare -n as root): "
                                                     "it binds a fixed MASTER_PORT in pytest's process"]}
            cmd = ["unshare", "-n", "sh", "-c", 'ip link set lo up && exec "$@"', "sh", *cmd]
            env["GLOO_SOCKET_IFNAME"] = "lo"     # the namespace's only interface
        try:
            subprocess.run(cmd, cwd=UP, env=env, capture_output=True, text=True, timeout=timeout)
        except subprocess.TimeoutExpired:
            return {f"{file}::<file>": ["error", f"the file ran past {timeout}s"]}
        if not os.path.exists(xml):
            return {f"{file}::<file>": ["error", "pytest wrote no report"]}
        return parse(xml, file)


def record(path: str, file: str, res: dict, keep_others: bool) -> None:
    """Merge one run into a results file, read just before writing under a lock (runs may overlap)."""
    lock = os.open(os.path.dirname(path), os.O_RDONLY)     # the results folder itself: no lock file left behind
    try:
        fcntl.flock(lock, fcntl.LOCK_EX)
        old = json.load(open(path)) if os.path.exists(path) else {}
        if keep_others:     # a rerun of some cases: the file's other results stay
            old = {k: v for k, v in old.items() if k not in res and k != f"{file}::<file>"}
        else:
            old = {k: v for k, v in old.items() if not k.startswith(file + "::")}
        old.update(res)
        with open(path + ".tmp", "w") as f:
            json.dump(dict(sorted(old.items())), f, indent=0)
        os.replace(path + ".tmp", path)
    finally:
        os.close(lock)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("files", nargs="*", help="paths under tests/ds_bulk/upstream (default: every copied test file)")
    ap.add_argument("--mode", choices=(*MODES, "both"), default="both")
    ap.add_argument("--timeout", type=int, default=3600, help="seconds per test file (default 3600; 600 per test)")
    ap.add_argument("-k", dest="select", help="pytest -k: run only these cases, keep the file's other results")
    ap.add_argument("--subset", action="store_true", help="with -k: the file is compared on this subset only "
                                                          "(recorded in results/subsets.json; the table says so)")
    ap.add_argument("--compared-only", action="store_true",
                    help="under ringzero run only the cases DeepSpeed passed (results/deepspeed.json): "
                         "the others are not compared")
    a = ap.parse_args(argv)
    from tests import upstream
    upstream.require("tests/ds_bulk/upstream/unit/common.py")
    os.makedirs(RESULTS, exist_ok=True)
    if a.subset:
        path = os.path.join(RESULTS, "subsets.json")
        subsets = json.load(open(path)) if os.path.exists(path) else {}
        subsets.update({f: a.select for f in a.files})
        with open(path, "w") as f:
            json.dump(dict(sorted(subsets.items())), f, indent=0)
    for file in a.files or test_files():
        for mode in MODES if a.mode == "both" else (a.mode,):
            ids = deepspeed_passed(file) if a.compared_only and mode == "ringzero" else None
            if ids == []:
                continue
            res = run_file(file, mode, a.timeout, a.select, ids)
            record(os.path.join(RESULTS, f"{mode}.json"), file, res, keep_others=bool(a.select or ids) and not a.subset)
            n = len(res)
            p = sum(v[0] == "passed" for v in res.values())
            print(f"{mode:9s} {file}: {p}/{n} passed", flush=True)


if __name__ == "__main__":
    main()
