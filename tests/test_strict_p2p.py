"""Strict point-to-point mode (primitives/engine/strict.py): nccl's ordering rules replayed over gloo.

1. The pattern the toolkit used before grouped exchanges (each rank posts irecv(peer), then
   isend(peer), ungrouped) is reported as a deadlock on every rank, naming both ranks and the
   operations, in a few seconds, never a hung test.
2. Every collective × algorithm (+ "auto"), all-to-all (single and list forms, even and
   uneven splits with empty blocks, with its count exchange and without the handshake), the
   check round, the DDP chapters and the ZeRO stages run under strict mode at N = 2, 3, 4 with
   the same results as gloo's built-in (every collective), the values every rank can
   recompute (all-to-all) or the non-strict run (ZeRO; bitwise: strict mode changes only when
   messages start, never the arithmetic).
"""
import time

import pytest
import torch

import primitives as P

import collective_checks as C


# ----------------------------------------------------------------------------- the old pattern

def _old_pattern(rank, n, kind):
    P.set_strict_p2p(True)
    comm = P.get_comm()
    t0 = time.monotonic()
    try:
        if kind == "ring":        # the old 2-rank ring step: prev == nxt
            a, b = torch.ones(100), torch.empty(100)
            nxt, prev = (rank + 1) % n, (rank - 1) % n
            rq = comm.irecv(b, prev)
            sq = comm.isend(a, nxt)
            rq.wait()
            sq.wait()
        else:                      # the old handshake: every irecv, then every isend
            mine, theirs = torch.full((9,), rank), torch.empty(n, 9, dtype=torch.int64)
            reqs = [comm.irecv(theirs[p], p) for p in range(n) if p != rank]
            reqs += [comm.isend(mine, p) for p in range(n) if p != rank]
            for r in reqs:
                r.wait()
        return "returned", time.monotonic() - t0
    except Exception as e:
        return f"{type(e).__name__}: {e}", time.monotonic() - t0


@pytest.mark.parametrize("n,kind", [(2, "ring"), (3, "handshake")])
def test_old_ungrouped_irecv_then_isend_is_reported_as_deadlock(n, kind):
    from primitives.launch import spawn
    res = spawn(_old_pattern, n, args=(kind,), comm_timeout=30, grace=15, allow_fail=True, timeout=90)
    for rank, (status, value) in enumerate(res):
        assert status == "ok", res
        msg, secs = value
        assert msg.startswith("StrictOrderError"), f"rank {rank}: {msg}"
        assert f"rank {rank}:" in msg and "deadlock" in msg and "irecv #0" in msg and "isend #0" in msg, msg
        assert "exchange" in msg and "batch_isend_irecv" in msg, "the message says how to fix it"
        assert secs < 10, f"rank {rank} took {secs:.1f}s: the deadlock must be found well before the 30 s deadline"


def _plain_p2p_is_fine(rank, n):
    """Sends and receives to different peers, and FIFO order per peer, are legal on nccl."""
    P.set_strict_p2p(True)
    comm = P.get_comm()
    nxt, prev = (rank + 1) % n, (rank - 1) % n
    out = torch.empty(3)
    reqs = [comm.isend(torch.full((3,), float(rank)), nxt), comm.irecv(out, prev)]
    for r in reqs:
        r.wait()
    a, b = torch.empty(2), torch.empty(2)
    if rank == 0:                  # two messages to one peer, received in posting order
        comm.send(torch.ones(2), 1)
        comm.send(torch.full((2,), 2.0), 1)
    elif rank == 1:
        ra, rb = comm.irecv(a, 0), comm.irecv(b, 0)
        rb.wait()
        ra.wait()
    return out.tolist(), a.tolist(), b.tolist()


def test_legal_orders_pass(spawn):
    res = spawn(_plain_p2p_is_fine, 3)
    for rank, (out, a, b) in enumerate(res):
        assert out == [float((rank - 1) % 3)] * 3
        if rank == 1:
            assert a == [1.0, 1.0] and b == [2.0, 2.0]


# ----------------------------------------------------------------------------- everything, strict

def _split(p, n, uneven):
    """Rows rank p sends to each rank: uneven with empty blocks, or 2 each."""
    return [(p + q) % 3 for q in range(n)] if uneven else [2] * n


def _a2a_input(p, n, uneven):
    """Rank p's all-to-all input, (rows, 3): block q holds 1000·p + 100·q + 0, 1, 2, ..."""
    return torch.cat([torch.arange(k * 3, dtype=torch.float32).view(k, 3) + 1000 * p + 100 * q
                      for q, k in enumerate(_split(p, n, uneven))])


