"""Parameter offload at ZeRO-3: DeepSpeed's `zero_optimization.offload_param` (ZeRO-Infinity's
parameter half; with offload_optimizer too, both halves).

    "zero_optimization": {"stage": 3, "offload_param": {"device": "nvme", "nvme_path": "/local_nvme", "max_in_cpu": 0},
                          "offload_optimizer": {"device": "nvme", "nvme_path": "/local_nvme"}}
    python -m pytest -q tests/test_param_offload.py

Where a rank's parameter shards (Ψ/N elements, model dtype, b bytes each) live between uses:
  device "cpu"   host tensors (pinned with a CUDA model unless "pin_memory": false)
  device "nvme"  NVME_PATH/zero_rank{r}/params.group{g}, except the first max_in_cpu elements (whole
                 units, a prefix in unit order), which stay in host tensors (DeepSpeed keeps up to max_in_cpu
                 elements of the partitions in CPU memory; its default 1e9 keeps a model below that
                 size entirely there: set 0 to move every shard to the files)
An all-gather (forward, backward, prefetch: stage3.py) reads this rank's shard straight into its
own block of the unit buffer it fills (read_into), so the shard is never in memory twice and the
store needs no buffer of its own for it. Only a writer (the optimizer step, a checkpoint load,
gathered_parameters(modifier_rank=)) holds shards in buffers, at most buffer_count of them, each
≤ buffer_size elements (a larger unit shard is refused at start-up, as DeepSpeed's swap buffers
would be too small); a new one evicts the oldest, writing it back, and a flush (after the step,
after a load, before each forward) writes back the rest and frees the buffers.
DeepSpeed preallocates buffer_count × buffer_size pinned elements; here a pool (pools.py) holds
buffers of the shards' exact sizes while a writer works, none between flushes.
Bytes moved per optimizer step and rank, b·S with S = this rank's shard elements (P/N):
  read    (number of gathers of a unit per step)·b·S_unit, summed, + b·S for the step
          = (2·GA + 1)·b·S with no reuse or persistence (stage3_max_reuse_distance 0,
          stage3_param_persistence_threshold 0), GA = gradient_accumulation_steps
  written b·S (the stepped shards)
Memory per rank: −b·S (nvme, max_in_cpu 0), + ≤ buffer_count shards while a writer works.
Device "cpu" on a CPU model runs the same copies host → host: it moves bytes and saves nothing.
Gradients (make_grads): at ZeRO-3 with offload_optimizer "nvme" (CPU model) the gradient shards
live in NVME_PATH/zero_rank{r}/grads.group{g} beside the optimizer states: each reduce-scatter
lands in its unit's buffer, waited for and written back at once (one buffer per shard size in
backward), GRAD_BUFFERS shards at a time for the norm and the step; zero_grad forgets them. Memory:
−b·S; bytes per step: every unit written back after its reduce (GA times) and read by the norm
and the step (≈ (GA + 2)·b·S each way, GA − 1 reads fewer: the first micro-batch starts from zeros).
"""
from __future__ import annotations

import os
from collections import OrderedDict

import torch

from zero_from_scratch.engine import zero_partition as zp
from zero_from_scratch.engine.mpu import engine_mp, mp_prefix
from zero_from_scratch.engine.pools import Pool

DEVICES = ("none", "cpu", "nvme")
DEFAULTS = {"device": "none", "nvme_path": None, "pin_memory": True, "buffer_count": 5, "buffer_size": 100_000_000,
            "max_in_cpu": 1_000_000_000}   # DeepSpeed 0.19.8's DeepSpeedZeroOffloadParamConfig
GRAD_BUFFERS = 4           # gradient shards in memory at once (DeepSpeed's offload_optimizer buffer_count default)


class ParamOffloadError(RuntimeError):
    """A parameter shard could not be read or written."""


