"""python -m multinode up|down|status|run — a multi-node cluster on one machine.

    python -m multinode up --nodes 2 --link-mbit 400     # namespaces NAME-n0.., a shaped link
    python -m multinode status                           # hosts, addresses, rate, ping-pong
    python -m multinode run -- torchrun --nnodes 2 --nproc_per_node 2 --node_rank '$NODE_RANK' \\
        --master_addr '$MASTER_ADDR' --master_port '$MASTER_PORT' primitives/allreduce.py
    python -m multinode down                             # idempotent

Every subcommand takes --name (default rz) so several clusters can coexist.
"""
from __future__ import annotations

import argparse
import sys

from rich.console import Console
from rich.table import Table

from multinode import cluster as C
from multinode.pingpong import measure as pp
from multinode.run import add_args, run_from_args

console = Console(stderr=True)


def status(name: str, measure: bool = True) -> C.Cluster:
    c = C.load(name)
    if measure:
        c.pingpong = {"inter": pp(c.ns(1), c.ns(0), c.addrs[1]),       # node 0 -> node 1, the shaped link
                      "intra": pp(c.ns(0), c.ns(0), "127.0.0.1")}     # inside node 0: loopback
        c.save()
    t = Table(title=f"cluster {c.name}: {c.nodes} nodes, link {c.link_mbit:g} Mbit/s per node (tbf)")
    for col in ("node", "namespace / hostname", "address", "interface", "tc rate"):
        t.add_column(col)
    for i in range(c.nodes):
        t.add_row(str(i), c.ns(i), c.addrs[i], C.IFNAME, C.tc_rate(c, i))
    console.print(t)
    if c.pingpong:
        m = Table(title="TCP ping-pong (one-way t = α + S·β, fitted over 8 B … 4 MiB)")
        for col in ("link", "α latency", "bandwidth 1/β", "4 MiB one-way"):
            m.add_column(col, justify="right")
        for link, what in (("inter", "node 0 ↔ node 1"), ("intra", "node 0 loopback")):
            f = c.pingpong[link]
            m.add_row(what, f"{f['alpha_s'] * 1e6:.0f} µs", f"{f['mbit_per_s']:.0f} Mbit/s",
                      f"{dict((int(s), t) for s, t in f['points'])[4 << 20] * 1e3:.1f} ms")
        console.print(m)
    return c


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m multinode", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    for cmd in ("up", "down", "status", "run"):
        p = sub.add_parser(cmd)
        p.add_argument("--name", default="rz", help="cluster name, prefixes its namespaces (default rz)")
        if cmd == "up":
            p.add_argument("--nodes", type=int, default=2)
            p.add_argument("--link-mbit", type=float, default=400.0, help="per-node link rate, Mbit/s (tbf)")
        if cmd == "status":
            p.add_argument("--no-measure", action="store_true", help="skip the ping-pong")
        if cmd == "run":
            add_args(p)
    args = ap.parse_args(argv)
    try:
        if args.cmd == "up":
            c = C.up(args.nodes, args.link_mbit, args.name)
            console.print(f"[green]cluster {c.name} up[/]: nodes {', '.join(c.hostnames)} at "
                          f"{', '.join(c.addrs)}, {c.link_mbit:g} Mbit/s; MASTER_ADDR={c.master_addr}")
        elif args.cmd == "down":
            removed = C.down(args.name)
            console.print(f"cluster {args.name} down: removed {', '.join(removed) if removed else 'nothing (not up)'}")
        elif args.cmd == "status":
            status(args.name, measure=not args.no_measure)
        else:
            return run_from_args(args)
    except C.ClusterError as e:
        console.print(f"[red]error:[/] {e}")
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
