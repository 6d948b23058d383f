"""Shared-memory segments for ranks on one host: who shares a host, naming, creation,
attachment, unlinking, stale-segment removal and peer liveness. No messaging here (shm.py).

    RINGZERO_TRANSPORT=auto torchrun --nproc_per_node 4 primitives/all_reduce.py

Life of a segment (one per host per communicator):
  1. every rank publishes (hostname + boot id, pid, process start time) through the store
     (faults.Rounds: one key per rank, a deadline, a rank that never arrives named); ranks with
     the same key share a host. The boot id changes at
     every reboot and differs between machines even when hostnames collide.
  2. the lowest rank of each host sweeps /dev/shm for ringzero segments of this user whose
     creator process is gone (a crashed earlier run), then creates
     /dev/shm/ringzero-<uid>-<pid>.<start>-<run token>-h<host> with O_EXCL and writes a nonce.
  3. the others attach and check the nonce (same /dev/shm, not a look-alike container);
  4. once every rank of the host reported, the creator unlinks the name. The mapping lives on
     in each process and the kernel frees it when the last one exits, even after kill -9.
The only window where a crash leaves a name behind is between 2 and 4; step 2 of the next
run removes it (its creator pid, with its start time, is no longer alive).
"""
from __future__ import annotations

import mmap
import os
import secrets
import socket
import time

# The transport's sizes (shm.py) and the segment layout they give
TRANSPORTS = ("auto", "shm", "tcp")
SLOT_BYTES = int(os.environ.get("RINGZERO_SHM_SLOT_BYTES", 512 << 10))
SLOTS = int(os.environ.get("RINGZERO_SHM_SLOTS", 8))
WS_BYTES = int(os.environ.get("RINGZERO_SHM_WORKSPACE", 2 << 20))   # per rank and buffer: one round
BUFS = 3                      # workspaces per rank, used in turn (shm_collectives: one flag per round)
HDR_BYTES = 4096              # per rank and buffer: the call's fingerprint and error text
LINE = 64                                                            # one cache line per counter
# a rank's control line: +32 doorbell (shm.py); the shm collectives' flags (shm_collectives.py):
SEQ_OFF, SLEEP_OFF = 8, 40    # int64 publish counter, int32 "asleep on my doorbell"
SPIN, YIELD_S = 32, os.environ.get("RINGZERO_SHM_YIELD_S")   # YIELD_S: see yield_s()
POLLS = os.environ.get("RINGZERO_SHM_POLLS")   # a fixed number of quick polls (else adaptive, max_polls)


def _cores() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def yield_s(n_local: int) -> float:
    """Seconds a wait yields the core (sched_yield) before it sleeps on its futex: 0.5 ms when the
    local ranks outnumber the cores (a yield hands the core to a peer on the same run queue in
    ~1 µs, a futex sleep and wake-up costs tens; MPICH's ch3 yields after 1000 polls, never sleeps), else 0
    (the peer runs on a core of its own: sleep). RINGZERO_SHM_YIELD_S fixes it; a slow yield (YIELD_SLOW)
    still makes the next second's waits sleep at once."""
    if YIELD_S is not None:
        return float(YIELD_S)
    return 5e-4 if n_local > _cores() else 0.0


# A yield that returns after this long ran another process's time slice (EEVDF's is ~3 ms here), not a peer's
# few µs of Python or a 2 MiB round's copies: other jobs share the cores, and while they do, a yield costs a
# slice each time where a futex sleep is woken as soon as the peer publishes (ShmComm.spin_until).
YIELD_SLOW = 1e-3


def max_polls(n_local: int) -> int:
    """The most quick polls (~50 ns each) a shm collective makes before ShmComm.spin_until: 2000
    (~100-150 µs) while every local rank has a core of its own (a running peer publishes within µs;
    a futex sleep and wake-up costs ~50 µs and more), none when ranks outnumber cores (the peer
    needs my core: spin_until yields it at once). Within it the count adapts
    (shm_collectives._State.wait): halved after a wait that slept, doubled after one that the
    polls of spin_until ended. RINGZERO_SHM_POLLS fixes it."""
    if POLLS is not None:
        return int(POLLS)
    return 2000 if n_local <= _cores() else 0


