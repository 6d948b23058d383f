"""The only place that creates process groups.

    init_from_env(backend)        inside a script started by torchrun / deepspeed / mpiexec
                                  (or plain `python`, which gives a world of one)
    spawn(fn, world_size, ...)    for tests and notebooks: N fresh processes, a file-store
                                  rendezvous (no ports to collide), a deadline, per-rank exit
                                  codes and tracebacks. The first failure ends the run: the
                                  other ranks get `grace` seconds to report, then are killed,
                                  so a failing rank can never leave the test hanging.
"""
from __future__ import annotations

import atexit
import gc
import multiprocessing as mp
import os
import pickle
import queue
import socket
import sys
import tempfile
import time
import traceback
import types
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from primitives.comm import Communicator
from primitives.engine import core, faults, registry
from primitives.engine.checked import DEFAULT_TIMEOUT
from primitives.engine.mpi_comm import MPIComm
from primitives.engine.shm_segment import transport_from_env

BACKENDS = ("auto", "gloo", "nccl", "mpi")


def add_launch_args(parser) -> None:
    parser.add_argument("--backend", default="auto", choices=BACKENDS,
                        help="auto = nccl when CUDA is available, else gloo; mpi needs mpiexec")
    parser.add_argument("--timeout", type=float, default=DEFAULT_TIMEOUT,
                        help="seconds any rank waits for a peer before raising")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _default_backend() -> str:
    return "nccl" if torch.cuda.is_available() else "gloo"


def init_from_env(backend: str = "auto", timeout: float | None = None,
                  transport: str | None = None) -> Communicator:
    """Initialise from the launcher's environment and return the world communicator.
    transport: auto|shm|tcp (default: $RINGZERO_TRANSPORT, else auto; see primitives/engine/shm.py)."""
    if transport is not None:                    # shm transport: every communicator built later uses it
        os.environ["RINGZERO_TRANSPORT"] = transport_from_env(transport)
    timeout = DEFAULT_TIMEOUT if timeout is None else timeout
    mpi_size = int(os.environ.get("PMI_SIZE", os.environ.get("OMPI_COMM_WORLD_SIZE", "1")))
    if backend == "mpi":
        try:
            from mpi4py import MPI  # noqa: F401  (optional dependency: is it installed?)
        except ImportError as e:
            raise SystemExit("backend mpi needs mpi4py: pip install mpi4py mpich "
                             "(or `pip install -e .[mpi]`), then mpiexec -n 4 python SCRIPT --backend mpi") from e
        registry.set_mpi_world(MPIComm(timeout=timeout))
        return registry.get_comm()
    if mpi_size > 1 and "RANK" not in os.environ:
        raise SystemExit(f"started by mpiexec with {mpi_size} processes but --backend is {backend!r}: "
                         "pass --backend mpi (torch wheels have no MPI backend; ringzero uses mpi4py)")
    if backend == "auto":
        backend = _default_backend()
    if backend == "nccl" and not torch.cuda.is_available():
        raise SystemExit("backend nccl needs one CUDA GPU per rank and none is visible; use --backend gloo")
    if not dist.is_initialized():
        td = timedelta(seconds=timeout)
        if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
            if backend == "nccl":
                torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
            dist.init_process_group(backend, timeout=td)
        else:  # plain `python script.py`: a world of one, so the script still runs and explains
            if backend == "nccl":
                torch.cuda.set_device(0)
            dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{free_port()}",
                                    rank=0, world_size=1, timeout=td)
    faults.hello()                # host + pid in the store: survivors can tell if this rank dies
    registry._COMMS.clear()
    c = registry.get_comm()
    c.timeout = timeout
    atexit.register(shutdown)
    return c


def shutdown() -> None:
    """Tear the process group down before interpreter exit: gloo's threads otherwise abort
    the process ("terminate called without an active exception") and the launcher reports
    a failure although every rank finished."""
    core.drain()
    if dist.is_initialized():
        _forget_captured_groups()
        try:
            dist.destroy_process_group()
        except Exception:
            pass


def _forget_captured_groups() -> None:
    """A default argument evaluated after init holds the group past destroy_process_group
    (torch's ShardedGradScaler: `process_group=dist.group.WORLD`, imported by transformers):
    its gloo threads then outlive the interpreter and abort the process at exit."""
    pg = dist.ProcessGroup
    for f in gc.get_objects():
        if type(f) is types.FunctionType and f.__defaults__ and any(isinstance(d, pg) for d in f.__defaults__):
            f.__defaults__ = tuple(None if isinstance(d, pg) else d for d in f.__defaults__)


# ----------------------------------------------------------------------------- spawn

class SpawnError(RuntimeError):
    """One or more ranks failed; the message holds every rank's exit code and traceback."""


@dataclass
class _Job:
    fn: object
    args: tuple
    kwargs: dict
    backend: str
    world_size: int
    store: str
    comm_timeout: float
    threads: int
    transport: str | None = None
    env: dict | None = None