def parse(z: dict, stage: int) -> dict | None:
    """The offload_param section → its values with DeepSpeed's defaults (None = off)."""
    s = z.get("offload_param")
    if s in (None, {}, False) or (isinstance(s, dict) and str(s.get("device", "none")).lower() == "none"):
        return None
    if not isinstance(s, dict):
        raise ValueError(f"config key 'zero_optimization.offload_param' = {s!r} is invalid; allowed: a dict")
    bad = set(s) - set(DEFAULTS)
    if bad:
        raise ValueError(f"config keys {sorted('zero_optimization.offload_param.' + k for k in bad)} are not "
                         f"supported; allowed: {', '.join(DEFAULTS)}")
    spec = {**DEFAULTS, **s}
    if spec["device"] not in DEVICES:
        raise ValueError(f"config key 'zero_optimization.offload_param.device' = {spec['device']!r} is invalid; "
                         f"allowed: {list(DEVICES)}")
    if stage != 3:
        raise ValueError(f"config key 'zero_optimization.offload_param' needs stage 3 (got stage {stage}): DeepSpeed "
                         "offloads parameters only at stage 3; allowed: stage 3, or offload_optimizer at stages 1-2")
    for k in ("buffer_count", "buffer_size", "max_in_cpu"):
        v = spec[k]
        if isinstance(v, bool) or not isinstance(v, (int, float)) or v < (1 if k != "max_in_cpu" else 0) or int(v) != v:
            raise ValueError(f"config key 'zero_optimization.offload_param.{k}' = {v!r} is invalid; allowed: an int "
                             f">= {1 if k != 'max_in_cpu' else 0} (elements{', buffers' if k == 'buffer_count' else ''})")
        spec[k] = int(v)
    if spec["device"] == "nvme" and not spec["nvme_path"]:
        raise ValueError("config key 'zero_optimization.offload_param.nvme_path' is required with device 'nvme'; "
                         "allowed: a writable folder")
    return spec


def file_io(write: bool, fd: int, t: torch.Tensor, offset: int) -> None:
    """Read or write all of t's bytes at byte offset (any dtype, bf16 included)."""
    mv = memoryview(t.view(torch.uint8).numpy()).cast("B") if t.numel() else memoryview(b"")
    fn, done = (os.pwritev if write else os.preadv), 0
    while done < len(mv):
        n = fn(fd, [mv[done:]], offset + done)
        if n <= 0:
            raise OSError(f"short {'write' if write else 'read'} at byte {offset + done}")
        done += n


