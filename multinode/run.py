"""Run one command per node, each inside its node's namespace, with the launcher's variables set.

    python -m multinode run [--timeout 600] [--port 29500] -- CMD ...

On node i, CMD runs under `sh -c` (so '$NODE_RANK' in single quotes expands per node) with

    NODE_RANK=i  NNODES=k  MASTER_ADDR=<node 0's address>  MASTER_PORT=<--port>
    GLOO_SOCKET_IFNAME=rzeth   (gloo binds the shaped link, not loopback)
    hostname NAME-n<i>         (a private UTS namespace, so hostname-based topology works)

Output is streamed line by line, prefixed `[node i]`. If a node's command exits non-zero, every
process on every node is ended (TERM, then KILL) and the run fails with an error naming the node
and the rank(s) its launcher reported; the same when --timeout passes. The port never collides
with anything outside the cluster: each cluster has its own network namespaces.
"""
from __future__ import annotations

import argparse
import os
import re
import shlex
import signal
import subprocess
import sys
import threading
import time
from collections import deque

from rich.console import Console

from multinode import cluster as C

# how launchers name the rank that failed: torchrun's summary ("rank      : 3 (local_rank: 1)"),
# ringzero's errors ("rank 3: ..."), DeepSpeed's launcher ("Killing subprocess ... rank=3")
_RANK_PATTERNS = (re.compile(r"\brank\s*:\s*(\d+)"), re.compile(r"\brank[ =](\d+)\b"))


def add_args(p) -> None:
    p.add_argument("--timeout", type=float, default=600.0, help="seconds before every node is ended")
    p.add_argument("--port", type=int, default=29500, help="MASTER_PORT (private to the cluster)")
    p.add_argument("--grace", type=float, default=5.0, help="seconds between TERM and KILL")
    p.add_argument("command", nargs=argparse.REMAINDER, help="-- CMD ...")


def run_from_args(args) -> int:
    cmd = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not cmd:
        raise C.ClusterError("nothing to run: python -m multinode run -- CMD ...")
    c = C.load(args.name)
    code, err = run(c, " ".join(cmd) if len(cmd) > 1 else cmd[0], timeout=args.timeout,
                    port=args.port, grace=args.grace)
    if err:
        Console(stderr=True).print(f"[red]multinode run failed:[/] {err}")
    return code


def node_env(c: C.Cluster, i: int, port: int) -> dict:
    env = dict(os.environ)
    env.update(NODE_RANK=str(i), NNODES=str(c.nodes), MASTER_ADDR=c.master_addr, MASTER_PORT=str(port),
               GLOO_SOCKET_IFNAME=C.IFNAME, RINGZERO_NODE=c.ns(i), PYTHONUNBUFFERED="1",
               RINGZERO_CLUSTER_STATE=c.state_path(), RINGZERO_RSH=rsh_script(),
               HOSTFILE=c.hostfile(int(os.environ.get("RINGZERO_SLOTS", "2"))))
    return env


def rsh_script() -> str:
    """An executable wrapper for hydra's -launcher-exec (it takes one path, not a command line)."""
    path = os.path.join(C.STATE_DIR, "rsh")
    body = f"#!/bin/sh\nexec {shlex.quote(sys.executable)} {shlex.quote(os.path.abspath(os.path.join(os.path.dirname(__file__), 'rsh.py')))} \"$@\"\n"
    if not os.path.exists(path) or open(path).read() != body:
        tmp = f"{path}.{os.getpid()}"
        with open(tmp, "w") as f:
            f.write(body)
        os.chmod(tmp, 0o755)
        os.replace(tmp, path)
    return path


def _failed_ranks(lines) -> list[int]:
    found = []
    for line in lines:
        for pat in _RANK_PATTERNS:
            for m in pat.finditer(line):
                r = int(m.group(1))
                if r not in found:
                    found.append(r)
    return found


def run(c: C.Cluster, cmd: str, *, timeout: float = 600.0, port: int = 29500, grace: float = 5.0,
        out=None) -> tuple[int, str | None]:
    """Run `cmd` on every node; returns (exit code, error message or None)."""
    out = out or sys.stdout
    lock = threading.Lock()
    tails = [deque(maxlen=60) for _ in range(c.nodes)]
    procs, readers = [], []
    for i in range(c.nodes):
        argv = ["ip", "netns", "exec", c.ns(i), "unshare", "--uts", "sh", "-c",
                'hostname "$RINGZERO_NODE" && exec sh -c "$1"', "multinode-node", cmd]
        p = subprocess.Popen(argv, env=node_env(c, i, port), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                             stdin=subprocess.DEVNULL, text=True, errors="replace", start_new_session=True)
        procs.append(p)

        def pump(i=i, p=p):
            for line in p.stdout:
                tails[i].append(line.rstrip("\n"))
                with lock:
                    out.write(f"[node {i}] {line}")
                    out.flush()
        t = threading.Thread(target=pump, daemon=True)
        t.start()
        readers.append(t)

    deadline, err = time.monotonic() + timeout, None
    try:
        while True:
            codes = [p.poll() for p in procs]
            bad = [(i, rc) for i, rc in enumerate(codes) if rc not in (None, 0)]
            if bad:
                i, rc = bad[0]
                for t in readers:
                    t.join(timeout=1.0)       # the dead node's last words name the rank
                ranks = _failed_ranks(tails[i])
                who = (f"rank(s) {', '.join(map(str, ranks))} per its launcher" if ranks
                       else "its launcher named no rank")
                alive = [j for j, rc2 in enumerate(codes) if rc2 is None]
                err = (f"node {i} ({c.ns(i)}) exited with code {rc}: {who}; ended the processes of "
                       f"node(s) {alive if alive else 'none left'} and everything else in the cluster's namespaces")
                return rc if rc > 0 else 1, err
            if all(rc == 0 for rc in codes):
                return 0, None
            if time.monotonic() > deadline:
                alive = [j for j, rc2 in enumerate(codes) if rc2 is None]
                err = f"timed out after {timeout:g}s with node(s) {alive} still running; ended every process"
                return 124, err
            time.sleep(0.1)
    finally:
        _end_all(c, procs, grace)
        for t in readers:
            t.join(timeout=1.0)


def _end_all(c: C.Cluster, procs, grace: float) -> None:
    for p in procs:                            # our own process groups first
        if p.poll() is None:
            try:
                os.killpg(p.pid, signal.SIGTERM)
            except ProcessLookupError:
                pass
    deadline = time.monotonic() + grace
    while any(p.poll() is None for p in procs) and time.monotonic() < deadline:
        time.sleep(0.05)
    for p in procs:
        if p.poll() is None:
            try:
                os.killpg(p.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        p.wait()
    for i in range(c.nodes):                   # anything that left our process groups (daemons)
        C._kill_inside(c.ns(i), grace=1.0)
