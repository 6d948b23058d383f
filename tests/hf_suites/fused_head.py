"""An LM head whose fused log-probability kernel reads `lm_head.weight` itself, under ZeRO-3 (2 ranks).

    torchrun --nproc_per_node 2 tests/hf_suites/fused_head.py deepspeed      (the installed DeepSpeed)
    torchrun --nproc_per_node 2 tests/hf_suites/fused_head.py ringzero       (served by ringzero's runner)
    torchrun --nproc_per_node 2 tests/hf_suites/fused_head.py ringzero trl 100000   (TRL's kernel, DeepSpeed's persistence)

TRL's SFT, DPO, KTO, GRPO and RLOO trainers replace the model's forward (trl/trainer/utils.py,
`add_fused_lm_head`): the backbone runs, then `ChunkedLogProbFunction` (trl/kernels/chunked_logprob.py)
projects the hidden states through `lm_head.weight` in vocabulary chunks without materialising the
logits. The head module itself is never called, so its ZeRO-3 hooks never gather: the forward reads
the weight inside `deepspeed.zero.GatheredParameters`, the Function saves the Parameter for backward,
and its backward gathers it again (`maybe_gather_lm_head_ctx`: only when `ds_status` is not AVAILABLE)
before recomputing each tile. DeepSpeed keeps the Parameter object, so the backward's own gather is
enough. `ChunkedLogProb` below is TRL's kernel on its torch path (no Triton on CPU), without the
optional outputs (entropy, top-1); `kernel="trl"` runs TRL's own on a tiny Llama instead.
The loss is the mean negative log-probability of the next token. Cost: a few steps of a tiny model.
"""
from __future__ import annotations

import contextlib
import os
import sys

import torch
import torch.nn as nn

VOCAB, HIDDEN, SEQ, BATCH, CHUNK = 64, 16, 8, 2, 24     # CHUNK: three vocabulary tiles, the last one short


def config(stage: int = 3, persist: int = 0) -> dict:
    """fp32, torch's Adam on both engines; persistence 0 (the default here) so that every weight is partitioned
    and the kernel's gathers run; DeepSpeed's default 1e5 keeps the head gathered from the first step on, so the
    kernel saves and reads it outside any gather (what TRL meets on a tiny model)."""
    return {"train_micro_batch_size_per_gpu": BATCH, "gradient_accumulation_steps": 1, "steps_per_print": 1000,
            "optimizer": {"type": "Adam", "params": {"lr": 1e-2, "weight_decay": 0.0, "torch_adam": True}},
            "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": persist}}


ZERO3 = []     # non-empty while an engine trains (TRL asks transformers' is_deepspeed_zero3_enabled())


def maybe_gathered(*params):
    """trl.trainer.utils.maybe_gather_lm_head_ctx: gather what ZeRO-3 partitioned and nothing already gathered
    (reading `ds_status` of every parameter given, as TRL does)."""
    if not ZERO3:
        return contextlib.nullcontext()
    import deepspeed
    from deepspeed.runtime.zero.partition_parameters import ZeroParamStatus
    todo = {id(p): p for p in params if p is not None and p.ds_status != ZeroParamStatus.AVAILABLE}
    return deepspeed.zero.GatheredParameters(list(todo.values())) if todo else contextlib.nullcontext()


class ChunkedLogProb(torch.autograd.Function):
    """log p(target) of `hidden @ weight.T`, one vocabulary tile at a time (TRL's ChunkedLogProbFunction)."""

    @staticmethod
    def forward(ctx, hidden, weight, targets, chunk):
        n = hidden.shape[0]
        run_max = torch.full((n,), float("-inf"))
        sum_exp, target_logit = torch.zeros(n), torch.zeros(n)
        for start in range(0, weight.shape[0], chunk):
            z = hidden @ weight[start:start + chunk].t()
            new_max = torch.maximum(run_max, z.amax(-1))
            sum_exp = sum_exp * torch.exp(run_max - new_max) + torch.exp(z - new_max[:, None]).sum(-1)
            run_max = new_max
            local = targets - start
            inside = (local >= 0) & (local < z.shape[1])
            picked = z.gather(-1, local.clamp(0, z.shape[1] - 1)[:, None])[:, 0]
            target_logit = torch.where(inside, picked, target_logit)
        log_z = run_max + torch.log(sum_exp)
        ctx.save_for_backward(hidden, weight, targets, log_z)   # the Parameter itself, as TRL saves it
        ctx.chunk = chunk
        return target_logit - log_z

    @staticmethod
    def backward(ctx, grad_logprobs):
        hidden, weight, targets, log_z = ctx.saved_tensors
        with maybe_gathered(weight):            # the kernel's own re-gather: the head's hooks never ran
            grad_hidden, grad_weight = torch.zeros_like(hidden), torch.zeros(weight.shape)
            for start in range(0, weight.shape[0], ctx.chunk):
                w = weight[start:start + ctx.chunk]
                p = torch.exp(hidden @ w.t() - log_z[:, None])
                is_target = torch.arange(start, start + w.shape[0]) == targets[:, None]
                g = grad_logprobs[:, None] * (is_target.float() - p)      # d log p_t / dz_j = 1[j = t] - p_j
                grad_hidden += g @ w
                grad_weight[start:start + w.shape[0]] += g.t() @ hidden
        return grad_hidden, grad_weight, None, None


