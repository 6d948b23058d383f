"""Optimizer offload: DeepSpeed's `zero_optimization.offload_optimizer` section.

    "zero_optimization": {"stage": 2, "sub_group_size": 10000000,
                          "offload_optimizer": {"device": "nvme", "nvme_path": "/local_nvme"}}
    python -m benchmarks.offload_memory          (peak RSS per rank with and without, DistilBERT-base shape)

device "nvme"  each rank keeps its optimizer states in files, NVME_PATH/zero_rank{r}/group{g}.{key}:
               fp32 master (mixed precision only: in fp32 the parameter shard is the master),
               Adam's exp_avg and exp_avg_sq. The step streams them through one staging buffer per
               key of min(sub_group_size, STREAM_CHUNK = 2^20) elements (4 MiB), for the step only
               (kept under RINGZERO_MALLOC=default: allocator.py): read a chunk, Adam on it (optim.py,
               the same function as without offload: bit-identical), write it back. DeepSpeed sizes its
               buffer_count swap buffers to a whole sub-group (default 1e9 elements: a whole shard, so
               its buffers cost what offload saves); Adam is elementwise: pieces give the same bits.
               Saved per rank: K·Ψ/N bytes (K = 12 mixed, 8 fp32) minus ≤ 3 × 4 MiB. Moved per step and
               rank: K·Ψ/N read + K·Ψ/N written (P/N with padding). At ZeRO-3 the gradient shards go to
               files too (param_offload.make_grads).
device "cpu"   HostOptimizerStates: the fp32 master of every owned shard (in fp32 training too) and
               Adam's m, v on the host, pinned with a GPU model (unless "pin_memory": false) so
               the copies are DMA and the upward ones asynchronous. Per unit and chunk: gradient
               shard device → host, × clip_coef / (N · loss_scale), Adam on the host master (the
               same step_group: offload moves bytes, not maths), master chunk host → device.
               Bytes per step and rank: b·P/N down + b·P/N up (`bytes_down` / `bytes_up`); the
               device saves K·Ψ/N, the host holds 12·Ψ/N plus one chunk of gradients during the
               step. The same code runs for a CPU model (host → host copies), which is how the
               CPU test (tests/test_recipes_offload_cpu.py) proves it bit-identical to no offload.
device "none"  no offload (DeepSpeed's meaning).
pin_memory     device "cpu" with a GPU model: pinned host buffers (default true, as in DeepSpeed 0.19.8; false: pageable).
Other keys (buffer_count, fast_init, ratio; pin_memory with nvme) tune CUDA/AIO transfers: warned.
Failures: an unwritable nvme_path fails at start-up on every rank; a failed read/write during a
step (out of space, I/O error) fails the step on every rank (one 8-byte all-gather per step says
which rank failed) with a message pointing at the last checkpoint, which the step never touches.
"""
from __future__ import annotations

import contextlib
import os
import warnings

import torch

from zero_from_scratch.engine import allocator, unused_params
from zero_from_scratch.engine.mpu import engine_mp, mp_prefix
from zero_from_scratch.engine.param_offload import failed_ranks, file_io

DEVICES = ("none", "cpu", "nvme")
TUNING = ("pin_memory", "buffer_count", "fast_init", "ratio", "pipeline_read", "pipeline_write", "pipeline")
STREAM_CHUNK = 1 << 20     # elements per staging buffer, whatever the shard size (4 MiB of fp32)


class OffloadError(RuntimeError):
    """An offloaded optimizer state could not be read or written."""