def transport_from_env(transport: str | None) -> str:
    t = (transport or os.environ.get("RINGZERO_TRANSPORT") or "auto").lower()
    if t not in TRANSPORTS:
        raise ValueError(f"RINGZERO_TRANSPORT / transport= is {t!r}; expected one of {list(TRANSPORTS)}")
    return t


def layout(n: int) -> dict:
    """Byte offsets in a host's segment for n local ranks: per-rank control lines, n·n
    channels (head line, tail line, K slots of a header line + C bytes), BUFS·n headers and
    BUFS·n workspaces (rank-major)."""
    ctl = LINE * (1 + n)
    slot = LINE + SLOT_BYTES
    chan = 2 * LINE + SLOTS * slot
    hdr = ctl + n * n * chan
    ws = hdr + BUFS * n * HDR_BYTES
    return dict(ctl=LINE, chan0=ctl, chan=chan, slot=slot, hdr=hdr, ws=ws, total=ws + BUFS * n * WS_BYTES)


SHM_DIR = "/dev/shm"
PREFIX = "ringzero-"


def _boot_id() -> str:
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            return f.read().strip()
    except OSError:
        return "no-boot-id"


def host_key() -> str:
    return f"{socket.gethostname()}/{_boot_id()}"


def start_time(pid: int) -> int | None:
    """The process's start time in clock ticks since boot (field 22 of /proc/PID/stat), or
    None when the process is gone or a zombie. With the pid it names a process uniquely."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            s = f.read()
    except OSError:
        return None
    fields = s[s.rindex(")") + 2:].split()    # the command name may contain spaces
    if fields[0] in ("Z", "X"):
        return None
    return int(fields[19])


def alive(pid: int, start: int) -> bool:
    return start_time(pid) == start


def segment_name(token: str, host_index: int) -> str:
    pid = os.getpid()
    return f"{PREFIX}{os.getuid()}-{pid}.{start_time(pid)}-{token}-h{host_index}"


def new_token() -> str:
    return secrets.token_hex(4)


def sweep_stale() -> list[str]:
    """Remove this user's ringzero segments whose creator is no longer alive. Returns the names."""
    removed = []
    mine = f"{PREFIX}{os.getuid()}-"
    try:
        names = os.listdir(SHM_DIR)
    except OSError:
        return removed
    for name in names:
        if not name.startswith(mine):
            continue
        try:
            pid_s, start_s = name[len(mine):].split("-", 1)[0].split(".")
            pid, start = int(pid_s), int(start_s)
        except ValueError:
            continue
        if not alive(pid, start):
            try:
                os.unlink(os.path.join(SHM_DIR, name))
                removed.append(name)
            except OSError:
                pass
    return removed


