"""Run the Hugging Face DeepSpeed test files, unchanged, under both `deepspeed`s.

    python -m tests.hf_suites.run                      # every test file: installed DeepSpeed, then ringzero
    python -m tests.hf_suites.run --mode ringzero accelerate/tests/deepspeed/test_deepspeed.py -k test_ds_config

The files: accelerate's tests/deepspeed (copied under upstream/ by `python -m tests.upstream`) and transformers'
test_trainer_distributed_deepspeed.py with its helpers (a local copy, kept out of git: UPSTREAM.md says
where it comes from and how to rebuild it; absent, it is not run). One pytest process per (file, mode),
rooted at the file's repository copy, offline (HF_HUB_OFFLINE=1) with tiny models built from configs
under the hub names the tests load (hub_standins.py; a test that needs anything else from the hub fails
at once, and the table counts it under "needs hub"), DeepSpeed's CPU accelerator (DS_ACCELERATOR=cpu,
gloo), RUN_SLOW=1 (accelerate's multi-process tests, launched by `accelerate launch --num_processes=2`,
and transformers' launched ones, `accelerate launch` / `torchrun` of the copy's `scripts/`, are marked
slow), and `-p cpu_gates` (the "needs an accelerator" gates opened, the CPU counted as one device,
cpu_gates.py).
Every process starts with site/sitecustomize.py (first on PYTHONPATH: the launched scripts get cpu_gates.py's
bf16 gate too). Mode "ringzero" differs by one thing: RINGZERO_DEEPSPEED=1, so pytest and every process it
launches get `import deepspeed` from ringzero (as under `python -m zero_from_scratch.as_deepspeed`); a
DeepSpeed name ringzero does not serve fails in the test that uses it (RINGZERO_DEEPSPEED_DEFER=1). Each
case's outcome, last line and whether it needed the hub go to tests/hf_suites/results/<mode>.json; table.py
reads them. Cost: the tests' own.
"""
from __future__ import annotations

import argparse
import glob
import json
import os
import re
import subprocess
import sys
import tempfile
import xml.etree.ElementTree as ET

from tests.hf_suites import hub_standins

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
UP = os.path.join(HERE, "upstream")
SITE = os.path.join(HERE, "site")     # sitecustomize: the bulk run's (the runner's finder), the launched bf16 gate
RESULTS = os.path.join(HERE, "results")
# transformers' files are not in git: a copy of the stored versions UPSTREAM.md names (and hashes) lives here
LOCAL = os.environ.get("RINGZERO_HF_LOCAL", os.path.join(HERE, "local"))
LOCAL_FILES = ("transformers/tests/trainer/distributed/test_trainer_distributed_deepspeed.py",)
MODES = ("deepspeed", "ringzero")
# what huggingface_hub / transformers say when a checkpoint must come from the hub and HF_HUB_OFFLINE is set
HUB = re.compile(r"offline mode|HF_HUB_OFFLINE|LocalEntryNotFound|couldn't connect to|is not a local folder and is "
                 r"not a valid model identifier|Cannot find the requested files in the (?:disk )?cache|"
                 r"OfflineModeIsEnabled|outgoing traffic has been disabled", re.I)


def test_files(local: bool = True) -> list[str]:
    """The copied test files, then those of the local copy that are present."""
    return sorted(os.path.relpath(p, UP) for p in glob.glob(os.path.join(UP, "*", "tests", "**", "test_*.py"),
                                                               recursive=True)) + \
        [f for f in LOCAL_FILES if local and os.path.exists(os.path.join(LOCAL, f))]


def repo_root(repo: str) -> str:
    return os.path.join(UP, repo) if os.path.isdir(os.path.join(UP, repo)) else os.path.join(LOCAL, repo)


def environment(mode: str, repo: str = "accelerate") -> dict:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([SITE, ROOT, HERE])    # HERE: `-p cpu_gates` (transformers has a `tests`)
    env["PATH"] = os.pathsep.join([os.path.dirname(sys.executable), env.get("PATH", "")])   # `accelerate launch`
    # accelerate's 2-process tests and transformers' launched ones are marked slow
    env.update(OMP_NUM_THREADS="1", DS_ACCELERATOR="cpu", CUDA_VISIBLE_DEVICES="", RUN_SLOW="1",
               HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", HF_DATASETS_OFFLINE="1", HF_HUB_DISABLE_TELEMETRY="1",
               RINGZERO_DEEPSPEED="1" if mode == "ringzero" else "0", RINGZERO_DEEPSPEED_DEFER="1",
               RINGZERO_HF_CPU_GATES="1",       # site/sitecustomize.py: the bf16 gate in launched scripts too
               HF_HUB_CACHE=hub_standins.build(),   # tiny models built from configs under the hub names
               # DeepSpeed's CPU Adam (offload_optimizer: cpu) builds its C++ op once, here, not behind another's lock
               TORCH_EXTENSIONS_DIR=os.path.join(tempfile.gettempdir(), "ringzero_hf_torch_extensions"))
    return env