class ParamStore:
    """Shards of this rank's trainable units off the model's device, asked for by unit. `source(u)`
    gives a unit's initial shard (the parameters), or None for all zeros (the gradients)."""

    def __init__(self, e, spec: dict, dtype, dev, name: str = "params", source=None):
        self.e, self.spec, self.name = e, spec, name
        self.rank, self.dtype, self.dev = e.comm.rank, dtype, dev
        self.units = e.layout.units
        self.b = torch.empty(0, dtype=self.dtype).element_size()
        big = [u for u in self.units if u.shard > spec["buffer_size"]]
        if big:
            raise ValueError(f"rank {self.rank}: zero_optimization.offload_param.buffer_size = {spec['buffer_size']:,} "
                             f"elements is smaller than unit {big[0].tag!r}'s shard ({big[0].shard:,}); allowed: "
                             f"≥ {max(u.shard for u in big):,} (DeepSpeed's swap buffers would not fit it either)")
        pin = spec["pin_memory"] and self.dev.type == "cuda"
        self.host: dict[int, torch.Tensor] = {}            # unit -> its shard in host memory
        self.fds: dict[int, int] = {}                       # group -> file (nvme)
        self.zeroed: set[int] = set() if source else {u.index for u in self.units}   # all zeros: nothing to read
        self.dir, budget, err = None, spec["max_in_cpu"] if spec["device"] == "nvme" else None, ""
        if spec["device"] == "nvme":
            self.dir = os.path.join(spec["nvme_path"], f"{mp_prefix(*engine_mp(e))}zero_rank{self.rank:03d}")
        for u in self.units:                               # source(u) may be collective: every rank, every unit
            src = source(u) if source else None
            if budget is None or u.shard <= budget:
                budget = None if budget is None else budget - u.shard
                self.host[u.index] = torch.empty(u.shard, dtype=self.dtype, pin_memory=pin)
                self.host[u.index].copy_(src) if src is not None else self.host[u.index].zero_()
            elif not err:                                   # the host part is a prefix, as DeepSpeed's
                budget = -1
                try:
                    fd = self._fd(u.group)
                    if src is not None:
                        file_io(True, fd, src.cpu(), self.b * u.local_offset)
                except OSError as ex:
                    err = f"{ex}"
            del src
        bad = failed_ranks(e.comm, bool(err))
        if bad:
            raise ParamOffloadError(f"rank {self.rank}: offload {name} nvme_path {spec['nvme_path']!r} is not usable on "
                                    f"rank(s) {bad}" + (f" ({err})" if err else "") + "; allowed: a writable folder "
                                    f"with room for {self.b}·Ψ/N bytes per rank")
        self.resident: OrderedDict[int, torch.Tensor] = OrderedDict()   # unit -> buffer on the device, oldest first
        self.pool = Pool(f"{name} shards", self.dtype, self.dev)          # the resident buffers, reused
        self.bytes_read = self.bytes_written = 0
        self.gathers = 0                                    # all-gathers that read a shard from the store

    def _fd(self, g: int) -> int:
        if g not in self.fds:
            os.makedirs(self.dir, exist_ok=True)
            self.fds[g] = os.open(os.path.join(self.dir, f"{self.name}.group{g}"), os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o600)
        return self.fds[g]

    def owns(self, u) -> bool:
        return u.index < len(self.units)                    # frozen units (frozen.py) stay with the stage

    # ------------------------------------------------------------------ in and out
    def shard(self, u) -> torch.Tensor:
        """u's shard in a buffer on the model's device (read in if absent). A writer may change it:
        it is written back when evicted or flushed."""
        buf = self.resident.get(u.index)
        if buf is not None:
            return buf
        victims = list(self.resident)
        while len(self.resident) >= self.spec["buffer_count"] and victims:
            self._evict(victims.pop(0))
        buf = self.resident[u.index] = self.pool.take(u.shard)
        if u.index in self.zeroed:                          # known zeros: nothing to read
            self.zeroed.discard(u.index)
            return buf.zero_()
        self._load(u, buf)
        return buf

    def _load(self, u, dst: torch.Tensor) -> None:
        try:
            if u.index in self.host:
                dst.copy_(self.host[u.index])
            else:
                tmp = dst if self.dev.type == "cpu" else torch.empty(u.shard, dtype=self.dtype)
                file_io(False, self.fds[u.group], tmp, self.b * u.local_offset)
                dst.copy_(tmp) if tmp is not dst else None
        except OSError as ex:
            raise ParamOffloadError(f"rank {self.rank}: reading the {self.name} shard of {u.tag!r} from {self.dir!r} "
                                    f"failed ({ex}); resume from the last checkpoint") from ex
        self.bytes_read += self.b * u.shard

    def _evict(self, i: int) -> None:
        buf = self.resident.pop(i)
        try:
            self._write_back(i, buf)
        finally:
            self.pool.give(buf)

    def _write_back(self, i: int, buf: torch.Tensor) -> None:
        u = self.units[i]
        try:
            if i in self.host:
                self.host[i].copy_(buf)
            else:
                file_io(True, self.fds[u.group], buf.cpu(), self.b * u.local_offset)
        except OSError as ex:
            raise ParamOffloadError(f"rank {self.rank}: writing the {self.name} shard of {u.tag!r} to {self.dir!r} "
                                    f"failed ({ex}); this run's parameters are inconsistent: resume from the last "
                                    "checkpoint") from ex
        self.bytes_written += self.b * u.shard

    def read_into(self, u, dst: torch.Tensor) -> None:
        """u's shard into dst (this rank's block of the buffer its all-gather fills): no buffer of
        the store's own, the shard never sits in memory twice."""
        buf = self.resident.get(u.index)
        if buf is not None:                                 # a writer holds it: its copy is the current one
            dst.copy_(buf)
            return
        dst.zero_() if u.index in self.zeroed else self._load(u, dst)
        self.gathers += 1

    def release(self, u, changed: bool = True) -> None:
        """The step is done with u's shard: written back if changed, its buffer to the pool for the
        next unit (a streaming reader holds one shard, not buffer_count)."""
        if u.index in self.resident:
            self._evict(u.index) if changed else self.pool.give(self.resident.pop(u.index))

    def flush(self, keep: bool = False) -> None:
        """Write back every resident shard a writer may have changed, and free all buffers (the
        next ones are needed only by the next writer: the all-gathers read into their own), or
        with keep, leave them idle in the pool for the next shard of their size."""
        for i in list(self.resident):
            self._evict(i)
        self.pool.clear() if not keep else None

    def zero_all(self) -> None:
        """Every shard is zeros (zero_grad): drop the buffers unwritten, read nothing until written."""
        for buf in self.resident.values():
            self.pool.give(buf)
        self.resident.clear()
        self.pool.clear()
        self.zeroed = {u.index for u in self.units}

    def report(self) -> dict:
        """Bytes moved per optimizer step (mean over the steps run), and where the shards are."""
        n, files = max(self.e.global_steps, 1), sum(u.shard for u in self.units if u.index not in self.host)
        return {"device": self.spec["device"], "bytes_read_per_step": self.bytes_read // n,
                "bytes_written_per_step": self.bytes_written // n, "gathers_per_step": self.gathers / n,
                "shard_bytes": self.b * sum(u.shard for u in self.units), "bytes_in_files": self.b * files,
                "bytes_in_host": self.b * (sum(u.shard for u in self.units) - files),
                "buffers": (self.spec["buffer_count"], self.spec["buffer_size"])}

    def close(self) -> None:
        for fd in self.fds.values():
            os.close(fd)
        self.fds = {}


