"""save_checkpoint / load_checkpoint for the pipeline engine, in DeepSpeed's pipeline layout.

    engine.save_checkpoint("ckpt")                 # every rank calls it (collective: a barrier)
    path, client_state = engine.load_checkpoint("ckpt")     # tag from ckpt/latest

    ckpt/latest                                   the tag, written by global rank 0 last
    ckpt/global_stepN/layer_XX-model_states.pt    layer XX's state_dict, written by data replica 0 of
                                                  its stage (a tied layer where it calls the module
                                                  itself, as DeepSpeed's forward_funcs)
    ckpt/global_stepN/mp_rank_SS_model_states.pt  per model-parallel rank (stage·tp + tp rank): optimizer,
                                                  lr_scheduler, counters, loss scaler, client state
ZeRO-1 adds zero_pp_rank_D_mp_rank_SS_optim_states.pt per replica (engine/zero1.py writes it).
Loading restores weights, optimizer, scheduler and counters (a bit-exact resume); load_module_only=True
also reads a folder of layer files alone (convert.py's hf_to_pp output).
Cost: each stage's parameters + optimizer state written once (by replica 0), read by every replica.
"""
from __future__ import annotations

import os

import torch
import torch.distributed as dist

from pipeline_parallel.engine.layers import Tied
from zero_from_scratch.engine.atomic import atomic_write
from zero_from_scratch.engine.checkpoint_ds import DS_KEYS, DS_VERSION   # the release whose layout this is, its keys
from zero_from_scratch.engine.checkpoint_read import no_latest, tag_folder


def mp_rank(engine) -> int:
    return engine.stage * engine.tp + engine.tp_rank


def saved_layers(engine):
    """(global layer index, module whose state_dict is that layer's file) for this rank's layers."""
    out = []
    for ch in engine.chunks:
        for i in range(ch.start, ch.stop):
            m = ch.layers[str(i)]
            if isinstance(m, Tied):
                if m.forward_fn is None:
                    out.append((i, m.shared))
            elif any(True for _ in m.state_dict()):
                out.append((i, m))
    return out


def layer_path(d, i):
    """Layer i's file in folder d (i = "*": the glob of every layer file)."""
    return os.path.join(d, f"layer_{i:02d}-model_states.pt" if isinstance(i, int) else f"layer_{i}-model_states.pt")


def optimizer_state(engine) -> dict:
    """The optimizer's state_dict; with bf16/fp16 DeepSpeed's FP16_UnfusedOptimizer shape: the inner
    optimizer's state under optimizer_state_dict and the fp32 masters under fp32_groups."""
    if engine.mixed is None:
        return engine.optimizer.state_dict()
    return {"optimizer_state_dict": engine.optimizer.state_dict(),
            "fp32_groups": [m.detach().clone() for m in engine.mixed.master],
            **(engine.scaler.state_dict() if engine.scaler is not None else {})}


def load_optimizer_state(engine, sd: dict) -> None:
    if engine.mixed is None:
        engine.optimizer.load_state_dict(sd)
        return
    engine.optimizer.load_state_dict(sd["optimizer_state_dict"])
    with torch.no_grad():
        for m, saved in zip(engine.mixed.master, sd["fp32_groups"]):
            m.copy_(saved)


def save_checkpoint(engine, save_dir, tag=None, client_state=None, save_latest=True):
    """DeepSpeed's pipeline layout; every rank calls it (PipelineEngine.save_checkpoint)."""
    tag = str(tag if tag is not None else f"global_step{engine.global_steps}")
    d = os.path.join(save_dir, tag)
    os.makedirs(d, exist_ok=True)
    if engine.dp_rank == 0:
        for i, m in saved_layers(engine):
            torch.save(m.state_dict(), layer_path(d, i))
        state = dict(module=None, optimizer=None if engine.zero1 else optimizer_state(engine),
                     lr_scheduler=engine.lr_scheduler.state_dict() if engine.lr_scheduler is not None else None,
                     global_steps=engine.global_steps, global_samples=engine.global_samples,
                     skipped_steps=engine.skipped_steps, dp_world_size=engine.dp, mp_world_size=engine.pp * engine.tp,
                     loss_scaler=engine.scaler.state_dict() if engine.scaler is not None else None,
                     ds_config=engine.cfg.raw, ds_version=DS_VERSION, **(client_state or {}))
        torch.save(state, os.path.join(d, f"mp_rank_{mp_rank(engine):02d}_model_states.pt"))
    if engine.zero1:
        engine.zero1.save(os.path.join(d, f"zero_pp_rank_{engine.dp_rank}_mp_rank_{mp_rank(engine):02d}_optim_states.pt"))
    dist.barrier()
    if save_latest and dist.get_rank() == 0:
        atomic_write(os.path.join(save_dir, "latest"), lambda f: f.write(tag.encode()))
    dist.barrier()
    return True


def load_checkpoint(engine, load_dir, tag=None, load_module_strict=True, load_optimizer_states=True,
                    load_lr_scheduler_states=True, load_module_only=False):
    """(path, client_state) like DeepSpeed's; (None, None) when there is no checkpoint to load."""
    if no_latest(load_dir, tag):
        return None, None
    d = tag_folder(load_dir, tag)
    for i, m in saved_layers(engine):
        if not os.path.isfile(layer_path(d, i)):
            raise FileNotFoundError(f"rank {engine.rank}: {layer_path(d, i)} is missing: the checkpoint was saved "
                                    "with another layer list or partition")
        m.load_state_dict(torch.load(layer_path(d, i), map_location="cpu", weights_only=False), strict=load_module_strict)
    engine.tied.broadcast_initial()           # DeepSpeed's _synchronize_tied_weights after loading
    path = os.path.join(d, f"mp_rank_{mp_rank(engine):02d}_model_states.pt")
    if load_module_only and not os.path.isfile(path):
        return d, {}                          # layer files alone (pipeline_parallel/convert.py hf_to_pp)
    state = torch.load(path, map_location="cpu", weights_only=False)
    if not load_module_only:
        if load_optimizer_states:
            if engine.zero1:
                engine.zero1.load(os.path.join(d, f"zero_pp_rank_{engine.dp_rank}_mp_rank_{mp_rank(engine):02d}"
                                                  "_optim_states.pt"))
            elif state.get("optimizer") is not None:
                load_optimizer_state(engine, state["optimizer"])
        if load_lr_scheduler_states and engine.lr_scheduler is not None and state.get("lr_scheduler") is not None:
            engine.lr_scheduler.load_state_dict(state["lr_scheduler"])
        if engine.scaler is not None and state.get("loss_scaler") is not None:
            engine.scaler.load_state_dict(state["loss_scaler"])
        engine.global_steps, engine.global_samples = state["global_steps"], state.get("global_samples", 0)
        engine.skipped_steps = state.get("skipped_steps", 0)
    return path, {k: v for k, v in state.items() if k not in DS_KEYS and k != "loss_scaler"}