def parse(z: dict) -> dict | None:
    """The offload_optimizer section → {"device", "nvme_path"} (None = no offload)."""
    s = z.get("offload_optimizer")
    if s is None:
        return None
    if not isinstance(s, dict):
        raise ValueError(f"config key 'zero_optimization.offload_optimizer' = {s!r} is invalid; allowed: a dict")
    bad = set(s) - {"device", "nvme_path", *TUNING}
    if bad:
        raise ValueError(f"config keys {sorted('zero_optimization.offload_optimizer.' + k for k in bad)} are not "
                         f"supported; allowed: device, nvme_path, {', '.join(TUNING)}")
    dev = s.get("device", "none")
    if dev not in DEVICES:
        raise ValueError(f"config key 'zero_optimization.offload_optimizer.device' = {dev!r} is invalid; allowed: {list(DEVICES)}")
    tuned = [k for k in TUNING if k in s and not (k == "pin_memory" and dev == "cpu")]
    if tuned:
        warnings.warn(f"zero_from_scratch: offload_optimizer.{', '.join(tuned)} tune CUDA/AIO transfers and have no "
                      "effect here", stacklevel=3)
    if dev == "nvme" and not s.get("nvme_path"):
        raise ValueError("config key 'zero_optimization.offload_optimizer.nvme_path' is required with device 'nvme'; "
                         "allowed: a writable folder")
    if dev == "none":
        return None
    if dev == "cpu":   # pinned host buffers unless told otherwise (DeepSpeed 0.19.8's default is true too)
        return {"device": dev, "nvme_path": None, "pin_memory": bool(s.get("pin_memory", True))}
    return {"device": dev, "nvme_path": s.get("nvme_path")}


def done_with(stage, u, params: bool = True, grads: bool = True) -> None:
    """The step, the norm (grads only) or write_master (params only) has finished unit u: its offloaded
    ZeRO-3 shards leave memory, the parameter's written back, the gradient's not (the step scales it
    in place, zero_grad zeroes it next)."""
    poff, goff = getattr(stage, "poff", None), getattr(stage, "goff", None)
    poff.release(u) if poff and params else None
    goff.release(u, changed=False) if goff and grads else None


def stream_chunk(engine, sub_group_size: int) -> int:
    """Elements per staging buffer: min(sub_group_size, largest shard, STREAM_CHUNK), at least 1."""
    return max(1, min(int(sub_group_size), max((u.shard for u in engine.layout.units), default=1), STREAM_CHUNK))


class HostOptimizerStates:
    """fp32 master + Adam m, v of this rank's shards on the host; the step runs there."""

    def __init__(self, engine, sub_group_size: int, pin_memory: bool = True):
        self.e = e = engine
        self.device = e.device
        self.pin = pin_memory and e.device.type == "cuda"   # pinning needs (and only helps) CUDA
        self.chunk = stream_chunk(e, sub_group_size)
        self.master = [self._host(n, torch.float32) for n in e.layout.group_local]
        self.gbuf = self._host(self.chunk, getattr(e.stage, "grad_dtype", e.dtype))   # the gradient chunk's staging
        self.bytes_down = self.bytes_up = 0       # running totals; per step: see report()
        self.steps = 0

    def _host(self, n: int, dtype) -> torch.Tensor:
        return torch.zeros(n, dtype=dtype, device="cpu", pin_memory=self.pin)

    def adopt(self, t: torch.Tensor) -> torch.Tensor:
        """An Adam state tensor, kept on the host (pinned with a GPU model)."""
        return t.pin_memory() if self.pin else t

    def write_master(self) -> None:
        """host master ← the parameter shards (after init, a weight edit, or an fp32 load)."""
        e = self.e
        for u in e.layout.units:
            self.master[u.group][u.local_offset:u.local_offset + u.shard].copy_(e.stage.param_shard(u))

    def after_load(self) -> None:
        # mixed: checkpoint.load wrote the master itself (engine.master is ours, more precise than
        # the bf16 params); fp32: the params were loaded, the host copy must follow them
        if not self.e.mixed:
            self.write_master()

    def step(self, coef: float, scale: float) -> None:
        e, opt, first = self.e, self.e.optimizer, set()
        gbuf = self.gbuf
        for u in e.layout.units:
            g_dev, p_dev = e.stage.grad_shard(u), e.stage.param_shard(u)
            master = self.master[u.group][u.local_offset:u.local_offset + u.shard]
            for a in range(0, max(u.shard, 1), self.chunk):
                b = min(a + self.chunk, u.shard)
                g = gbuf[:b - a]
                g.copy_(g_dev[a:b])                # device → host; blocking: Adam reads it next
                g32 = g.mul_(coef / scale) if not e.mixed else g.float().mul_(coef / scale)
                opt.step_group(u.group, master[a:b], g32, u.local_offset + a, u.local_offset + b,
                               count=u.group not in first)
                first.add(u.group)
                # host → device; from pinned memory it is asynchronous and overlaps the next chunk
                p_dev[a:b].copy_(master[a:b], non_blocking=self.pin)
                self.bytes_down += g.numel() * g.element_size()
                self.bytes_up += (b - a) * p_dev.element_size()
        if self.pin:                               # the params are read next: the copies must land
            torch.cuda.current_stream(self.device).synchronize()
        self.steps += 1

    def report(self) -> dict:
        """Bytes moved per optimizer step on this rank (mean over the steps run) and host bytes held."""
        n = max(self.steps, 1)
        held = sum(t.numel() * t.element_size() for t in self.master)
        held += sum(s[k].numel() * s[k].element_size() for s in self.e.optimizer.state for k in ("exp_avg", "exp_avg_sq"))
        return {"device": "cpu", "bytes_down_per_step": self.bytes_down // n, "bytes_up_per_step": self.bytes_up // n,
                "host_state_bytes": held, "pinned": self.pin}

    def close(self) -> None:
        pass