def create(name: str, size: int, nonce: int) -> mmap.mmap:
    fd = os.open(os.path.join(SHM_DIR, name), os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
    try:
        os.ftruncate(fd, size)
        mm = mmap.mmap(fd, size)
    finally:
        os.close(fd)
    mm[:8] = nonce.to_bytes(8, "little")
    return mm


def attach(name: str, size: int, nonce: int) -> mmap.mmap:
    fd = os.open(os.path.join(SHM_DIR, name), os.O_RDWR)
    try:
        if os.fstat(fd).st_size != size:
            raise OSError(f"segment {name} has {os.fstat(fd).st_size} bytes, expected {size}")
        mm = mmap.mmap(fd, size)
    finally:
        os.close(fd)
    if int.from_bytes(mm[:8], "little") != nonce:
        raise OSError(f"segment {name} holds another run's nonce")
    return mm


def unlink(name: str) -> None:
    try:
        os.unlink(os.path.join(SHM_DIR, name))
    except FileNotFoundError:
        pass


def listing(token: str | None = None) -> list[str]:
    """This user's ringzero segment names (of one run when token is given): for tests."""
    mine = f"{PREFIX}{os.getuid()}-"
    try:
        return sorted(n for n in os.listdir(SHM_DIR)
                      if n.startswith(mine) and (token is None or f"-{token}-" in n))
    except OSError:
        return []


def rendezvous(group, rank: int, size: int, nbytes_for, gather) -> tuple:
    """Steps 1-4 above. `gather(obj)` gives every group rank's obj (faults.Rounds.gather); nbytes_for(n)
    gives the segment size for n ranks on a host. Returns (mm or None, local group ranks,
    pids+start times of the local ranks, token, why-not text)."""
    me = (host_key(), os.getpid(), start_time(os.getpid()), new_token(), os.path.isdir(SHM_DIR))
    info = gather(me)
    token = info[0][3]
    hosts = list(dict.fromkeys(i[0] for i in info))
    local = [r for r in range(size) if info[r][0] == me[0]]
    procs = [(info[r][1], info[r][2]) for r in local]
    if len(local) < 2:
        gather(None), gather(None)                        # keep the rounds matched across hosts
        return None, local, procs, token, "no other rank on this host"
    size_b, leader = nbytes_for(len(local)), local[0] == rank
    nonce = int.from_bytes(bytes.fromhex(token) * 2, "little")
    mm, name, err = None, None, None
    if leader:
        try:
            sweep_stale()
            st = os.statvfs(SHM_DIR)            # a full /dev/shm (Docker's default is 64 MiB) would
            if st.f_bavail * st.f_frsize < size_b:   # SIGBUS on first touch: refuse it up front
                raise OSError(f"{SHM_DIR} has {st.f_bavail * st.f_frsize:,} bytes free, {size_b:,} needed "
                              "(RINGZERO_SHM_SLOTS / _SLOT_BYTES / _WORKSPACE make it smaller)")
            name = segment_name(token, hosts.index(me[0]))
            mm = create(name, size_b, nonce)
        except OSError as e:
            err = f"rank {rank} could not create a segment in {SHM_DIR}: {e}"
    try:
        names = gather((name, err) if leader else None)
        name, err = names[local[0]]
        if not leader and err is None:
            try:
                mm = attach(name, size_b, nonce)
            except OSError as e:
                err = f"rank {rank} could not attach {name}: {e}"
        if err is None and not all(alive(p, s) for p, s in procs):   # pids must be visible for liveness
            err = f"rank {rank} cannot see every local rank's pid (another pid namespace)"
        oks = gather(err)
    finally:
        if leader and name:
            unlink(name)                                   # everyone attached or gave up: the name goes
    errs = [oks[r] for r in local if oks[r]]
    if errs:
        return None, local, procs, token, "; ".join(errs)
    return mm, local, procs, token, ""


# ----------------------------------------------------------------------------- doorbells
# A waiting rank blocks in the kernel on a 32-bit word of the segment (futex), and whoever
# publishes something it may wait for bumps the word and wakes it. Under oversubscription
# (more busy processes than cores) a blocked-then-woken process is scheduled promptly, where
# a spinning or sched_yield()ing one waits behind everyone else's time slice.

import ctypes  # noqa: E402
import platform  # noqa: E402

_SYS_FUTEX = {"x86_64": 202, "aarch64": 98}.get(platform.machine())
_libc = ctypes.CDLL(None, use_errno=True) if _SYS_FUTEX else None


class _Timespec(ctypes.Structure):
    _fields_ = [("tv_sec", ctypes.c_long), ("tv_nsec", ctypes.c_long)]


def base_address(mm) -> int:
    return ctypes.addressof(ctypes.c_char.from_buffer(mm))


def futex_wait(addr: int, expected: int, seconds: float) -> None:
    """Sleep while the int32 at addr equals expected, at most `seconds` (or nap without futex)."""
    if _libc is None:
        time.sleep(min(seconds, 1e-3))
        return
    ts = _Timespec(int(seconds), int((seconds % 1) * 1e9))
    _libc.syscall(_SYS_FUTEX, ctypes.c_void_p(addr), 0, ctypes.c_int(expected), ctypes.byref(ts), None, 0)


def futex_wake(addr: int) -> None:
    if _libc is not None:
        _libc.syscall(_SYS_FUTEX, ctypes.c_void_p(addr), 1, ctypes.c_int(1 << 30), None, None, 0)