def failed_ranks(comm, failed: bool) -> list[int]:
    """The ranks where an offload file operation failed (one small all-gather, not in the ledger's report)."""
    rows = comm.gather_ints([int(failed)], "offload check") if comm.size > 1 else [[int(failed)]]
    comm.usage.pop("offload check", None)
    return [r for r, (f,) in enumerate(rows) if f]


def make(stage) -> ParamStore | None:
    """The stage's parameter store, built from the module's parameters (plain or zero.Init's), or
    None without offload_param."""
    spec = getattr(stage.e.config, "offload_param", None)
    if spec is None:
        return None
    if stage.hpz and spec["device"] != "cpu":   # DeepSpeed: hpZ's secondary on the offload device (_partition_param_sec)
        raise ValueError(f"rank {stage.rank}: zero_optimization.offload_param device 'nvme' with "
                         "zero_hpz_partition_size > 1 is not supported by this engine: hpZ's secondary partition "
                         "lives in host memory here (as DeepSpeed places it for device 'cpu', _partition_param_sec), "
                         "not in files; allowed: device 'cpu', or one of the two")
    # qwZ reads each shard in to quantise it (qwz.py); qgZ reduces gradients, which stay in memory
    # each unit's block is assembled (zero_partition.unit_block: one unit whole at a time, Init's
    # shards read back and dropped) and written to its home at once: no Ψ/N copy in memory
    store = ParamStore(stage.e, spec, stage.dtype, stage.dev, source=stage._unit_block)
    zp.adopt(stage.e, stage.e.layout.units, stage.params)
    return store


def grads_go_to_files(e) -> bool:
    o = e.config.offload_optimizer
    return bool(o) and o["device"] == "nvme" and e.config.zero.stage == 3 and e.device.type == "cpu"


def make_grads(stage) -> ParamStore | None:
    """ZeRO-3 with offload_optimizer "nvme" on a CPU model: the gradient shards live in files too
    (DeepSpeed's optimizer swapper swaps them out as well), next to the optimizer states; at most
    GRAD_BUFFERS unit shards in memory at a time."""
    if not grads_go_to_files(stage.e):
        return None
    if stage.qgz:
        raise ValueError(f"rank {stage.rank}: offload_optimizer nvme at stage 3 with zero_quantized_gradients is not "
                         "supported by this engine (qgZ's reduction is not wired to gradient shards in files); "
                         "allowed: one of the two")
    o = stage.e.config.offload_optimizer
    spec = {"device": "nvme", "nvme_path": o["nvme_path"], "pin_memory": False, "buffer_count": GRAD_BUFFERS,
            "buffer_size": max((u.shard for u in stage.e.layout.units), default=0), "max_in_cpu": 0}
    store = ParamStore(stage.e, spec, stage.dtype, stage.dev, name="grads")
    for g in range(len(stage.e.layout.group_local)):
        stage.gshard[g] = torch.empty(0, dtype=stage.dtype, device=stage.dev)
    return store
