"""The table: the Hugging Face DeepSpeed test files (accelerate's, transformers') under DeepSpeed and ringzero.

    python -m tests.hf_suites.table                 (from tests/hf_suites/results/*.json, written by run.py)
    python -m tests.hf_suites.table --markdown      (the same as the markdown table in tests/hf_suites/README.md)

Per file: collected (test cases, parameter sets included); needs hub (the case loads a checkpoint or
tokenizer from the Hugging Face hub: not run, the machine is offline); skipped or failing under DeepSpeed
itself on this CPU (not compared); passed under DeepSpeed, and of those: passed under ringzero too,
refused on purpose (ringzero's one-line "not served"/NotImplementedError: the reason is the name, as in
tests/ds_bulk/table.py), failing (anything else). Cost: reading two JSON files.
"""
from __future__ import annotations

import argparse
import json
import os
from collections import Counter

from tests.ds_bulk.table import refusal
from tests.hf_suites.run import RESULTS


def load() -> tuple[dict, dict]:
    def one(mode):
        path = os.path.join(RESULTS, f"{mode}.json")
        return json.load(open(path)) if os.path.exists(path) else {}
    return one("deepspeed"), one("ringzero")


def ds_itself(outcome: str, why: str) -> str:
    """Why DeepSpeed's own run does not count a case, in a few words."""
    if outcome == "skipped":
        return "skipped: " + why.removeprefix("Skipped: ")[:60]
    if "No module named" in why:
        return "needs a package: " + why.rpartition("No module named ")[2].strip("'\" ")
    return "fails: " + why.removeprefix("E").strip()[:90]


def rows(ds: dict, rz: dict) -> list[dict]:
    out = []
    for f in sorted({k.split("::")[0] for k in ds}):
        r = {"file": f, "collected": 0, "hub": 0, "ds_pass": 0, "both": 0, "refused": Counter(), "failing": [],
             "ds_other": Counter()}
        for k, (outcome, why, hub) in ((k, v) for k, v in ds.items() if k.startswith(f + "::")):
            r["collected"] += 1
            if outcome == "passed":
                r["ds_pass"] += 1
                ours = rz.get(k) or rz.get(f"{f}::<file>") or ["missing", "not run under ringzero", False]
                if ours[0] == "passed":
                    r["both"] += 1
                elif refusal(ours[1]):
                    r["refused"][refusal(ours[1])] += 1
                else:
                    r["failing"].append((k, ours[1]))
            elif hub:
                r["hub"] += 1
            else:
                r["ds_other"][ds_itself(outcome, why)] += 1
        out.append(r)
    return out


COLS = ("collected", "hub", "ds_other", "ds_pass", "both", "refused", "failing")


def beyond(ds: dict, rz: dict) -> Counter:
    """The cases DeepSpeed itself fails on this CPU (not compared, not hub): ringzero's outcome on each,
    with the reason when it does not pass."""
    out = Counter()
    for k, (outcome, _, hub) in ds.items():
        if outcome in ("failed", "error") and not hub:
            o, why, _ = rz.get(k) or ["missing", "not run under ringzero", False]
            out["passes under ringzero" if o == "passed" else ds_itself(o, why).replace("fails", "fails under ringzero",
                                                                                     1)] += 1
    return out


def count(r: dict, k: str) -> int:
    v = r[k]
    return v if isinstance(v, int) else sum(v.values()) if isinstance(v, Counter) else len(v)


def markdown(rs: list[dict]) -> str:
    lines = ["| file | collected | needs hub: not run | skipped or failing under DeepSpeed (CPU) | "
             "pass under DeepSpeed (CPU) | pass under ringzero too | refused on purpose | failing |",
             "|---|---|---|---|---|---|---|---|"]
    for r in rs:
        lines.append(f"| {r['file']} | " + " | ".join(str(count(r, k)) for k in COLS) + " |")
    lines.append("| **all** | " + " | ".join(f"{sum(count(r, k) for r in rs)}" for k in COLS) + " |")
    return "\n".join(lines)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--markdown", action="store_true", help="print markdown (for tests/hf_suites/README.md)")
    a = ap.parse_args(argv)
    rs = rows(*load())
    refused = sum((r["refused"] for r in rs), Counter())
    others = sum((r["ds_other"] for r in rs), Counter())
    if a.markdown:
        print(markdown(rs))
        print("\nNot compared, DeepSpeed itself on this CPU (reason: cases):\n")
        print("\n".join(f"- {why}: {n}" for why, n in others.most_common()))
        print("\nThe cases DeepSpeed itself fails on this CPU, under ringzero (not counted above):\n")
        print("\n".join(f"- {why}: {n}" for why, n in beyond(*load()).most_common()) or "- none")
        print("\nRefused by ringzero (reason: cases):\n")
        print("\n".join(f"- {why}: {n}" for why, n in refused.most_common()) or "- none")
        print("\nFailing under ringzero:\n")
        print("\n".join(f"- {k}: {why}" for r in rs for k, why in r["failing"]) or "- none")
        return
    from rich.console import Console
    from rich.table import Table
    t = Table(title="HF DeepSpeed tests: installed DeepSpeed 0.19.8 vs ringzero (CPU, gloo, offline)")
    for col in ("file", "collected", "needs hub", "DeepSpeed skips/fails", "pass DeepSpeed", "pass ringzero too",
                "refused", "failing"):
        t.add_column(col)
    for r in rs:
        t.add_row(r["file"], *(str(count(r, k)) for k in COLS))
    t.add_row("all", *(str(sum(count(r, k) for r in rs)) for k in COLS))
    con = Console(width=200)
    con.print(t)
    for why, n in others.most_common():
        con.print(f"DeepSpeed itself ×{n}: {why}")
    for why, n in refused.most_common():
        con.print(f"refused ×{n}: {why}")
    for r in rs:
        for k, why in r["failing"]:
            con.print(f"[red]failing[/] {k}: {why[:220]}")


if __name__ == "__main__":
    main()
