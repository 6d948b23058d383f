"""DeepSpeed's DistributedTest, replaced: run bodies in its test style on N ranks under either `deepspeed`.

    python -m tests.ds_unit.harness [--all] [BODY_ID ...]      (both engines, then the comparison table)

run_rank(rank, world, engine, ids, tmp) is spawned on N fresh ranks (primitives.launch.spawn).
engine "deepspeed": the installed DeepSpeed (its shm op marked incompatible so it is not JIT-built:
it serves only inference_all_reduce); engine "ringzero": zero_from_scratch.as_deepspeed's finder is
installed first, so every `import deepspeed` in the bodies resolves to ringzero, as under
`python -m zero_from_scratch.as_deepspeed`. Then, as DistributedTest._dist_run: deepspeed.init_distributed()
over the group spawn started, and each body runs with fresh seeds (the same on both engines and every
rank), a shared tmpdir, LOCAL_SIZE = world size (as DistributedTest sets it), and its parameters. pytest.skip inside a body is recorded as a skip.
What a body computes is recorded by wrapping deepspeed.initialize (harness only, bodies untouched):
each engine.backward(loss) and train_batch() appends the loss; each load_checkpoint() appends the
loaded module's parameter sums (gathered with zero.GatheredParameters where ZeRO-3 partitioned them).
compare() puts the two engines' records side by side; TOLERANCE says how close they must be.
Cost: one DeepSpeed import per rank and engine, then each body's own.
"""
from __future__ import annotations

import importlib
import inspect
import os
import random
import sys
import tempfile
import time
import traceback

import numpy
import torch

# relative tolerance on each recorded value. fp32: both engines run the same torch kernels on the
# same data; what differs is the order of the gradient reduction (gloo's ring vs ringzero's
# algorithms) and Adam's arithmetic (DeepSpeed's fused C++ Adam vs torch's): ~1e-7 relative per step,
# so 1e-5 leaves two orders of magnitude for growth over a body's steps. bf16: the parameters are
# rounded to 8 significant bits after each step, so one fp32 master differing in its last bits can
# move a weight by one bf16 ulp (2^-8 = 3.9e-3 relative); 1e-2 allows two such ulps in a loss.
TOLERANCE = {"fp32": 1e-5, "bf16": 1e-2, "exact": 0.0}
SEED = 1234
ENGINES = ("deepspeed", "ringzero")


class Body:
    """One ported body: `module:function`, its parameters, the ranks it needs, its TOLERANCE key."""

    def __init__(self, target: str, world: int = 2, tol: str = "fp32", quick: bool = False, **params):
        self.target, self.world, self.tol, self.quick, self.params = target, world, tol, quick, params
        suffix = "-".join(f"{k}={str(v).replace('torch.', '')}" for k, v in params.items())
        self.id = target.rpartition(".")[2].replace(":", ".") + (f"[{suffix}]" if suffix else "")

    def function(self):
        mod, _, fn = self.target.partition(":")
        return getattr(importlib.import_module(f"tests.ds_unit.{mod}"), fn)


RECORD: list = []


def _gathered_sums(ds, module) -> list[float]:
    params = list(module.parameters())
    zero3 = [p for p in params if hasattr(p, "ds_id")]
    with ds.zero.GatheredParameters(zero3, enabled=bool(zero3)):
        return [p.detach().float().sum().item() for p in params]


def _wrap_engine(ds, engine) -> None:
    def wrap(name, after):
        orig = getattr(engine, name, None)
        if orig is None:
            return

        def wrapped(*args, **kwargs):
            out = orig(*args, **kwargs)
            after(args, kwargs, out)
            return out
        setattr(engine, name, wrapped)

    loss_of = lambda t: float(t.detach().float().item()) if torch.is_tensor(t) and t.numel() == 1 else None  # noqa
    wrap("backward", lambda a, k, out: RECORD.append(("loss", loss_of(a[0] if a else k["loss"]))))
    wrap("train_batch", lambda a, k, out: RECORD.append(("train_batch", loss_of(out))))
    wrap("load_checkpoint", lambda a, k, out: RECORD.append(("loaded", _gathered_sums(ds, engine.module))))


