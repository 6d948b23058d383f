"""An ssh stand-in for MPICH's hydra: `rsh.py [options] HOST COMMAND...` runs COMMAND in the
namespace of the cluster node whose address or hostname is HOST (no ssh daemon needed).

    mpiexec -launcher ssh -launcher-exec "$RINGZERO_RSH" -hosts 10.77.0.1,10.77.0.2 -ppn 2 -n 4 ...

`python -m multinode run` puts RINGZERO_RSH in every node's environment (a one-line wrapper
script around this file). Hydra starts one proxy per host through it; the proxies then talk to
mpiexec and to each other over the shaped link, as over a real network.
"""
from __future__ import annotations

import json
import os
import sys


def main(argv) -> int:
    args = list(argv)
    if args[:1] in (["-h"], ["--help"]):
        print(__doc__.split("\n\n")[0].replace("`rsh.py", "usage: `rsh.py", 1))
        return 0
    while args and args[0].startswith("-"):       # ssh options hydra may pass (-x, -q, ...)
        args.pop(0)
    if len(args) < 2:
        print("usage: rsh.py HOST COMMAND...", file=sys.stderr)
        return 255
    host, cmd = args[0], " ".join(args[1:])
    with open(os.environ["RINGZERO_CLUSTER_STATE"]) as f:
        st = json.load(f)
    names = [f"{st['name']}-n{i}" for i in range(st["nodes"])]
    by = {**{a: n for a, n in zip(st["addrs"], names)}, **{n: n for n in names}}
    if host not in by:
        print(f"rsh.py: {host!r} is not a node of cluster {st['name']} ({', '.join(st['addrs'])})", file=sys.stderr)
        return 255
    os.execvp("ip", ["ip", "netns", "exec", by[host], "unshare", "--uts", "sh", "-c",
                     'hostname "$0" && exec sh -c "$1"', by[host], cmd])


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
