"""The bulk table: DeepSpeed's own unit-test files under the installed DeepSpeed and under ringzero.

    python -m tests.ds_bulk.table                 (from tests/ds_bulk/results/*.json, written by run.py)
    python -m tests.ds_bulk.table --markdown      (the same as the markdown table in tests/ds_bulk/README.md)

Per file: collected (test cases, parameter sets included), passed under DeepSpeed on this CPU, of
those: passed under ringzero too, refused on purpose (ringzero's one-line "not served"/"not
supported" error: the reason is the name), failing (anything else). A case DeepSpeed itself fails or
skips on CPU is not compared. Cost: reading two JSON files.
"""
from __future__ import annotations

import argparse
import json
import os
import re
from collections import Counter

from tests.ds_bulk.run import RESULTS
from zero_from_scratch.as_deepspeed import served

# ringzero's refusals: the runner's NotServed* errors, the engines' "not supported/implemented here" lines and
# the config gate's "config key 'K' = V is refused: ..." (key_status.gate, grad_keys)
NOT_SERVED = re.compile(r"((?:replacing )?deepspeed[\w.]*(?:\([^)]*\))?) is not served by ringzero"
                        r"(?: \(DeepSpeed [\d.]+ API\): "
                        r"DeepSpeed would ([^;]*))?")
REFUSAL = re.compile(r"NotServed\w*Error: (.{0,120})|NotImplementedError: (.{0,480})|"
                     r"ValueError: (config key '[\w.]+')(?: = .*?)? (is refused[^:]*: .{0,120})")


def load() -> tuple[dict, dict]:
    def one(mode):
        path = os.path.join(RESULTS, f"{mode}.json")
        return json.load(open(path)) if os.path.exists(path) else {}
    return one("deepspeed"), one("ringzero")


def subsets() -> dict:
    """file → the pytest -k expression it was compared on (run.py --subset); absent: the whole file."""
    path = os.path.join(RESULTS, "subsets.json")
    return json.load(open(path)) if os.path.exists(path) else {}


def label(file: str) -> str:
    k = subsets().get(file)
    return f"{file} (subset: -k \"{k}\")" if k else file


def refusal(why: str) -> str | None:
    m = NOT_SERVED.search(why or "")
    if m:     # the reason: the runner's table (served.REFUSED) as it is now, else the message's
        name = m.group(1).removeprefix("replacing ")      # a refused patch of a served name (served.PATCH_REFUSED)
        what = {**served.REFUSED, **served.PATCH_REFUSED}.get(name, (m.group(2) or "",))[0]
        return "not served: " + m.group(1) + ("" if not what or what.startswith("serve ") else f" (DeepSpeed would {what})")
    m = REFUSAL.search(why or "")
    if m and m.group(3):     # the config gate's refusal: the key and the reason, not the value
        return f"{m.group(3)} {m.group(4)}".strip()
    # a temporary path in the message (a test's tmpdir) names no reason: one line per reason, not per folder
    return re.sub(r"/tmp/[^\s)]+", "<tmp>", (m.group(1) or m.group(2)).strip()) if m else None


def rows(ds: dict, rz: dict) -> list[dict]:
    files = sorted({k.split("::")[0] for k in ds})
    out = []
    for f in files:
        cases = {k: v for k, v in ds.items() if k.startswith(f + "::")}
        whole = rz.get(f"{f}::<file>") or next((v for k, v in rz.items() if k.startswith(f + "::") and
                                                "::" not in k[len(f) + 2:] and v[0] == "error" and
                                                not k.endswith("]") and k[len(f) + 2:].startswith("unit.")), None)
        r = {"file": f, "collected": len(cases), "ds_pass": 0, "both": 0, "refused": Counter(), "failing": [],
             "ds_other": Counter()}
        for k, (outcome, why) in cases.items():
            if outcome != "passed":
                r["ds_other"][outcome] += 1
                continue
            r["ds_pass"] += 1
            ours = rz.get(k) or whole or ["missing", "not run under ringzero"]
            if ours[0] == "passed":
                r["both"] += 1
            elif refusal(ours[1]):
                r["refused"][refusal(ours[1])] += 1
            else:
                r["failing"].append((k, ours[1]))
        out.append(r)
    return out


def markdown(rs: list[dict]) -> str:
    lines = ["| file | collected | pass under DeepSpeed (CPU) | pass under ringzero too | refused on purpose | failing |",
             "|---|---|---|---|---|---|"]
    for r in rs:
        lines.append(f"| {label(r['file'])} | {r['collected']} | {r['ds_pass']} | {r['both']} | "
                     f"{sum(r['refused'].values())} | {len(r['failing'])} |")
    t = {k: sum(r[k] if isinstance(r[k], int) else (sum(r[k].values()) if isinstance(r[k], Counter) else len(r[k]))
                for r in rs) for k in ("collected", "ds_pass", "both", "refused", "failing")}
    lines.append(f"| **all** | {t['collected']} | {t['ds_pass']} | {t['both']} | {t['refused']} | {t['failing']} |")
    return "\n".join(lines)


def reasons(rs: list[dict]) -> list[tuple[str, int]]:
    c = Counter()
    for r in rs:
        c.update(r["refused"])
    return c.most_common()


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--markdown", action="store_true", help="print markdown (for tests/ds_bulk/README.md)")
    ap.add_argument("--failing", action="store_true", help="list every failing case with ringzero's last line")
    a = ap.parse_args(argv)
    rs = rows(*load())
    if a.markdown:
        print(markdown(rs))
        print("\nRefusals (reason: cases):\n")
        print("\n".join(f"- {why}: {n}" for why, n in reasons(rs)))
        return
    from rich.console import Console
    from rich.markup import escape      # a reason may hold "[p]": text, not markup
    from rich.table import Table
    t = Table(title="DeepSpeed's tests/unit files: installed DeepSpeed 0.19.8 vs ringzero (CPU, gloo)")
    for col in ("file", "collected", "pass DeepSpeed", "pass ringzero too", "refused", "failing", "DeepSpeed itself"):
        t.add_column(col)
    for r in rs:
        t.add_row(label(r["file"]), str(r["collected"]), str(r["ds_pass"]), str(r["both"]), str(sum(r["refused"].values())),
                  str(len(r["failing"])), ", ".join(f"{n} {k}" for k, n in r["ds_other"].items()))
    con = Console(width=200)
    con.print(t)
    for why, n in reasons(rs):
        con.print(f"refused ×{n}: {escape(why)}")
    if a.failing:
        for r in rs:
            for k, why in r["failing"]:
                con.print(f"[red]failing[/] {escape(k)}: {escape(why[:220])}")


if __name__ == "__main__":
    main()
