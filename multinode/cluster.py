"""A cluster of "nodes" on one Linux machine: one network namespace per node, joined by a
shaped link. Real TCP between real interfaces; nothing outside the namespaces is touched.

    python -m multinode up --nodes 2 --link-mbit 400      # needs root (CAP_NET_ADMIN)
    python -m multinode status                            # hosts, addresses, link, ping-pong
    python -m multinode down                              # idempotent, also after a crash

Layout for a cluster named NAME (default "rz"):

    NAME-n0 … NAME-n{k-1}   one namespace per node: `lo` and `rzeth` = 10.77.0.(i+1)/24
    NAME-sw                 a "switch" namespace holding a bridge with one port per node

Every node's veth is rate-limited with tbf on both ends (node egress = its upload, switch-port
egress = its download), so each node has a full-duplex NIC of --link-mbit; traffic between
processes of the same node stays on that node's loopback (unshaped, the "intra-node" link).
Because each cluster lives in its own namespaces, its addresses and ports can never collide
with the host's or with another cluster's: two test runs only need different NAMEs.

`down` finds what to remove by name (`ip netns list`, ^NAME-(n<i>|sw)$), ends the processes
inside those namespaces (`ip netns pids`), then deletes them; the veths and the bridge die
with their namespaces. Nothing else is ever deleted. The state file (JSON, under STATE_DIR)
only helps `status` and `run`; `down` does not need it.
"""
from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import time
from dataclasses import asdict, dataclass, field

STATE_DIR = os.environ.get("RINGZERO_MULTINODE_DIR", "/tmp/ringzero-multinode")
IFNAME = "rzeth"                 # the same name in every node, so GLOO_SOCKET_IFNAME is one value
SUBNET = "10.77.0"               # private, and only ever configured inside our own namespaces
NAME_RE = re.compile(r"^[a-z][a-z0-9]{0,11}$")
MAX_NODES = 8


class ClusterError(RuntimeError):
    """Something the user can fix: not root, namespaces refused, a cluster already up, …"""


@dataclass
class Cluster:
    name: str
    nodes: int
    link_mbit: float
    addrs: list = field(default_factory=list)      # node i -> its address on the link
    created: float = 0.0
    pingpong: dict = field(default_factory=dict)   # filled by `status --measure` (see pingpong.py)

    def ns(self, i: int) -> str:
        return f"{self.name}-n{i}"

    @property
    def switch(self) -> str:
        return f"{self.name}-sw"

    @property
    def hostnames(self) -> list[str]:
        return [self.ns(i) for i in range(self.nodes)]

    @property
    def master_addr(self) -> str:
        return self.addrs[0]

    def state_path(self) -> str:
        return state_path(self.name)

    def hostfile(self, slots: int) -> str:
        """A DeepSpeed/MPI-style hostfile (one line per node) written next to the state file."""
        path = os.path.join(STATE_DIR, f"{self.name}.hostfile")
        with open(path + ".tmp", "w") as f:
            f.writelines(f"{h} slots={slots}\n" for h in self.hostnames)
        os.replace(path + ".tmp", path)
        return path

    def save(self) -> None:
        os.makedirs(STATE_DIR, exist_ok=True)
        tmp = self.state_path() + ".tmp"
        with open(tmp, "w") as f:
            json.dump(asdict(self), f, indent=1)
        os.replace(tmp, self.state_path())   # never a half-written state file


def state_path(name: str) -> str:
    return os.path.join(STATE_DIR, f"{name}.json")


def load(name: str) -> Cluster:
    require_root()
    check_name(name)
    try:
        with open(state_path(name)) as f:
            c = Cluster(**json.load(f))
    except FileNotFoundError:
        raise ClusterError(f"no cluster named {name!r} is up (no {state_path(name)}); "
                           f"start one with: python -m multinode up --name {name}") from None
    missing = [n for n in [*c.hostnames, c.switch] if n not in list_namespaces()]
    if missing:
        raise ClusterError(f"cluster {name!r} is half there (namespaces {missing} are gone); "
                           f"run: python -m multinode down --name {name}")
    return c


# ----------------------------------------------------------------------------- shell helpers

def sh(*argv: str, timeout: float = 20.0, check: bool = True) -> subprocess.CompletedProcess:
    r = subprocess.run(argv, capture_output=True, text=True, timeout=timeout)
    if check and r.returncode != 0:
        raise ClusterError(f"`{' '.join(argv)}` failed ({r.returncode}): {r.stderr.strip() or r.stdout.strip()}")
    return r


def require_root() -> None:
    """Clear errors instead of a wall of `ip` failures; tests call this to decide to skip."""
    if os.geteuid() != 0:
        raise ClusterError("multinode needs root (network namespaces and tc need CAP_NET_ADMIN); "
                           "run as root, e.g. `sudo -E env PATH=$PATH python -m multinode up`")
    for tool in ("ip", "tc"):
        if subprocess.run(["sh", "-c", f"command -v {tool}"], capture_output=True).returncode:
            raise ClusterError(f"multinode needs `{tool}` (iproute2); install iproute2")
    r = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, timeout=10)
    if r.returncode != 0:
        raise ClusterError(f"`ip netns` is refused here: {r.stderr.strip()}")