def _child(rank: int, job: _Job, q) -> None:
    if job.env is not None:     # the caller's os.environ at this spawn, not the forkserver's (of the first)
        os.environ.clear()
        os.environ.update(job.env)
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(job.world_size), LOCAL_RANK=str(rank),
                      RINGZERO_TIMEOUT=str(job.comm_timeout))
    if job.transport:                            # shm transport: auto|shm|tcp for this run
        os.environ["RINGZERO_TRANSPORT"] = job.transport
    torch.set_num_threads(job.threads)
    try:
        if job.backend == "nccl":
            torch.cuda.set_device(rank)
        dist.init_process_group(job.backend, init_method=f"file://{job.store}", rank=rank,
                                world_size=job.world_size, timeout=timedelta(seconds=job.comm_timeout))
        faults.hello()            # host + pid in the store: survivors can tell if this rank dies
        registry._COMMS.clear()
        registry.get_comm().timeout = job.comm_timeout
        result = job.fn(rank, job.world_size, *job.args, **job.kwargs)
        # plain pickle, by value: the queue's own pickler shares tensors through file descriptors
        # that die with this process (ConnectionResetError in the parent after os._exit)
        q.put((rank, "ok", pickle.dumps(result)))
        code = 0
    except BaseException:
        q.put((rank, "error", traceback.format_exc()))
        code = 1
    q.close()
    q.join_thread()  # flush the queue's feeder thread before os._exit
    if code:
        os._exit(1)  # skip interpreter teardown, which can block on a dead peer
    try:
        dist.destroy_process_group()
    except Exception:
        pass
    os._exit(0)


_CTX = None


def _context():
    global _CTX
    if _CTX is None:
        _CTX = mp.get_context("forkserver")  # fork is unsafe once torch has started threads
        _CTX.set_forkserver_preload(_preload())
    return _CTX


def _preload() -> list[str]:
    """What the forkserver imports once, so that each rank forks warm instead of importing it again:
    torch, torch._dynamo (torch.optim imports it at a rank's first optimizer: ~2 CPU seconds on
    a slow core), and transformers' models where this process imported them already (its ranks
    will too). Not DeepSpeed: a rank may install zero_from_scratch's finder, so that its
    `import deepspeed` is ringzero's engine (zero_from_scratch.as_deepspeed)."""
    return ["torch", "torch.distributed", "torch._dynamo", "primitives"] + \
        [m for m in ("transformers.modeling_utils",) if m in sys.modules]


def spawn(fn, world_size: int, *, args: tuple = (), kwargs: dict | None = None, backend: str = "gloo",
          timeout: float = 120.0, comm_timeout: float = 30.0, grace: float = 5.0,
          threads: int = 1, allow_fail: bool = False, transport: str | None = None):
    """Run fn(rank, world_size, *args, **kwargs) on `world_size` fresh processes.

    Returns the list of per-rank return values. Raises SpawnError if any rank raises, exits
    non-zero or does not finish within `timeout` seconds. With allow_fail=True it instead
    returns a list of ("ok", value) / ("error", traceback) / ("exit", code) per rank, for
    tests whose point is that a rank fails. transport: auto|shm|tcp (default $RINGZERO_TRANSPORT).
    The ranks get this process's os.environ as it is at the call; what a module reads from it when
    imported stays what the forkserver read (it imports _preload's modules at the first spawn).
    """
    ctx = _context()
    with tempfile.TemporaryDirectory(prefix="ringzero-") as tmp:
        job = _Job(fn, tuple(args), dict(kwargs or {}), backend, world_size,
                   os.path.join(tmp, "store"), comm_timeout, threads, transport, dict(os.environ))
        q = ctx.Queue()
        procs = [ctx.Process(target=_child, args=(r, job, q), daemon=True) for r in range(world_size)]
        for p in procs:
            p.start()
        results: dict[int, tuple] = {}
        deadline, first_failure = time.monotonic() + timeout, None
        while len(results) < world_size:
            now = time.monotonic()
            limit = deadline if first_failure is None else min(deadline, first_failure + grace)
            if now > limit:
                break
            try:
                r, status, value = q.get(timeout=0.1)
                if status == "ok":
                    value = pickle.loads(value)
                results[r] = (status, value)
                if status != "ok" and first_failure is None:
                    first_failure = time.monotonic()
            except queue.Empty:
                for r, p in enumerate(procs):
                    if r not in results and p.exitcode not in (None, 0):
                        # died without reporting (os._exit, segfault, killed)
                        results[r] = ("exit", p.exitcode)
                        if first_failure is None:
                            first_failure = time.monotonic()
        for p in procs:
            p.join(timeout=2.0 if len(results) == world_size else 0.1)
            if p.is_alive():
                p.kill()
                p.join()
        q.close()
    missing = [r for r in range(world_size) if r not in results]
    failed = {r: v for r, v in results.items() if v[0] != "ok"}
    if allow_fail:
        return [results.get(r, ("timeout", None)) for r in range(world_size)]
    if failed or missing:
        lines = [f"{len(failed)} of {world_size} ranks failed"
                 + (f", {len(missing)} never reported (killed after the deadline): ranks {missing}" if missing else "")]
        for r, (status, value) in sorted(failed.items()):
            lines.append(f"--- rank {r} ({status}, exit code {procs[r].exitcode}):\n{value}")
        raise SpawnError("\n".join(lines))
    return [results[r][1] for r in range(world_size)]
