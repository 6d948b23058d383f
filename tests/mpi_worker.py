"""The collective checks under MPI: every collective × algorithm against mpi4py's built-ins.

    mpiexec -n 4 python tests/mpi_worker.py            correctness + ledger (exit 1 on any mismatch)
    mpiexec -n 3 python tests/mpi_worker.py --bad      bad input must raise CollectiveError on every rank

Run by tests/test_mpi.py. Each rank checks its own results (tests/collective_checks.py); rank 0
then collects every rank's errors, all-reduce digests and traffic counts (mpi4py's object
allgather: reference plumbing only, not the code under test) and checks what needs every rank.
"""
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import collective_checks as C  # noqa: E402
import primitives as P  # noqa: E402
from primitives.launch import init_from_env  # noqa: E402


def correctness(comm) -> list[str]:
    n = comm.size
    errs, cases = [], {}
    plans = [  # (dtype, ops, numels, names): mpi4py reduces numpy buffers, so no fp16/bf16 reductions
        (torch.int64, ("sum",), [0, 1, 2 * n + 1, 10007], None),
        (torch.int64, ("product", "min", "max"), [2 * n + 1], None),
        (torch.int32, ("sum", "max"), [2 * n + 1], None),
        (torch.float32, ("sum", "product", "min", "max", "avg"), [37], None),
        (torch.float64, ("sum", "avg"), [37], None),
        (torch.float16, ("sum",), [37], ["broadcast", "all_gather", "all_gather_single", "scatter", "gather"]),
        (torch.bfloat16, ("sum",), [37], ["broadcast", "all_gather", "all_gather_single", "scatter", "gather"]),
    ]
    for i, (dtype, ops, numels, names) in enumerate(plans):
        e, c = C.matrix(comm, numels, dtype=dtype, ops=ops, names=names, seed=100 * i,
                        local=comm.intra_node().size)   # multinode: ranks per host
        errs += e
        cases.update({(str(dtype),) + k: v for k, v in c.items()})
    e, c = C.matrix(comm, [15], layouts=("strided", "transposed"), seed=999, local=comm.intra_node().size)
    errs += e
    everyone = comm.mpi.allgather((errs, cases))
    if comm.rank != 0:
        return []
    out = [e for errs_r, _ in everyone for e in errs_r]
    for key, info in everyone[0][1].items():
        dtype = getattr(torch, key[0].replace("torch.", ""))
        name, algo, numel, op, layout, root = key[1:]
        infos = [ev[1][key] for ev in everyone]
        if name == "all_reduce" and len({i["digest"] for i in infos}) != 1:
            out.append(f"{key}: ranks hold different all-reduce results (bitwise)")
        out += C.traffic_identities(name, infos[0]["algorithm"], n, numel,
                                    torch.empty(0, dtype=dtype).element_size(), root,
                                    [i["counts"] for i in infos])
    return out


def bad_input(comm) -> list[str]:
    r, n = comm.rank, comm.size
    cases = [
        ("sizes differ", lambda: P.all_reduce(torch.ones(4 + (r == 1))), ["disagree", "rank 1"]),
        ("src out of range", lambda: P.broadcast(torch.ones(3), n), ["'src'", "not a rank"]),
        ("bad list on dst only", lambda: P.gather(torch.ones(3), [torch.ones(3)] if r == 0 else None, 0),
         ["rank 0", "'gather_list'", f"list of {n} tensors"]),
    ]
    errs = []
    for label, call, words in cases:
        try:
            call()
            errs.append(f"[{label}] rank {r}: no error")
        except P.CollectiveError as e:
            missing = [w for w in [f"rank {r}"] + words if w not in str(e)]
            if missing:
                errs.append(f"[{label}] rank {r}: message lacks {missing}: {e}")
    x = torch.full((3,), float(r))
    P.all_reduce(x)                                # still usable afterwards
    if x.tolist() != [float(sum(range(n)))] * 3:
        errs.append(f"rank {r}: communicator broken after the errors: {x.tolist()}")
    everyone = comm.mpi.allgather(errs)
    return [e for es in everyone for e in es] if r == 0 else []


def main():
    comm = init_from_env("mpi", timeout=float(os.environ.get("RINGZERO_TIMEOUT", "30")))
    assert comm.backend == "mpi" and comm.size == int(os.environ.get("PMI_SIZE", comm.size))
    errs = bad_input(comm) if "--bad" in sys.argv else correctness(comm)
    if comm.rank == 0:
        if errs:
            print(f"MPI CHECK FAILED on {comm.size} ranks: {len(errs)} problems", flush=True)
            for e in errs[:40]:
                print("  " + e, flush=True)
        else:
            print(f"MPI CHECK OK on {comm.size} ranks ({'bad input' if '--bad' in sys.argv else 'correctness + ledger'})",
                  flush=True)
    # rank 0 decides the exit code for everyone (the others only know their own errors)
    code = comm.mpi.bcast(1 if errs else 0, root=0)
    sys.exit(code)


if __name__ == "__main__":
    main()
