"""TCP ping-pong between two nodes of the cluster: latency α and bandwidth 1/β of the link.

    python -m multinode status            # runs this between node 0 and node 1, and on node 0's loopback

A server in one namespace echoes every message back; the client, in another, times round trips
at a few sizes and fits one-way time t(S) = α + S·β by least squares (t = RTT / 2). Bounded:
a fixed number of repetitions per size and a socket timeout on every call.
"""
from __future__ import annotations

import json
import socket
import subprocess
import struct
import sys
import time

SIZES = ((8, 30), (1 << 16, 5), (1 << 20, 3), (4 << 20, 2))   # (bytes, repetitions)
TIMEOUT = 30.0


def _recv_exact(s: socket.socket, n: int, buf: bytearray) -> None:
    view, got = memoryview(buf)[:n], 0
    while got < n:
        k = s.recv_into(view[got:], n - got)
        if k == 0:
            raise ConnectionError("peer closed the connection")
        got += k


def serve(host: str) -> None:
    """Echo length-prefixed messages until the client says 0; prints the port first."""
    with socket.create_server((host, 0)) as srv:
        srv.settimeout(TIMEOUT)
        print(srv.getsockname()[1], flush=True)
        conn, _ = srv.accept()
        with conn:
            conn.settimeout(TIMEOUT)
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            buf = bytearray(max(s for s, _ in SIZES))
            hdr = bytearray(8)
            while True:
                _recv_exact(conn, 8, hdr)
                (n,) = struct.unpack("!Q", hdr)
                if n == 0:
                    return
                _recv_exact(conn, n, buf)
                conn.sendall(memoryview(buf)[:n])


def client(host: str, port: int) -> dict:
    with socket.create_connection((host, port), timeout=TIMEOUT) as s:
        s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        buf = bytearray(max(n for n, _ in SIZES))
        points = []
        for n, reps in SIZES:
            times = []
            for _ in range(reps + 1):                 # +1: the first is a warm-up
                t0 = time.perf_counter()
                s.sendall(struct.pack("!Q", n) + bytes(n))
                _recv_exact(s, n, buf)
                times.append((time.perf_counter() - t0) / 2)
            points.append((n, min(times[1:])))
        s.sendall(struct.pack("!Q", 0))
    return fit(points)


def fit(points) -> dict:
    """Least-squares α, β for t = α + S·β over (S, t) points."""
    k = len(points)
    sx = sum(p[0] for p in points)
    sy = sum(p[1] for p in points)
    sxx = sum(p[0] ** 2 for p in points)
    sxy = sum(p[0] * p[1] for p in points)
    beta = (k * sxy - sx * sy) / (k * sxx - sx * sx)
    alpha = min(p[1] for p in points)        # the smallest message: latency alone
    return {"alpha_s": alpha, "beta_s_per_byte": beta, "mbit_per_s": 8 / beta / 1e6 if beta > 0 else float("inf"),
            "points": points}


def measure(server_ns: str, client_ns: str, host: str) -> dict:
    """Serve in `server_ns` on `host`, run the client in `client_ns`; returns fit()'s dict."""
    srv = subprocess.Popen(["ip", "netns", "exec", server_ns, sys.executable, "-m", "multinode.pingpong",
                            "serve", host], stdout=subprocess.PIPE, text=True)
    try:
        port = int(srv.stdout.readline())
        out = subprocess.run(["ip", "netns", "exec", client_ns, sys.executable, "-m", "multinode.pingpong",
                              "client", host, str(port)], capture_output=True, text=True, timeout=4 * TIMEOUT)
        if out.returncode:
            raise RuntimeError(f"ping-pong client failed: {out.stderr.strip()}")
        return json.loads(out.stdout)
    finally:
        try:
            srv.wait(timeout=TIMEOUT)
        except subprocess.TimeoutExpired:
            srv.kill()
            srv.wait()


if __name__ == "__main__":
    if sys.argv[1:2] not in (["serve"], ["client"]) or len(sys.argv) < (3 if sys.argv[1] == "serve" else 4):
        print("usage: python -m multinode.pingpong serve ADDR | client ADDR PORT  (measure() starts both in the nodes)")
        raise SystemExit(0 if sys.argv[1:2] in (["-h"], ["--help"]) else 2)
    if sys.argv[1] == "serve":
        serve(sys.argv[2])
    else:
        print(json.dumps(client(sys.argv[2], int(sys.argv[3]))))