class NvmeOptimizerStates:
    """The engine's optimizer states of this rank, in files, stepped a chunk at a time."""

    def __init__(self, engine, nvme_path: str, sub_group_size: int):
        self.e, c = engine, engine.comm
        self.keys = (("master",) if engine.mixed else ()) + ("exp_avg", "exp_avg_sq")
        self.dir = os.path.join(nvme_path, f"{mp_prefix(*engine_mp(engine))}zero_rank{c.rank:03d}")
        self.chunk = stream_chunk(engine, sub_group_size)
        self.fds: dict = {}
        err = ""
        try:
            os.makedirs(self.dir, exist_ok=True)
            zero = torch.zeros(min(self.chunk, 1 << 20), dtype=torch.float32)
            for g, n in enumerate(engine.layout.group_local):
                for k in self.keys:
                    fd = self.fds[g, k] = os.open(os.path.join(self.dir, f"group{g}.{k}"), os.O_RDWR | os.O_CREAT
                                                  | os.O_TRUNC, 0o600)
                    for a in range(0, n, len(zero)):       # real bytes, not a sparse file: space is taken now
                        file_io(True, fd, zero[:min(len(zero), n - a)], 4 * a)
        except OSError as e:
            err = f"{e}"
        bad = failed_ranks(self.e.comm, bool(err))
        if bad:
            raise OffloadError(f"rank {c.rank}: offload_optimizer nvme_path {nvme_path!r} is not usable on rank(s) "
                               f"{bad}" + (f" ({err})" if err else "") + "; allowed: a writable folder with room for "
                               f"{len(self.keys) * 4}·Ψ/N bytes per rank")
        self.bytes_read = self.bytes_written = 0

    def _staging(self) -> dict:
        """One chunk per key, for one step (or write_master) only when freed blocks return to the
        system (allocator.maps()): between steps these bytes serve the forward and backward;
        otherwise allocated once and kept (pools.py says why)."""
        kept = getattr(self, "_kept", None)
        if kept is not None:
            return kept
        bufs = {k: torch.empty(self.chunk, dtype=torch.float32) for k in self.keys}
        if not allocator.maps():
            self._kept = bufs
        return bufs

    def _chunks(self):
        """(unit, a, b): the step order of the non-offloaded engine, cut at sub_group_size."""
        for u in self.e.layout.units:
            for a in range(0, max(u.shard, 1), self.chunk):
                yield u, a, min(a + self.chunk, u.shard)

    def write_master(self) -> None:
        """master file ← the model-dtype shards (refresh_master for an offloaded run)."""
        if not self.e.mixed:
            return
        buf = self._staging()["master"]
        for u, a, b in self._chunks():
            m = buf[:b - a]
            m.copy_(self.e.stage.param_shard(u)[a:b])
            file_io(True, self.fds[u.group, "master"], m, 4 * (u.local_offset + a))
            done_with(self.e.stage, u, grads=False) if b == u.shard else None

    def step(self, coef: float, scale: float) -> None:
        """Adam over every chunk: read (master,) m, v; step; write back; copy master into the params."""
        e, err = self.e, ""
        opt, first, staging = e.optimizer, set(), self._staging()
        try:
            for u, a, b in self._chunks():
                n, off = b - a, 4 * (u.local_offset + a)
                bufs = {k: staging[k][:n] for k in self.keys}
                for k, t in bufs.items():
                    file_io(False, self.fds[u.group, k], t, off)
                g = e.stage.grad_shard(u)[a:b]
                g32 = g.mul_(coef / scale) if not e.mixed else g.float().mul_(coef / scale)
                master = bufs["master"] if e.mixed else e.stage.param_shard(u)[a:b]
                st = opt.state[u.group]
                keep = st["exp_avg"], st["exp_avg_sq"]
                st["exp_avg"], st["exp_avg_sq"] = bufs["exp_avg"], bufs["exp_avg_sq"]
                try:
                    opt.step_group(u.group, master, g32, 0, n, count=u.group not in first)
                finally:
                    st["exp_avg"], st["exp_avg_sq"] = keep
                first.add(u.group)
                if e.mixed:
                    e.stage.param_shard(u)[a:b].copy_(master)
                for k, t in bufs.items():
                    file_io(True, self.fds[u.group, k], t, off)
                if b == u.shard:
                    done_with(e.stage, u)       # its parameter and gradient shards leave memory
                self.bytes_read += 4 * n * len(self.keys)
                self.bytes_written += 4 * n * len(self.keys)
        except OSError as ex:
            err = f"{ex}"
        bufs = None
        bad = failed_ranks(self.e.comm, bool(err))
        if bad:
            raise OffloadError(f"rank {e.comm.rank}: the optimizer step failed writing/reading offloaded states on "
                               f"rank(s) {bad}" + (f" ({err})" if err else "") + f" under {self.dir!r}: this run's "
                               "states are now inconsistent; free space and resume from the last checkpoint "
                               "(the step never touches it)")

    @contextlib.contextmanager
    def in_memory(self):
        """The states as ordinary tensors (engine.master, optimizer.state) inside the block, for
        checkpoint save/load; written back and freed after. Transient cost: K·Ψ/N bytes."""
        e = self.e
        full = {(g, k): torch.empty(n, dtype=torch.float32) for g, n in enumerate(e.layout.group_local)
                for k in self.keys}
        for (g, k), t in full.items():
            file_io(False, self.fds[g, k], t, 0)
        keep_master, keep_state = e.master, [(s["exp_avg"], s["exp_avg_sq"]) for s in e.optimizer.state]
        if e.mixed:
            e.master = [full[g, "master"] for g in range(len(e.layout.group_local))]
        for g, s in enumerate(e.optimizer.state):
            s["exp_avg"], s["exp_avg_sq"] = full[g, "exp_avg"], full[g, "exp_avg_sq"]
        try:
            yield
            for (g, k), t in full.items():
                file_io(True, self.fds[g, k], t, 0)
        finally:
            e.master = keep_master
            for s, (m, v) in zip(e.optimizer.state, keep_state):
                s["exp_avg"], s["exp_avg_sq"] = m, v

    def close(self) -> None:
        for fd in self.fds.values():
            os.close(fd)
        self.fds = {}


def build(engine, spec: dict | None, sub_group_size: int):
    """The engine's offload: NvmeOptimizerStates, HostOptimizerStates, or None."""
    if spec is None:
        return None
    if spec["device"] == "cpu":     # ignore_unused_parameters false: DeepSpeed's check at the step (unused_params.py)
        return unused_params.wrap(engine, HostOptimizerStates(engine, sub_group_size, spec.get("pin_memory", True)))
    if engine.device.type != "cpu":
        # the file streaming reads into host buffers and steps there: a GPU model would need the
        # cpu offload's copies in between, not built for nvme
        raise ValueError(f"rank {engine.comm.rank}: zero_optimization.offload_optimizer {{'device': 'nvme'}} with a "
                         f"model on {engine.device} is not supported by this engine; allowed: a CPU model, or "
                         "{'device': 'cpu'} for a GPU model")
    return unused_params.wrap(engine, NvmeOptimizerStates(engine, spec["nvme_path"], sub_group_size))