def install_recorder(ds) -> None:
    """Wrap ds.initialize so that every engine a body builds records its losses and loaded values."""
    orig = ds.initialize

    def initialize(*args, **kwargs):
        out = orig(*args, **kwargs)
        _wrap_engine(ds, out[0])
        return out
    ds.initialize = initialize


def import_deepspeed(engine: str):
    if engine == "ringzero":
        from zero_from_scratch.as_deepspeed import finder   # only the ringzero ranks install the finder
        finder.install()
    else:
        from parity.zero.sides import prepare_deepspeed   # imports the real DeepSpeed: that rank only
        prepare_deepspeed()
    return importlib.import_module("deepspeed")


def run_rank(rank: int, world: int, engine: str, ids: list[str], tmp: str) -> dict:
    """Every body in `ids` on this rank under `engine`: id → ("ok", records) | ("skip", why) | ("error", tb).
    The first error ends the run: the ranks may be out of step in their collectives after it."""
    from _pytest.outcomes import Skipped   # pytest's skip exception, raised by pytest.skip inside a body
    os.environ["LOCAL_SIZE"] = str(world)  # as DistributedTest._dist_run sets it (the cpu accelerator's device_count)
    ds = import_deepspeed(engine)
    ds.init_distributed(dist_backend="gloo")
    install_recorder(ds)
    by_id = {b.id: b for b in selection()}
    out = {}
    for bid in ids:
        body = by_id[bid]
        RECORD.clear()
        random.seed(SEED)
        numpy.random.seed(SEED)
        torch.manual_seed(SEED)
        tmpdir = os.path.join(tmp, bid.replace("/", "_"))
        os.makedirs(tmpdir, exist_ok=True)
        fn = body.function()
        kwargs = dict(body.params)
        if "tmpdir" in inspect.signature(fn).parameters:
            kwargs["tmpdir"] = tmpdir
        try:
            fn(**kwargs)
            out[bid] = ("ok", list(RECORD))
        except Skipped as e:
            out[bid] = ("skip", str(e))
        except BaseException:
            out[bid] = ("error", traceback.format_exc())
            break
    return out


def selection() -> list[Body]:
    from tests.ds_unit.selection import BODIES, GAPS, REFUSED   # the table of bodies, kept beside the bodies
    return BODIES + [b for b, _ in REFUSED] + GAPS


def _close(a, b, rel) -> bool:
    if a is None or b is None:
        return a is b
    return abs(a - b) <= rel * max(abs(a), abs(b), 1e-30)


def compare(ref: tuple, ours: tuple, tol: str) -> list[str]:
    """What differs between DeepSpeed's run of one body on one rank and ringzero's ([] = equal)."""
    if ref[0] != "ok" or ours[0] != "ok":
        return [] if ref[0] == ours[0] == "skip" else [f"status deepspeed={ref[0]} ringzero={ours[0]}: "
                                                        f"{str(ours[1] if ours[0] != 'ok' else ref[1])[-1500:]}"]
    rel, bad = TOLERANCE[tol], []
    if [k for k, _ in ref[1]] != [k for k, _ in ours[1]]:
        return [f"records differ: deepspeed {[k for k, _ in ref[1]]} vs ringzero {[k for k, _ in ours[1]]}"]
    for i, ((kind, a), (_, b)) in enumerate(zip(ref[1], ours[1])):
        pairs = zip(a, b) if isinstance(a, list) else [(a, b)]
        if isinstance(a, list) and len(a) != len(b):
            bad.append(f"#{i} {kind}: {len(a)} values vs {len(b)}")
        elif not all(_close(x, y, rel) for x, y in pairs):
            bad.append(f"#{i} {kind}: deepspeed {a} vs ringzero {b} (rel {rel})")
    return bad


