"""Other projects' files are copied, not kept (tests/upstream.py): none is tracked, each present one is upstream's bytes.

    python -m pytest -q tests/test_upstream.py        (< 1 s)
"""
import os
import subprocess

from tests import upstream


def test_no_copied_file_is_tracked_and_each_is_ignored():
    m = upstream.manifest()
    paths = [f["path"] for f in m["files"] + m["patched"]]
    assert len(paths) >= 60 and set(m["commits"]) == {f["repo"] for f in m["files"]}
    if not os.path.isdir(os.path.join(upstream.ROOT, ".git")) and not os.path.isfile(os.path.join(upstream.ROOT, ".git")):
        return     # not a git checkout: nothing can be tracked
    tracked = subprocess.run(["git", "ls-files", "--", *paths], cwd=upstream.ROOT, capture_output=True, text=True).stdout
    assert tracked == "", f"other projects' files in git: {tracked.split()}"
    ignored = subprocess.run(["git", "check-ignore", "--no-index", "--", *paths], cwd=upstream.ROOT,
                             capture_output=True, text=True).stdout.split()
    assert sorted(ignored) == sorted(paths), sorted(set(paths) - set(ignored))


def test_each_present_copy_is_upstreams_blob():
    m = upstream.manifest()
    for f in m["files"] + m["patched"]:
        path = os.path.join(upstream.ROOT, f["path"])
        if os.path.exists(path):
            assert upstream.git_blob(open(path, "rb").read()) == f["blob"], f["path"]


def test_a_diff_applies_as_patch_would():
    old = "a\r\nb\r\nc\r\nd\r\ne\r\nf\r\ng\r\n"
    diff = ("prose before the diff\n--- old\n+++ new\n@@ -2,3 +2,3 @@\n b\r\n-c\r\n+C\r\n d\r\n"
            "@@ -7 +6,0 @@\n-g\r\n@@ -0,0 +1 @@\n")
    assert upstream.apply_unified_diff(old, "--- old\n+++ new\n@@ -2,3 +2,3 @@\n b\r\n-c\r\n+C\r\n d\r\n") == \
        "a\r\nb\r\nC\r\nd\r\ne\r\nf\r\ng\r\n"
    assert upstream.apply_unified_diff(old, diff.rsplit("@@ -0,0", 1)[0]) == "a\r\nb\r\nC\r\nd\r\ne\r\nf\r\n"
    assert upstream.apply_unified_diff("x\ny\n", "--- a\n+++ b\n@@ -0,0 +1 @@\n+w\n") == "w\nx\ny\n"
    assert upstream.apply_unified_diff("x\n", "--- a\n+++ b\n@@ -1 +1 @@\n-x\n+z\n\\ No newline at end of file\n") == "z"
    try:
        upstream.apply_unified_diff("x\n", "--- a\n+++ b\n@@ -1 +1 @@\n-q\n+z\n")
    except ValueError as e:
        assert "does not apply at line 1" in str(e)
    else:
        raise AssertionError("a diff whose lines are not the file's applied")


def test_without_a_clone_nothing_is_written_and_the_repository_is_named(tmp_path, capsys):
    missing = upstream.copy(base=str(tmp_path))
    present = all(upstream.present(f["path"]) for f in upstream.manifest()["files"])
    assert present or "deepspeedai/DeepSpeed" in missing
