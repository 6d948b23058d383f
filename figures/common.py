"""What every figure shares: where PNGs go, the machine/version stamp, and the metadata that
lets a test prove a PNG was drawn by the script that claims it.

    python -m figures            # every figure
    python -m figures ch04_zero_memory ch07_lr_loss
    RINGZERO_FIGURES_DIR=/tmp/figs python -m figures     # draw elsewhere (tests/test_figures.py)

Each PNG carries tEXt chunks: Source (the module that drew it), Command (how to redraw it),
Machine and Versions (where the numbers came from) and Date. tests/test_figures.py reads them back.
"""
from __future__ import annotations

import datetime as _dt
import os
import platform
import struct
import zlib

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
IMG = os.environ.get("RINGZERO_FIGURES_DIR") or os.path.join(ROOT, "tutorials", "img")


def machine() -> str:
    mem = ""
    try:
        with open("/proc/meminfo") as f:
            kib = int(f.readline().split()[1])
        mem = f", {kib / 2**20:.0f} GiB"
    except (OSError, ValueError, IndexError):
        pass
    return f"{os.cpu_count()} CPU cores{mem}, {platform.machine()}, Python {platform.python_version()}"


def versions() -> str:
    out = [f"torch {torch.__version__}"]
    for mod in ("deepspeed", "transformers", "matplotlib"):
        try:
            out.append(f"{mod} {__import__(mod).__version__}")
        except Exception:
            pass
    return ", ".join(out)


def stamp() -> str:
    return f"{machine()}; {versions()}; {_dt.date.today().isoformat()}"


def pyplot():
    import matplotlib   # optional dependency: the `figures` extra
    matplotlib.use("Agg")  # files only: no display here or in CI
    import matplotlib.pyplot as plt   # after use("Agg"): the backend is chosen before pyplot loads
    return plt


def save(fig, name: str, source: str, note: str = "") -> str:
    """Write tutorials/img/<name>.png with the stamp as a footer and as PNG metadata."""
    os.makedirs(IMG, exist_ok=True)
    fig.tight_layout()
    footer = (note + "\n" if note else "") + f"python -m {source}  ·  {stamp()}"
    fig.text(0.01, -0.01, footer, fontsize=6.5, color="0.35", ha="left", va="top")  # below the axes
    path = os.path.join(IMG, f"{name}.png")
    tmp = path + ".tmp"
    meta = {"Software": "ringzero figures", "Source": source, "Command": f"python -m {source}",
            "Machine": machine(), "Versions": versions(), "Date": _dt.date.today().isoformat()}
    fig.savefig(tmp, dpi=110, format="png", metadata=meta, bbox_inches="tight")
    os.replace(tmp, path)   # never a half-written picture in the tutorials
    pyplot().close(fig)
    return path


def read_meta(path: str) -> dict:
    """The tEXt chunks of a PNG (no PIL needed)."""
    out = {}
    with open(path, "rb") as f:
        if f.read(8) != b"\x89PNG\r\n\x1a\n":
            raise ValueError(f"{path} is not a PNG")
        while True:
            head = f.read(8)
            if len(head) < 8:
                break
            n, kind = struct.unpack(">I4s", head)
            body = f.read(n)
            f.read(4)
            if kind == b"tEXt":
                k, _, v = body.partition(b"\0")
                out[k.decode("latin-1")] = v.decode("latin-1")
            elif kind == b"zTXt":
                k, _, v = body.partition(b"\0")
                out[k.decode("latin-1")] = zlib.decompress(v[1:]).decode("latin-1")
            elif kind == b"iTXt":
                k, _, rest = body.partition(b"\0")
                flag, _method, rest = rest[0], rest[1], rest[2:]
                _lang, _, rest = rest.partition(b"\0")
                _tk, _, text = rest.partition(b"\0")
                out[k.decode("latin-1")] = (zlib.decompress(text) if flag else text).decode("utf-8")
            elif kind == b"IEND":
                break
    return out