# a launched process's failure ends in its launcher's lines; the error that stopped it is the one to report:
# a worker's last (torchrun prefixes each worker's lines with "[rankN]: "), else the first not the launcher's
RANK_CAUSE = re.compile(r"^E\s+\[rank\d+\]:\s*([\w.]*(?:Error|Exception): .+)$", re.M)
CAUSE = re.compile(r"^E\s+((?!RuntimeError|subprocess\.|torch\.distributed\.elastic)[\w.]*(?:Error|Exception): .+)$",
                   re.M)
WRAPPER = re.compile(r"^E\s+(?:=+|subprocess\.CalledProcessError|traceback|error_file|.*ChildFailedError)")


def last_line(text: str) -> str:
    lines = [ln.strip() for ln in (text or "").splitlines() if ln.strip()]
    errs = [ln for ln in lines if ln.startswith("E ")]
    cause = ([None] + list(RANK_CAUSE.finditer(text or "")))[-1] or CAUSE.search(text or "")
    if errs and WRAPPER.match(errs[-1]) and cause:
        return cause.group(1)[:300]
    return (errs[-1] if errs else lines[-1] if lines else "")[:300]


def parse(xml_path: str, file: str) -> dict:
    """case → [outcome, last line (or skip reason), needs hub]"""
    out = {}
    for case in ET.parse(xml_path).getroot().iter("testcase"):
        outcome, why, hub = "passed", "", False
        for tag in ("failure", "error", "skipped"):
            el = case.find(tag)
            if el is not None:
                text = (el.get("message") or "") + "\n" + (el.text or "")
                outcome = {"failure": "failed", "error": "error", "skipped": "skipped"}[tag]
                why = last_line(text) if tag != "skipped" else (el.get("message") or "")[:300]
                # a launched process's hub error reaches only the captured output (junit_logging=all)
                hub = tag != "skipped" and bool(HUB.search(text + "".join(e.text or "" for e in case)))
                break
        cls = case.get("classname", "").rpartition(".")[2]
        out[f"{file}::{cls}::{case.get('name')}"] = [outcome, why, hub]
    return out


def run_file(file: str, mode: str, timeout: int, select: str | None = None) -> dict:
    repo, rel = file.split(os.sep, 1)
    with tempfile.TemporaryDirectory() as tmp:
        xml = os.path.join(tmp, "r.xml")
        cmd = [sys.executable, "-m", "pytest", "--rootdir", ".", "-c", os.devnull, "--confcutdir=.", "-p", "no:cacheprovider",
               "-p", "cpu_gates", "-q", f"--junitxml={xml}", "-o", "junit_logging=all", "--timeout", "600", rel] + \
              (["-k", select] if select else [])
        try:
            subprocess.run(cmd, cwd=repo_root(repo), env=environment(mode, repo), capture_output=True, text=True,
                           timeout=timeout)
        except subprocess.TimeoutExpired:
            return {f"{file}::<file>": ["error", f"the file ran past {timeout}s", False]}
        if not os.path.exists(xml):
            return {f"{file}::<file>": ["error", "pytest wrote no report", False]}
        return parse(xml, file)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("files", nargs="*", help="paths under tests/hf_suites/upstream (default: every copied test file)")
    ap.add_argument("--mode", choices=(*MODES, "both"), default="both")
    ap.add_argument("--timeout", type=int, default=3600, help="seconds per test file (default 3600; 600 per test)")
    ap.add_argument("-k", dest="select", help="pytest -k: rerun only these cases, keep the file's other results")
    a = ap.parse_args(argv)
    from tests import upstream
    upstream.require("tests/hf_suites/upstream/accelerate/tests/deepspeed/test_deepspeed.py")
    os.makedirs(RESULTS, exist_ok=True)
    for f in LOCAL_FILES if not a.files else ():
        if not os.path.exists(os.path.join(LOCAL, f)):
            print(f"not run: {f} (no local copy under {LOCAL}, the folder holding transformers/: UPSTREAM.md)")
    for file in a.files or test_files():
        for mode in MODES if a.mode == "both" else (a.mode,):
            path = os.path.join(RESULTS, f"{mode}.json")
            old = json.load(open(path)) if os.path.exists(path) else {}
            res = run_file(file, mode, a.timeout, a.select)
            if a.select:
                old = {k: v for k, v in old.items() if k not in res and k != f"{file}::<file>"}
            else:
                old = {k: v for k, v in old.items() if not k.startswith(file + "::")}
            old.update(res)
            with open(path, "w") as f:
                json.dump(dict(sorted(old.items())), f, indent=0)
            print(f"{mode:9s} {file}: {sum(v[0] == 'passed' for v in res.values())}/{len(res)} passed", flush=True)


if __name__ == "__main__":
    main()