class TinyLM(nn.Module):
    """Embedding, one tanh layer, a head the forward never calls (TRL's patched forward reads its weight)."""

    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, HIDDEN)
        self.layer = nn.Linear(HIDDEN, HIDDEN)
        self.lm_head = nn.Linear(HIDDEN, VOCAB, bias=False)

    def forward(self, ids):
        hidden = torch.tanh(self.layer(self.embed(ids)))[:, :-1].reshape(-1, HIDDEN)
        weight = self.lm_head.weight
        with maybe_gathered(weight):            # TRL: `with autocast_ctx, maybe_gather_lm_head_ctx(weight, bias):`
            logprobs = ChunkedLogProb.apply(hidden, weight, ids[:, 1:].reshape(-1), CHUNK)
        return -logprobs.mean()


def batches(rank: int, steps: int) -> list[torch.Tensor]:
    """Token ids of each step on `rank` (a fixed generator: the same on every engine)."""
    g = torch.Generator().manual_seed(100 + rank)
    return [torch.randint(0, VOCAB, (BATCH, SEQ), generator=g) for _ in range(steps)]


def trl_model():
    """A tiny Llama with TRL's own fused head (trl.trainer.utils.add_fused_lm_head)."""
    from transformers import LlamaConfig, LlamaForCausalLM
    from trl.trainer.utils import add_fused_lm_head
    cfg = LlamaConfig(vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=32, num_hidden_layers=1,
                      num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=SEQ)
    model = LlamaForCausalLM(cfg)
    add_fused_lm_head(model)
    return model


def train(ds, steps: int = 4, stage: int = 3, kernel: str = "ours", persist: int = 0) -> list[float]:
    """`steps` optimizer steps on this rank; returns the losses (each rank's own micro-batch)."""
    torch.manual_seed(0)
    cfg = config(stage, persist)
    keep = None
    if kernel == "trl":
        from transformers.integrations import HfDeepSpeedConfig
        keep = HfDeepSpeedConfig(cfg)      # noqa: F841  what the Trainer makes: TRL's gather asks it for ZeRO-3
        model = trl_model()
    else:
        model = TinyLM()
    engine, *_ = ds.initialize(model=model, model_parameters=model.parameters(), config=cfg)
    ZERO3[:] = [stage == 3]
    losses = []
    for ids in batches(ds.comm.get_rank(), steps):
        if kernel == "trl":
            loss = engine(input_ids=ids, labels=ids, fused_lm_head=True).loss
        else:
            loss = engine(ids)
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    del keep
    return losses


def reference(steps: int = 4, world: int = 2) -> list[list[float]]:
    """The same training in one process without ZeRO: each step's gradient is the ranks' mean, as data
    parallelism makes it. Returns each rank's losses."""
    torch.manual_seed(0)
    model = TinyLM()
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    data = [batches(r, steps) for r in range(world)]
    out = [[] for _ in range(world)]
    for s in range(steps):
        opt.zero_grad()
        for r in range(world):
            loss = model(data[r][s])
            (loss / world).backward()
            out[r].append(loss.item())
        opt.step()
    return out


if __name__ == "__main__":
    usage = f"usage: torchrun --nproc_per_node 2 {sys.argv[0]} {{deepspeed,ringzero}} [ours|trl] [PERSISTENCE]"
    if sys.argv[1:2] in (["-h"], ["--help"]):
        raise SystemExit(print(f"{usage}\n\n{__doc__.strip()}"))
    if len(sys.argv) < 2 or sys.argv[1] not in ("deepspeed", "ringzero") or sys.argv[2:3] not in ([], ["ours"], ["trl"]) \
            or not all(a.isdigit() for a in sys.argv[3:4]) or len(sys.argv) > 4:
        raise SystemExit(usage)
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
    from tests.ds_unit.harness import import_deepspeed
    ds = import_deepspeed(sys.argv[1])
    ds.init_distributed(dist_backend="gloo")
    print(f"LOSSES rank {ds.comm.get_rank()}", train(ds, kernel=(sys.argv[2:3] or ["ours"])[0],
                                                      persist=int((sys.argv[3:4] or ["0"])[0])), flush=True)
