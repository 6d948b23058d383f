"""python -m planner MODEL --gpus N [--gpus-per-node G] [--hardware h100|a100|a100-40g|cpu-here|cpu-now|FILE]
                     [--seq S] [--global-batch B] [--json FILE] [--plot FILE] [--fix tp=8,pp=2]

Predicts, for every layout of MODEL on N accelerators, the peak memory per GPU and the step time,
each split into its terms; drops the layouts that do not fit; prints the best first.
MODEL: a preset (python -m planner --list), a Hugging Face config.json (or its folder), a hub name
(org/name, read by transformers.AutoConfig from the hub or its cache), or
`custom` with --layers --hidden --heads --vocab. Cost: enumerating and predicting ~10⁴ layouts,
a few seconds for a 70 B model on 512 GPUs.
"""
from __future__ import annotations

import argparse
import os
import re
import sys
import time
from dataclasses import replace

from primitives.log import console

from planner import hardware as H
from planner.layout import check_fixed, why_none
from planner.model import PRESETS, resolve
from planner.plan import host_apart, plan
from planner.report import picture, table, write_json
from planner.steptime import Software


def parse_fixed(text: str | None) -> dict:
    """--fix "tp=8,pp=2,zero=1,recompute=full,sp=true": each field once, a Layout's, of its kind."""
    out = {}
    for kv in filter(None, (s.strip() for s in (text or "").split(","))):
        k, eq, v = (s.strip() for s in kv.partition("="))
        if not eq or not v:
            raise ValueError(f"--fix {kv!r}: expected FIELD=VALUE, e.g. tp=8")
        if k in out:
            raise ValueError(f"--fix: {k} is given twice")
        out[k] = v == "true" if v in ("true", "false") else (int(v) if re.fullmatch(r"[+-]?[0-9]+", v) else v)
    try:
        check_fixed(out)
    except ValueError as e:
        raise ValueError(f"--fix {text!r}: {e}") from e
    return out


def positive(text: str) -> int:
    """argparse type: an integer ≥ 1."""
    try:
        n = int(text)
    except ValueError:
        n = 0
    if n < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}")
    return n


def writable(ap, flag: str, path: str | None) -> None:
    """Refuse an output path that is a folder or whose folder is missing, before any work is done;
    for --plot also a format matplotlib cannot write."""
    if not path:
        return
    folder = os.path.dirname(os.path.abspath(path))
    if os.path.isdir(path) or not (os.path.isdir(folder) and os.access(folder, os.W_OK)):
        ap.error(f"{flag} {path}: expected a file in a writable folder")
    if flag == "--plot":
        try:
            from matplotlib.figure import Figure      # only when a picture is asked for
        except ImportError:
            ap.error("--plot needs matplotlib, an optional extra: pip install -e '.[figures]'")
        kinds = Figure().canvas.get_supported_filetypes()
        if (ext := os.path.splitext(path)[1][1:].lower() or "png") not in kinds:
            ap.error(f"--plot {path}: matplotlib cannot write .{ext}; one of {', '.join(sorted(kinds))}")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m planner", description=__doc__.split("\n\n")[1],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("model", nargs="?", help="preset, config.json (or its folder), hub name org/name, or 'custom'")
    ap.add_argument("--gpus", type=positive, help="accelerators in all")
    ap.add_argument("--gpus-per-node", type=positive, help="override the hardware's node size")
    ap.add_argument("--hardware", default="h100")
    ap.add_argument("--seq", type=positive, help="sequence length (default: the model's)")
    ap.add_argument("--global-batch", type=positive, help="sequences per optimizer step (default 2 × gpus)")
    for k in ("layers", "hidden", "heads", "vocab", "ffn", "kv-heads"):
        ap.add_argument(f"--{k}", type=positive)
    ap.add_argument("--top", type=positive, default=15, help="rows to print")
    ap.add_argument("--fix", help="pin layout fields, e.g. tp=8,pp=2,zero=1,recompute=full")
    ap.add_argument("--no-overlap", action="store_true", help="expose all communication (no engine overlap)")
    ap.add_argument("--all", action="store_true", help="keep layouts that do not fit (in --json too)")
    ap.add_argument("--json", help="write every layout with its terms to this file")
    ap.add_argument("--plot", help="write one stacked bar per layout to this PNG")
    ap.add_argument("--list", action="store_true", help="list the presets and hardware")
    a = ap.parse_args(argv)
    if a.list:
        for m in PRESETS.values():
            console.print(f"{m.name:12s} L={m.layers:<4d} h={m.hidden:<6d} a={m.heads:<4d} V={m.vocab:<7d} "
                          f"{m.params() / 1e9:8.2f} B  [dim]{m.source}[/dim]")
        console.print("hardware: " + ", ".join([*H.BUILTIN, "cpu-here", "cpu-now", "FILE.json"]))
        return 0
    if not a.model or a.gpus is None:
        ap.error("MODEL and --gpus are required (or --list)")
    writable(ap, "--json", a.json)
    writable(ap, "--plot", a.plot)
    t0 = time.perf_counter()
    try:
        fixed = parse_fixed(a.fix)
        model = resolve(a.model, layers=a.layers, hidden=a.hidden, heads=a.heads, vocab=a.vocab, ffn=a.ffn,
                        kv_heads=a.kv_heads, seq=a.seq)
        hw = H.load(a.hardware, min(a.gpus, a.gpus_per_node or 8))
    except ValueError as e:
        console.print(f"[red]{e}[/red]")
        return 2
    if a.gpus_per_node:
        hw = replace(hw, gpus_per_node=a.gpus_per_node)
    seq = a.seq or model.seq
    batch = a.global_batch or 2 * a.gpus
    sw = Software(False, False, False) if a.no_overlap else Software()
    preds = plan(model, a.gpus, hw, seq, batch, sw, fixed=fixed, keep_all=True)
    elapsed = time.perf_counter() - t0
    fits = [p for p in preds if p.fits]
    if not preds:
        per_node = min(hw.gpus_per_node, a.gpus)
        why = why_none(model, a.gpus, per_node, batch, host_apart(hw), fixed)
        console.print(f"[red]no layout of {model.name} is legal on {a.gpus} GPUs ({per_node} per node) at global batch "
                      f"{batch}{f' with --fix {a.fix}' if a.fix else ''}{f': {why}' if why else ''}[/red]")
    elif not fits:
        console.print(f"[red]no layout of {model.name} fits {a.gpus} × {hw.name} "
                      f"({hw.memory / 2**30:.0f} GiB each) at global batch {batch}[/red]")
    else:
        console.print(table(fits, model, hw, a.gpus, seq, batch, a.top))
    console.print(f"{len(preds)} layouts predicted in {elapsed:.2f} s, {len(fits)} fit; times in seconds; compute at "
                  f"{hw.gemm_efficiency:.0%} of {hw.peak_flops / 1e12:,.3g} TFLOP/s ({hw.calibrated_on or 'fitted here'})")
    preds = preds if a.all else fits
    if a.json:
        write_json(a.json, preds, model, hw, a.gpus, seq, batch)
        console.print(f"wrote {a.json}")
    if a.plot and fits:
        picture(a.plot, fits, f"{model.name} on {a.gpus} × {hw.name}: step-time and memory terms of the best layouts")
        console.print(f"wrote {a.plot}")
    elif a.plot:
        console.print(f"[yellow]--plot {a.plot}: not written, no layout fits to draw[/yellow]")
    return 0 if fits else 1


if __name__ == "__main__":
    sys.exit(main())
