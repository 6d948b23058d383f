"""The output keys DeepSpeed prints from: steps_per_print, wall_clock_breakdown, comms_logger, flops_profiler.

    "steps_per_print": 1, "wall_clock_breakdown": true, "comms_logger": {"enabled": true}
    python -m zero_from_scratch.engine.wall_clock          # a 2-rank demo of all four, ~3 s

install(engine) wraps the engine's forward, backward and optimizer step with timers (on this engine
instance only, and only when one of the keys is set) and prints on rank 0 after each optimizer step:
  steps_per_print n       every n steps DeepSpeed's progress line "step=…, skipped=…, lr=[…], mom=[…]"
  wall_clock_breakdown    DeepSpeed's global timers, summed over the step's micro-batches, in ms:
                          "time (ms) | fwd: … | bwd: … | bwd_inner: … | bwd_allreduce: … | step: …"
                          bwd_allreduce = the time inside gradient collectives during backward (the
                          ledger's, engine/comm.py), bwd_inner = bwd − bwd_allreduce (DeepSpeed's split)
  comms_logger            per collective: calls, message size, latency, algbw, busbw (comms_logger.py),
                          every steps_per_print steps (every step when steps_per_print is absent)
  dump_state              at initialise, every attribute of the engine and of its config, one line each
                          (DeepSpeed's print_configuration), values cut at 120 characters
  flops_profiler          per-module FLOPs/MACs of step profile_step's first forward (flops_profiler.py)
engine.wall_clock (a list of dicts, one per step) and engine.comms_log (the last table's rows) keep the
numbers. Cost: perf_counter calls and, when printing, a line or a table per step on rank 0.
"""
from __future__ import annotations

import time

from primitives.log import print0
from zero_from_scratch.engine import comms_logger, flops_profiler
from zero_from_scratch.engine.comm import expert_comms


def parse(raw: dict) -> dict:
    spp = raw.get("steps_per_print")
    # inf: accelerate's way of silencing DeepSpeed's progress line (never due: global_steps % inf != 0)
    if spp is not None and spp != float("inf") and (isinstance(spp, bool) or not isinstance(spp, int) or spp < 1):
        raise ValueError(f"config key 'steps_per_print' = {spp!r} is invalid; allowed: an int >= 1, or inf (never)")
    wcb = raw.get("wall_clock_breakdown", False)
    if not isinstance(wcb, bool):
        raise ValueError(f"config key 'wall_clock_breakdown' = {wcb!r} is invalid; allowed: true/false")
    return {"steps_per_print": spp, "wall_clock_breakdown": wcb, "comms_logger": comms_logger.parse(raw),
            "flops_profiler": flops_profiler.parse(raw), "dump_state": bool(raw.get("dump_state", False))}