def _all_to_all_strict(rank, n):
    """all_to_all_single and all_to_all × algorithm × even/uneven × handshake on (the count
    exchange runs) and off; the expected blocks are recomputed from every rank's input."""
    errs = []
    for handshake in (True, False):
        P.set_handshake(handshake)
        for algo in ("linear", "pairwise", "auto"):
            for uneven in (False, True):
                tag = f"all_to_all N={n} rank={rank} algo={algo} uneven={uneven} handshake={handshake}"
                want = [_a2a_input(p, n, uneven).split(_split(p, n, uneven))[rank] for p in range(n)]
                outs = [_split(p, n, uneven)[rank] for p in range(n)]
                y = torch.full((sum(outs), 3), -1.0)
                P.all_to_all_single(y, _a2a_input(rank, n, uneven), outs, _split(rank, n, uneven), algorithm=algo)
                if not torch.equal(y, torch.cat(want)):
                    errs.append(f"{tag} single: wrong blocks")
                got = [torch.full_like(w, -1.0) for w in want]
                P.all_to_all(got, list(_a2a_input(rank, n, uneven).split(_split(rank, n, uneven))), algorithm=algo)
                if not all(torch.equal(g, w) for g, w in zip(got, want)):
                    errs.append(f"{tag} list: wrong blocks")
    P.set_handshake(True)
    return errs


def _everything_strict(rank, n):
    P.set_strict_p2p(True)
    comm = P.get_comm()
    assert comm.strict
    errs, cases = C.matrix(comm, [2 * n + 1])     # ragged chunks; sizes are covered without strict mode
    errs += _all_to_all_strict(rank, n)
    # the DDP chapters 2-4 (chapter 5 is torch's DDP), against the single-process run in the test
    from ddp_examples.engine.common import Config, build_model, train
    import importlib
    cfg = Config(steps=3, bucket_cap_mb=0.004)
    ddp = {}
    for ch in ("02_naive", "03_flat", "04_bucketed"):
        model = importlib.import_module(f"ddp_examples.{ch}").wrap(build_model(cfg), cfg)
        ddp[ch] = [p.tolist() for p in train(model, cfg, rank, n).params]
    return errs, {k: v["digest"] for k, v in cases.items() if k[0] == "all_reduce"}, ddp


@pytest.mark.parametrize("n", [2, 3, 4])
def test_every_collective_algorithm_and_ddp_chapter_under_strict_mode(spawn, n):
    """C.matrix covers every collective but all-to-all, whose splits are another axis: it runs
    in _all_to_all_strict (both forms, both algorithms and auto, with and without the count exchange)."""
    from ddp_examples.engine.common import Config, reference
    res = spawn(_everything_strict, n, comm_timeout=30)
    errs = [e for r in res for e in r[0]]
    assert not errs, "\n".join(errs[:10])
    for key in res[0][1]:
        assert len({r[1][key] for r in res}) == 1, f"{key}: ranks differ bitwise"
    ref = reference(Config(steps=3, bucket_cap_mb=0.004)).params
    for rank, (_, _, ddp) in enumerate(res):
        for ch, params in ddp.items():
            d = max((torch.tensor(p) - q).abs().max().item() for p, q in zip(params, ref))
            assert d < 1e-5, f"{ch} rank {rank}: max |param - single process| = {d:.2e}"   # test_ddp.py's TOL


# ----------------------------------------------------------------------------- ZeRO, public API only

def _zero_strict(rank, n):
    import torch.nn as nn
    import zero_from_scratch
    out = {}
    for strict in (False, True):
        P.set_strict_p2p(strict)
        for stage in (1, 2, 3):
            torch.manual_seed(0)
            model = nn.Sequential(nn.Linear(6, 8), nn.GELU(), nn.Linear(8, 3))
            cfg = {"train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 1,
                   "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}}, "zero_optimization": {"stage": stage}}
            engine, *_ = zero_from_scratch.initialize(model=model, model_parameters=model.parameters(), config=cfg)
            losses = []
            for step in range(3):
                g = torch.Generator().manual_seed(100 * step + rank)
                x, y = torch.randn(4, 6, generator=g), torch.randint(0, 3, (4,), generator=g)
                loss = nn.functional.cross_entropy(engine(x), y)
                engine.backward(loss)
                engine.step()
                losses.append(loss.item())
            out[(strict, stage)] = losses
    return out


def test_zero_stages_under_strict_mode(spawn):
    res = spawn(_zero_strict, 2, comm_timeout=30)
    for rank, out in enumerate(res):
        for stage in (1, 2, 3):
            assert out[(True, stage)] == out[(False, stage)], f"rank {rank} stage {stage}: {out}"
