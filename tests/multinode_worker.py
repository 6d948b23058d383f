"""Run under torchrun across the namespaced cluster (tests/test_multinode_launch.py):

    python -m multinode run -- torchrun --nnodes 2 --nproc_per_node 2 --node_rank '$NODE_RANK' \
        --master_addr '$MASTER_ADDR' --master_port '$MASTER_PORT' tests/multinode_worker.py [--die RANK]

Every collective × algorithm vs gloo's built-in over the real link, the per-link
ledger vs cost.link_traffic, and the launcher's topology vs the hostnames'. Prints
"MULTINODE CHECK OK" on rank 0, or every error and exits 1. --die R: rank R exits mid-run.
--zero2: ZeRO-2 across the nodes vs single-process AdamW, as tests/test_zero_parity.py does on one host.
"""
import argparse
import os
import sys

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import primitives as P  # noqa: E402
from multinode_util import checks_on_two_nodes  # noqa: E402
from primitives.launch import add_launch_args, init_from_env  # noqa: E402
from primitives.engine.topology import Topology, topology  # noqa: E402

ap = argparse.ArgumentParser()
add_launch_args(ap)
ap.add_argument("--die", type=int, default=-1)
ap.add_argument("--zero2", action="store_true", help="ZeRO-2 vs single-process AdamW (tests/test_zero_parity.py)")
args = ap.parse_args()
comm = init_from_env(args.backend, timeout=args.timeout)
if args.zero2:
    import test_zero_parity as Z   # the single-host parity test's model, data, reference and tolerance
    losses, norms, final, _ = Z._train(comm.rank, comm.size, 2, "primitives", 200)
    if comm.rank == 0:
        ref_losses, ref_norms, ref = Z.reference(comm.size)
        worst = max((torch.tensor(final[n]) - t).abs().max().item() for n, t in ref.items())
        ok = all(torch.allclose(torch.tensor(final[n]), t, atol=2e-5, rtol=1e-4) for n, t in ref.items())
        ok &= torch.allclose(torch.tensor(losses), torch.tensor(ref_losses[0]), rtol=1e-5)
        print(f"ZeRO-2 on {comm.size} ranks vs single-process AdamW: max |param diff| = {worst:.2e}", flush=True)
        if not ok:
            sys.exit(1)
        print("ZERO2 PARITY OK", flush=True)
    sys.exit(0)
if args.die >= 0:
    if comm.rank == args.die:
        print(f"rank {comm.rank}: exiting on purpose", flush=True)
        os._exit(3)
    P.all_reduce(torch.ones(1000))
    print(f"rank {comm.rank} finished an all-reduce without rank {args.die} (wrong)", flush=True)
    sys.exit(0)
errs, nodes, intra, inter, auto = checks_on_two_nodes(comm.rank, comm.size, local=None, numels=(1, 1001))
import collective_checks as C  # noqa: E402
e2, _ = C.matrix(comm, [1001], names=["broadcast", "reduce", "scatter", "gather"])   # the rest, once
errs += e2
by_host = Topology.from_hostnames(comm).nodes
if by_host != topology(comm).nodes:
    errs.append(f"rank {comm.rank}: hostnames say nodes {by_host}, LOCAL_WORLD_SIZE says {topology(comm).nodes}")
if auto != "hierarchical":
    errs.append(f"rank {comm.rank}: auto chose {auto} on {max(nodes) + 1} nodes")
everyone = [None] * comm.size
dist.all_gather_object(everyone, (errs, os.uname().nodename, nodes))   # reference plumbing only
if comm.rank == 0:
    all_errs = [e for es, _, _ in everyone for e in es]
    print("hosts by rank:", [h for _, h, _ in everyone], "nodes:", nodes, flush=True)
    if all_errs:
        print("\n".join(all_errs[:50]), flush=True)
        sys.exit(1)
    print(f"MULTINODE CHECK OK on {comm.size} ranks, {max(nodes) + 1} nodes", flush=True)