def max_rel_diff(ref: tuple, ours: tuple) -> float:
    """The largest relative difference over the values both engines recorded (0 if none)."""
    if not ref[0] == ours[0] == "ok":
        return 0.0
    vals = [(x, y) for (_, a), (_, c) in zip(ref[1], ours[1])
            for x, y in (zip(a, c) if isinstance(a, list) else [(a, c)]) if x is not None and y is not None]
    return max((abs(x - y) / max(abs(x), abs(y), 1e-30) for x, y in vals), default=0.0)


def run_both(bodies: list[Body], timeout: float = 600.0) -> dict:
    """Each body on its world size under both engines: {(id, rank): (deepspeed record, ringzero record)}."""
    from primitives.launch import spawn   # the one spawn helper; only this entry point needs it
    results = {}
    # pipeline bodies get processes of their own: DeepSpeed's pipeline engine leaves global state
    # (its mpu) that a ZeRO engine built later in the same process trips on; upstream runs each test fresh
    for world, pipe in sorted({(b.world, b.target.startswith("pipe_")) for b in bodies}):
        ids = [b.id for b in bodies if (b.world, b.target.startswith("pipe_")) == (world, pipe)]
        with tempfile.TemporaryDirectory(prefix="ds_unit-") as tmp:
            per = {e: _timed(e, world, spawn,run_rank, world, args=(e, ids, os.path.join(tmp, e)), timeout=timeout,
                            comm_timeout=300.0) for e in ENGINES}
        for bid in ids:
            for r in range(world):
                results[(bid, r)] = tuple(per[e][r].get(bid, ("not run", "an earlier body failed")) for e in ENGINES)
    return results


def _timed(engine, world, fn, *args, **kwargs):
    t0 = time.perf_counter()
    out = fn(*args, **kwargs)
    print(f"[ds_unit] {engine} on {world} ranks: {time.perf_counter() - t0:.1f} s", file=sys.stderr)
    return out


def main(argv: list[str]) -> int:
    from rich.console import Console   # terminal output of the command line only
    from rich.table import Table
    bodies = selection()
    if argv[:1] in (["-h"], ["--help"]):
        print("usage: python -m tests.ds_unit.harness [--all | BODY ...]  (no argument: the quick subset)")
        return 0
    if argv and argv[0] != "--all":
        unknown = [a for a in argv if not any(a in (b.id, b.id.split(".", 1)[1].split("[")[0]) for b in bodies)]
        if unknown:
            raise SystemExit(f"unknown bodies {unknown}; known: {sorted({b.id for b in bodies})}")
        bodies = [b for b in bodies if b.id in argv or b.id.split(".", 1)[1].split("[")[0] in argv]
    elif not argv:
        bodies = [b for b in bodies if b.quick]
    res = run_both(bodies)
    t = Table(title=f"DeepSpeed unit-test bodies: deepspeed vs ringzero (torch {torch.__version__})")
    for c in ("body", "rank", "deepspeed", "ringzero", "records", "max rel diff", "verdict"):
        t.add_column(c)
    failed, errors = 0, []
    for b in bodies:
        for r in range(b.world):
            ref, ours = res[(b.id, r)]
            bad = compare(ref, ours, b.tol)
            diff = max_rel_diff(ref, ours)
            failed += bool(bad)
            errors += [f"--- {b.id} rank {r} {e}:\n{rec[1]}" for e, rec in zip(ENGINES, (ref, ours)) if rec[0] == "error"]
            t.add_row(b.id, str(r), ref[0], ours[0], str(len(ref[1]) if ref[0] == "ok" else "-"), f"{diff:.1e}",
                      "equal" if not bad else "; ".join(x.strip().splitlines()[-1] for x in bad)[:200])
    print("\n".join(errors), file=sys.stderr)
    Console(width=200).print(t)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
