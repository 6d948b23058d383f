"""DeepSpeed's `tensorboard` and `csv_monitor` config sections, honoured by the ZeRO engine.

    "tensorboard": {"enabled": true, "output_path": "runs/", "job_name": "zero2"},
    "csv_monitor": {"enabled": true, "output_path": "runs/", "job_name": "zero2"}
    tensorboard --logdir runs/zero2

Same places and names as DeepSpeed (deepspeed/monitor/): rank 0 writes to
os.path.join(output_path, job_name); TensorBoard scalars and one CSV file per tag
(`Train_Samples_lr.csv`, header `step,lr`), the x axis being the number of samples trained
(global_samples = optimizer steps × train_batch_size). Tags, one event each per optimizer step:
  Train/Samples/lr              the lr after this step's scheduler update, i.e. the next step's
                                (DeepSpeed's tag, logged at the same moment)
  Train/Samples/loss_scale      fp16 only (DeepSpeed's tag)
  Train/Samples/train_loss      mean loss of this step's micro-batches, averaged over the
                                data-parallel ranks (DeepSpeed's pipeline engine's tag and
                                _aggregate_total_loss: all-reduce of each rank's mean, ÷ N)
  Train/Samples/grad_norm       the global gradient norm before clipping (inf on a skipped step)
  Train/Samples/samples_per_sec train_batch_size / wall time since the previous step
Cost: one 8-byte all-gather at start-up (an unwritable path fails on every rank); per step the
rank's mean loss rides on the gradient-norm all-reduce (8 more bytes in the same message, no extra
round) at stages 1-3, and takes one 8-byte all-reduce of its own at stage 0 (which has no norm
all-reduce) — only when a monitor is enabled. Rank 0 flushes the files after every step (a crash
loses nothing logged).
"""
from __future__ import annotations

import csv
import os
import time
from dataclasses import dataclass

SECTIONS = ("tensorboard", "csv_monitor")
KEYS = {"enabled", "output_path", "job_name"}


@dataclass
class MonitorConfig:
    enabled: bool = False
    output_path: str = ""                 # DeepSpeed's default: relative to the working directory
    job_name: str = "DeepSpeedJobName"

    @property
    def log_dir(self) -> str:
        return os.path.join(self.output_path, self.job_name)


def parse(raw: dict) -> dict[str, MonitorConfig]:
    """{section: MonitorConfig} for the sections present in a DeepSpeed config dict."""
    out = {}
    for sec in SECTIONS:
        s = raw.get(sec)
        if s is None:
            continue
        if not isinstance(s, dict):
            raise ValueError(f"config key {sec!r} = {s!r} is invalid; allowed: a dict with keys {sorted(KEYS)}")
        bad = set(s) - KEYS
        if bad:
            raise ValueError(f"config keys {sorted(f'{sec}.{k}' for k in bad)} are not supported; allowed: {sorted(KEYS)}")
        c = MonitorConfig(bool(s.get("enabled", False)), str(s.get("output_path", "")),
                          str(s.get("job_name", "DeepSpeedJobName")))
        if c.enabled and not c.job_name:
            raise ValueError(f"config key '{sec}.job_name' is empty; allowed: a folder name")
        out[sec] = c
    return out


class Monitors:
    def __init__(self, cfgs: dict[str, MonitorConfig], comm, train_batch_size: int):
        self.cfgs = {k: c for k, c in cfgs.items() if c.enabled}
        self.comm, self.tbs = comm, train_batch_size
        self.enabled = bool(self.cfgs)
        self.tb = None
        self.csv_dir = None
        self.losses: list[float] = []
        self.t_last = time.perf_counter()
        if not self.enabled:
            return
        err = ""
        # one writer for the run: the global rank 0 (with an mpu, every tp rank has a dp rank 0)
        self.writer = getattr(comm, "global_rank", comm.rank) == 0
        if self.writer:
            try:
                for sec, c in self.cfgs.items():
                    os.makedirs(c.log_dir, exist_ok=True)
                    if not os.access(c.log_dir, os.W_OK):
                        raise PermissionError(f"{c.log_dir!r} is not writable")
                    if sec == "tensorboard":
                        from torch.utils.tensorboard import SummaryWriter  # optional dependency
                        self.tb = SummaryWriter(log_dir=c.log_dir)
                    else:
                        self.csv_dir = c.log_dir
            except (OSError, ImportError) as e:
                err = f"{sec}: {e}"
        ok = comm.gather_ints([0 if err else 1], "monitor setup") if comm.size > 1 else [[0 if err else 1]]
        if err or not ok[0][0]:
            raise RuntimeError(f"rank {comm.rank}: cannot start the {'/'.join(self.cfgs)} monitor on rank 0"
                               + (f" ({err})" if err else "") + "; check output_path (needs a writable folder, "
                               "and `pip install tensorboard` for the tensorboard section)")

    def record_loss(self, loss) -> None:
        if self.enabled:
            self.losses.append(float(loss.detach().float()))

    def local_loss(self) -> float | None:
        """This rank's mean micro-batch loss since the last step (None when no monitor is on):
        the engine all-reduces it with the gradient norm and passes the mean to write_step."""
        if not self.enabled:
            return None
        # nan, not None, when no backward ran: every rank must send the same message size
        return sum(self.losses) / len(self.losses) if self.losses else float("nan")

    def write_step(self, engine, mean_loss: float | None = None) -> None:
        """After each optimizer step (every rank calls; rank 0 writes). mean_loss: the mean over
        ranks of local_loss()."""
        if not self.enabled:
            return
        now = time.perf_counter()
        dt, self.t_last = now - self.t_last, now
        self.losses = []
        if not self.writer:
            return
        x = engine.global_steps * self.tbs
        ev = [("Train/Samples/lr", engine.get_lr()[0], x)]
        if engine.fp16_enabled():
            ev.append(("Train/Samples/loss_scale", engine.loss_scaler.loss_scale, x))
        if mean_loss is not None:
            ev.append(("Train/Samples/train_loss", mean_loss, x))
        ev.append(("Train/Samples/grad_norm", engine.get_global_grad_norm(), x))
        ev.append(("Train/Samples/samples_per_sec", self.tbs / dt if dt > 0 else float("inf"), x))
        self.write_events(ev)

    def write_events(self, events) -> None:
        if self.tb is not None:
            for tag, v, step in events:
                self.tb.add_scalar(tag, v, step)
            self.tb.flush()
        if self.csv_dir is not None:
            for tag, v, step in events:
                f = os.path.join(self.csv_dir, tag.replace("/", "_").replace(" ", "_") + ".csv")
                new = not os.path.exists(f)
                with open(f, "a", newline="") as fh:
                    w = csv.writer(fh)
                    if new:
                        w.writerow(["step", tag.rsplit("/", 1)[-1]])
                    w.writerow([step, v])