def list_namespaces() -> list[str]:
    out = sh("ip", "netns", "list").stdout
    return [line.split()[0] for line in out.splitlines() if line.strip()]


def ours(name: str) -> list[str]:
    """Namespaces that belong to cluster `name`, and nothing else."""
    pat = re.compile(rf"^{re.escape(name)}-(n\d+|sw)$")
    return [n for n in list_namespaces() if pat.match(n)]


def check_name(name: str) -> None:
    if not NAME_RE.match(name):
        raise ClusterError(f"cluster name {name!r}: expected 1-12 lowercase letters/digits starting "
                           "with a letter (it prefixes namespace names)")


# ----------------------------------------------------------------------------- up / down

def up(nodes: int = 2, link_mbit: float = 400.0, name: str = "rz") -> Cluster:
    require_root()
    check_name(name)
    if not 2 <= nodes <= MAX_NODES:
        raise ClusterError(f"--nodes {nodes}: expected 2..{MAX_NODES}")
    if not 1 <= link_mbit <= 100_000:
        raise ClusterError(f"--link-mbit {link_mbit}: expected 1..100000 (Mbit/s)")
    if ours(name):
        raise ClusterError(f"cluster {name!r} is already up ({', '.join(ours(name))}); "
                           f"`python -m multinode down --name {name}` first, or pick another --name")
    c = Cluster(name, nodes, float(link_mbit), [f"{SUBNET}.{i + 1}" for i in range(nodes)], time.time())
    try:
        _build(c)
    except BaseException:
        down(name)              # never leave half a cluster behind
        raise
    c.save()
    return c


def _build(c: Cluster) -> None:
    sw = c.switch
    sh("ip", "netns", "add", sw)
    sh("ip", "-n", sw, "link", "add", "br0", "type", "bridge")
    sh("ip", "-n", sw, "link", "set", "br0", "up")
    rate = f"{c.link_mbit:g}mbit"
    for i in range(c.nodes):
        ns = c.ns(i)
        sh("ip", "netns", "add", ns)
        sh("ip", "-n", ns, "link", "set", "lo", "up")
        # created inside the node namespace, peer straight into the switch: the host never sees it
        sh("ip", "-n", ns, "link", "add", IFNAME, "type", "veth", "peer", "name", f"p{i}", "netns", sw)
        sh("ip", "-n", ns, "addr", "add", f"{c.addrs[i]}/24", "dev", IFNAME)
        sh("ip", "-n", ns, "link", "set", IFNAME, "up")
        sh("ip", "-n", sw, "link", "set", f"p{i}", "master", "br0")
        sh("ip", "-n", sw, "link", "set", f"p{i}", "up")
        for where, dev in ((ns, IFNAME), (sw, f"p{i}")):   # both directions: a full-duplex NIC
            sh("tc", "-n", where, "qdisc", "add", "dev", dev, "root", "tbf", "rate", rate,
               "burst", "64kb", "latency", "50ms")


def _kill_inside(ns: str, grace: float = 2.0) -> list[int]:
    """End every process inside namespace `ns` (and only those): TERM, then KILL after `grace`."""
    def pids():
        r = sh("ip", "netns", "pids", ns, check=False)
        return [int(p) for p in r.stdout.split()] if r.returncode == 0 else []
    found = pids()
    for sig in (signal.SIGTERM, signal.SIGKILL):
        for p in pids():
            try:
                os.kill(p, sig)
            except ProcessLookupError:
                pass
        deadline = time.monotonic() + grace
        while pids() and time.monotonic() < deadline:
            time.sleep(0.05)
    return found


def down(name: str = "rz") -> list[str]:
    """Remove cluster `name`: its processes, namespaces (with their links) and state file.
    Idempotent; works after a crash because it looks at what exists, not at the state file."""
    require_root()
    check_name(name)
    removed = []
    for _ in range(3):                      # bounded: a namespace busy for a moment gets retried
        left = ours(name)
        if not left:
            break
        for ns in left:
            _kill_inside(ns)
            if sh("ip", "netns", "del", ns, check=False).returncode == 0:
                removed.append(ns)
        if ours(name):
            time.sleep(0.2)
    if ours(name):
        raise ClusterError(f"could not remove {ours(name)}; see `ip netns pids NAME`")
    for suffix in (".json", ".hostfile", ".json.tmp", ".hostfile.tmp"):
        try:
            os.remove(os.path.join(STATE_DIR, name + suffix))
        except FileNotFoundError:
            pass
    return removed


def tc_rate(c: Cluster, i: int) -> str:
    """The rate tc reports for node i's interface (what the kernel actually enforces)."""
    out = sh("tc", "-n", c.ns(i), "qdisc", "show", "dev", IFNAME).stdout
    m = re.search(r"rate (\S+)", out)
    return m.group(1) if m else "unshaped"
