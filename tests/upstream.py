"""Other projects' files the suites run, copied here from a clone of their repository, never committed.

    python -m tests.upstream              # write every file tests/upstream.json names, checking its hash
    python -m tests.upstream --check      # say which are here and equal to upstream's bytes

The repository keeps what its authors wrote. DeepSpeed's tests/unit files (tests/ds_bulk/upstream),
accelerate's tests/deepspeed (tests/hf_suites/upstream) and DeepSpeedExamples' client scripts
(clients/*/upstream.py) are run, not kept: tests/upstream.json names each by repository, commit,
path and git blob hash, and this module writes it from a local clone or bare mirror of that
repository (git cat-file, so the bytes are the blob's). A client script changed to run offline is
the upstream file with the diff kept beside it applied (clients/*/*.diff, ours).
Clones are looked for under $RINGZERO_MIRRORS (default: a .mirror folder above this checkout) as
OWNER+NAME/repo, OWNER+NAME.git or NAME; `git clone --bare https://github.com/OWNER/NAME` makes one.
The test session copies them when a clone is found (tests/conftest.py); a test whose file is absent
skips and names this command.
"""
from __future__ import annotations

import argparse
import glob
import json
import os
import re
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MANIFEST = os.path.join(ROOT, "tests", "upstream.json")


def manifest() -> dict:
    with open(MANIFEST) as f:
        return json.load(f)


def mirrors_dir() -> str:
    """$RINGZERO_MIRRORS, else the first .mirror folder in a folder above this checkout."""
    if os.environ.get("RINGZERO_MIRRORS"):
        return os.environ["RINGZERO_MIRRORS"]
    up = os.path.dirname(ROOT)
    while not os.path.isdir(os.path.join(up, ".mirror")) and os.path.dirname(up) != up:
        up = os.path.dirname(up)
    return os.path.join(up, ".mirror")


def find_clone(repo: str, base: str | None = None) -> str | None:
    """A git directory holding `repo` (OWNER/NAME), or None."""
    base = base or mirrors_dir()
    owner, name = repo.split("/")
    pats = [f"{owner}+{name}/repo", f"{owner}+{name}.git", f"*+{name}/repo", f"{name}.git", name]
    for pat in pats:
        for path in sorted(glob.glob(os.path.join(base, pat))):
            git_dir = path if not os.path.isdir(os.path.join(path, ".git")) else os.path.join(path, ".git")
            if os.path.isfile(os.path.join(git_dir, "HEAD")):
                return git_dir
    return None


def git_blob(data: bytes) -> str:
    r = subprocess.run(["git", "hash-object", "--stdin"], input=data, capture_output=True, check=True)
    return r.stdout.decode().strip()


def apply_unified_diff(old: str, diff: str) -> str:
    """`old` with the hunks of a unified diff applied (prose before the first `---` is skipped)."""
    src, out, i = old.splitlines(keepends=True), [], 0
    lines = diff.splitlines(keepends=True)
    start = next(k for k, ln in enumerate(lines) if ln.startswith("--- "))
    for ln in lines[start + 2:]:
        m = re.match(r"@@ -(\d+)(?:,(\d+))? \+\d+(?:,\d+)? @@", ln)
        if m:
            first = int(m.group(1)) - (0 if m.group(2) == "0" else 1)
            out += src[i:first]
            i = first
        elif ln.startswith((" ", "-")):
            if src[i].rstrip("\n") != ln[1:].rstrip("\n"):
                raise ValueError(f"diff does not apply at line {i + 1}: {src[i]!r} != {ln[1:]!r}")
            if ln[0] == " ":
                out.append(src[i])
            i += 1
        elif ln.startswith("+"):
            out.append(ln[1:])
        elif ln.startswith("\\"):           # "\ No newline at end of file": the line before has none
            out[-1] = out[-1].rstrip("\n")
    return "".join(out + src[i:])


def _write(path: str, data: bytes) -> None:
    os.makedirs(os.path.dirname(path), exist_ok=True)
    tmp = f"{path}.tmp{os.getpid()}"
    with open(tmp, "wb") as f:
        f.write(data)
    os.replace(tmp, path)


def present(path: str) -> bool:
    return os.path.exists(os.path.join(ROOT, path))


def copy(base: str | None = None, quiet: bool = False) -> list[str]:
    """Write every absent or changed file from its clone; return the repositories with no clone."""
    m, missing = manifest(), []
    for f in m["files"]:
        dest = os.path.join(ROOT, f["path"])
        if os.path.exists(dest) and git_blob(open(dest, "rb").read()) == f["blob"]:
            continue
        clone = find_clone(f["repo"], base)
        if clone is None:
            missing.append(f["repo"])
            continue
        r = subprocess.run(["git", "--git-dir", clone, "cat-file", "blob", f["blob"]], capture_output=True)
        if r.returncode != 0:      # a clone without that blob (older, shallow, another fork): as if absent
            missing.append(f["repo"])
            continue
        _write(dest, r.stdout)
    for p in m["patched"]:
        src, dest = os.path.join(ROOT, p["from"]), os.path.join(ROOT, p["path"])
        if not os.path.exists(src) or (os.path.exists(dest) and git_blob(open(dest, "rb").read()) == p["blob"]):
            continue
        with open(src, newline="") as a, open(os.path.join(ROOT, p["diff"]), newline="") as d:
            try:
                data = apply_unified_diff(a.read(), d.read()).encode()
            except (ValueError, IndexError, StopIteration) as e:
                data, why = None, str(e)
        if data is None or git_blob(data) != p["blob"]:
            print(f"{p['diff']} applied to {p['from']} does not give {p['path']} (blob {p['blob']})"
                  + (f": {why}" if data is None else "") + "; not written", file=sys.stderr)
            continue
        _write(dest, data)
    missing = sorted(set(missing))
    if missing and not quiet:
        print(f"no clone of {', '.join(missing)} under {base or mirrors_dir()}: their files are not copied "
              "(set RINGZERO_MIRRORS to a folder holding one)", file=sys.stderr)
    return missing


def skip_reason(path: str) -> str:
    return (f"{path} is another project's file, not kept in this repository: "
            f"`python -m tests.upstream` copies it from a clone (tests/upstream.json)")


def require(path: str) -> None:
    """For a command line: copy the files if `path` is absent, else exit saying why it cannot run."""
    if not present(path):
        copy()
        if not present(path):
            raise SystemExit(skip_reason(path) + "; no clone was found")


def skip_unless_present(*paths: str):
    """A pytest mark: skip the test where one of `paths` (another project's file) is not here."""
    import pytest
    absent = [p for p in paths if not present(p)]
    return pytest.mark.skipif(bool(absent), reason=skip_reason(absent[0]) if absent else "")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--mirrors", help="folder holding the clones (default: $RINGZERO_MIRRORS, else a .mirror folder above the checkout)")
    ap.add_argument("--check", action="store_true", help="only report which files are here and equal upstream's")
    args = ap.parse_args(argv)
    if args.check:
        m, bad = manifest(), 0
        for f in m["files"] + m["patched"]:
            dest = os.path.join(ROOT, f["path"])
            ok = os.path.exists(dest) and git_blob(open(dest, "rb").read()) == f["blob"]
            bad += not ok
            if not ok:
                print(f"{'differs' if os.path.exists(dest) else 'absent '}  {f['path']}")
        print(f"{len(m['files']) + len(m['patched']) - bad} of {len(m['files']) + len(m['patched'])} upstream files here")
        return 1 if bad else 0
    missing = copy(args.mirrors)
    return 1 if missing else 0


if __name__ == "__main__":
    raise SystemExit(main())