class Instruments:
    def __init__(self, engine, spec: dict):
        self.engine, self.spec = engine, spec
        self.t = {"fwd": 0.0, "bwd": 0.0}
        self.flops = {}                               # flops_profiler's rows, once counted
        engine.wall_clock, engine.comms_log, engine.flops_profile = [], [], None
        fwd, bwd, step = engine.forward, engine.backward, engine._optimizer_step

        def forward(*a, **k):
            fp = self.spec["flops_profiler"]
            prof = None
            if fp and engine.global_steps == fp["profile_step"] and engine.comm.global_rank == 0 and not self.flops:
                numels = {sl.name: sl.numel for u in engine.layout.units for sl in u.slots}
                prof = flops_profiler.Profile(engine.module, numels)   # this step's first forward, rank 0
            t0 = time.perf_counter()
            out = fwd(*a, **k)
            if prof is not None:
                self.flops = prof.stop()
            self.t["fwd"] += time.perf_counter() - t0
            return out

        def backward(loss, *a, **k):
            t0 = time.perf_counter()
            out = bwd(loss, *a, **k)
            self.t["bwd"] += time.perf_counter() - t0
            return out

        def optimizer_step():
            grads = sum(u.seconds for c in (engine.comm, *expert_comms(engine).values())
                        for p, u in c.usage.items() if p.startswith("grad "))
            t0 = time.perf_counter()
            step()                                    # ends with comm.reset_step(): usage → last_step
            self.after_step(1e3 * grads, 1e3 * (time.perf_counter() - t0))
        # instance attributes: nn.Module.__call__ and engine.step() look these up first
        engine.forward, engine.backward, engine._optimizer_step = forward, backward, optimizer_step

    def after_step(self, grads_ms: float, step_ms: float) -> None:
        e, spp = self.engine, self.spec["steps_per_print"]
        row = {"fwd": 1e3 * self.t["fwd"], "bwd": 1e3 * self.t["bwd"], "bwd_allreduce": grads_ms, "step": step_ms}
        row["bwd_inner"] = row["bwd"] - grads_ms
        e.wall_clock.append(row)
        self.t = {"fwd": 0.0, "bwd": 0.0}
        due = spp is not None and e.global_steps % spp == 0
        if due:
            mom = [list(g["betas"]) if "betas" in g else g.get("momentum") for g in e.optimizer.param_groups]  # SGD
            print0(f"step={e.global_steps}, skipped={e.skipped_steps}, lr={e.get_lr()}, mom={mom}")
        if self.spec["wall_clock_breakdown"]:
            print0("time (ms) | " + " | ".join(f"{k}: {row[k]:.2f}" for k in
                                               ("fwd", "bwd", "bwd_inner", "bwd_allreduce", "step")))
        fp = self.spec["flops_profiler"]
        if fp and self.flops and e.flops_profile is None:
            e.flops_profile = self.flops
            text = flops_profiler.report(self.flops, fp, e.global_steps - 1)
            print0(text)
            if fp["output_file"]:
                with open(fp["output_file"], "w") as f:
                    f.write(text + "\n")
        cl = self.spec["comms_logger"]
        if cl is not None:
            e.comms_log = comms_logger.rows(e.comm.last_step, e.comm.size, cl["prof_ops"]) + [
                r for c in expert_comms(e).values() for r in comms_logger.rows(c.last_step, c.size, cl["prof_ops"])]
            if due or spp is None:
                print0(comms_logger.render(e.comms_log, e.global_steps))


def install(engine) -> Instruments | None:
    """Instruments for the keys set in engine.config.instruments; None when none is."""
    spec = engine.config.instruments
    if spec["dump_state"] and engine.comm.global_rank == 0:   # DeepSpeed's print_configuration(engine)
        for title, obj in (("DeepSpeedEngine", engine), ("DeepSpeedEngine configuration", engine.config)):
            print0(f"{title}:")
            for k in sorted(vars(obj)):
                v = repr(getattr(obj, k)).replace("\n", " ")
                print0(f"  {k} {'.' * (29 - len(k))} {v[:120] + ('…' if len(v) > 120 else '')}", markup=False)
    if not any(v for k, v in spec.items() if k != "dump_state"):
        return None
    return Instruments(engine, spec)


def _demo(rank, world):
    import torch          # the demo's own model and batches; the instruments need nothing of torch's
    import zero_from_scratch                              # the package imports this module: a cycle at the top
    from zero_from_scratch.engine.models import TinyMLP   # only the demo needs a model
    torch.manual_seed(0)
    cfg = {"train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 2, "steps_per_print": 1,
           "wall_clock_breakdown": True, "comms_logger": {"enabled": True}, "zero_optimization": {"stage": 2},
           "flops_profiler": {"enabled": True, "profile_step": 1}}
    engine, *_ = zero_from_scratch.initialize(model=TinyMLP(), config=cfg)
    for _ in range(2 * 2):
        engine.backward(engine(torch.randn(4, 13), torch.randint(0, 3, (4,))).loss)
        engine.step()


if __name__ == "__main__":       # python -m zero_from_scratch.engine.wall_clock: 2 ranks, 2 steps, ~3 s
    from primitives.launch import spawn
    spawn(_demo, 2)
