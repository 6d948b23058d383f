"""deepspeed.moe.sharded_moe's gates (DeepSpeed 0.19.8): which expert each token goes to, at which slot.

    from deepspeed.moe.sharded_moe import TopKGate      (python -m zero_from_scratch.as_deepspeed SCRIPT)
    l_aux, capacity, E, indices, locations, gates, exp_counts = TopKGate(16, 4)(x, None, True)   # MOELayer's call

GShard's gate (arXiv 2006.16668): logits = x·Wg (fp32), softmax over E experts; top-1 (Switch),
top-2 (GShard), top-k. Each expert takes at most C = max(ceil(S/E · capacity_factor·k), min_capacity)
of the S tokens (drop_tokens=False: the largest expert count, MAX-reduced over the expert-parallel
group, so no token is dropped). l_aux, the load-balancing loss: top-1 E·Σ_e me_e·ce_e, top-2
E²·mean(me·ce), top-k E²/k·mean(me·ce) (me: mean gate value, ce: fraction of tokens routed).
Random draws take torch's generator exactly as DeepSpeed's do, so a seeded run routes identically:
use_rts (Random Token Selection: a uniform rand of shape [S, E] ranks which over-capacity tokens
stay), noisy_gate_policy "Jitter" (input × U(0.99, 1.01), training only) and "RSample" (Gumbel
noise on the logits picks top-1), top2_2nd_expert_sampling (Gumbel noise on the logits picks the
second expert). sparse_routes=True (MOELayer's) returns per-route indices/locations/gates
([k, S], a dropped route's index -1); False returns the dense combine_weights [S, E, C] and its
bool dispatch mask. use_tutel=True in a gate call is refused (DeepSpeed would call Tutel's fused
cumsum, which is not installed here; MoE(use_tutel=True) warns and proceeds without, as DeepSpeed does).
Cost: O(S·E) per gate, plus O(S·E·C) for the dense form; drop_tokens=False adds one 8-byte
all-reduce (MAX) over the expert-parallel group when it spans more than one rank.
"""
from __future__ import annotations

import contextlib
import time

import torch
import torch.nn.functional as F

from zero_from_scratch.as_deepspeed import expert_groups as groups


def _dist():
    return groups._dist()


def multiplicative_jitter(x, device, epsilon=1e-2):
    """x × U(1-ε, 1+ε), the uniform drawn by torch.distributions as DeepSpeed draws it."""
    if epsilon == 0:
        return x
    u = torch.distributions.uniform.Uniform(torch.tensor(1.0 - epsilon, device=device),
                                            torch.tensor(1.0 + epsilon, device=device))
    return x * u.rsample(x.shape)


def gumbel_rsample(shape, device):
    return torch.distributions.gumbel.Gumbel(torch.tensor(0.0, device=device),
                                             torch.tensor(1.0, device=device)).rsample(shape)


def _uniform01(shape, device):
    return torch.distributions.uniform.Uniform(torch.tensor(0.0, device=device),
                                               torch.tensor(1.0, device=device)).rsample(shape)


def _capacity(gates, capacity_factor, min_capacity):
    num_tokens, num_experts = gates.shape
    capacity = torch.ceil((num_tokens / num_experts) * capacity_factor).to(torch.int64)
    return torch.maximum(capacity, min_capacity.to(torch.int64))


def _no_drop_capacity(exp_counts, ep_group):
    """drop_tokens=False: the largest expert count, MAX over the expert-parallel group (tp = 1: ringzero
    serves MoE without an mpu, so DeepSpeed's round-up to a multiple of the tensor-parallel size is ×1)."""
    cap = torch.max(exp_counts).to(exp_counts.device)
    if ep_group is not None and _dist().get_world_size(group=ep_group) > 1:
        _dist().all_reduce(cap, op=_dist().ReduceOp.MAX, group=ep_group)
    return torch.ceil(cap / 1).mul(1).to(cap.dtype)


def _combine(gates_list, locations_list, capacity):
    """Dense form: combine_weights[s, e, c] = gate of token s at slot c of expert e."""
    combine = sum(torch.einsum("se,sc->sec", g, F.one_hot(loc, num_classes=capacity).float())
                  for g, loc in zip(gates_list, locations_list))
    return combine, combine.bool()


def top1gating(logits, capacity_factor, min_capacity, used_token=None, noisy_gate_policy=None, drop_tokens=True,
               use_rts=True, ep_group=None, sparse_routes=False, use_tutel=False):
    _no_tutel(use_tutel)
    if noisy_gate_policy == "RSample":
        noisy = logits + gumbel_rsample(logits.shape, device=logits.device)
    gates = F.softmax(logits, dim=1)
    capacity = _capacity(gates, torch.tensor(capacity_factor), torch.tensor(min_capacity))
    indices1_s = torch.argmax(noisy if noisy_gate_policy == "RSample" else gates, dim=1)
    num_experts = int(gates.shape[1])
    mask1 = F.one_hot(indices1_s, num_classes=num_experts)
    if used_token is not None:
        mask1 = torch.einsum("s,se->se", used_token, mask1)
    exp_counts = torch.sum(mask1, dim=0).detach().to(logits.device)
    if not drop_tokens:
        capacity = min(_no_drop_capacity(exp_counts, ep_group), torch.tensor(mask1.size(0)).to(logits.device))
    l_aux = torch.sum(torch.mean(gates, dim=0) * torch.mean(mask1.float(), dim=0)) * num_experts
    mask1_rand = mask1 * _uniform01(mask1.shape, logits.device) if use_rts else mask1
    assert logits.shape[0] >= min_capacity, ("No. of tokens (batch-size) should be greater than min_capacity. "
                                             "Either set min_capacity to 0 or increase your batch size.")
    top_idx = torch.topk(mask1_rand, k=min(capacity, torch.tensor(mask1.size(0)).to(capacity.device)), dim=0)[1]
    mask1 = mask1 * torch.zeros_like(mask1).scatter_(0, top_idx, 1)     # over capacity: dropped
    locations1_s = torch.sum((torch.cumsum(mask1, dim=0) - 1) * mask1, dim=1)
    if sparse_routes:
        indices1_s = torch.min(indices1_s, mask1.sum(dim=1) * num_experts - 1)     # dropped: -1
        return (l_aux, capacity, num_experts, indices1_s.to(torch.int32).unsqueeze(0),
                locations1_s.to(torch.int32).unsqueeze(0), (gates * mask1).sum(dim=1).unsqueeze(0), exp_counts)
    combine, dispatch = _combine([gates * mask1.float()], [locations1_s], capacity)
    return l_aux, combine, dispatch, exp_counts


def top2gating(logits, capacity_factor, min_capacity, drop_tokens=True, ep_group=None, top2_2nd_expert_sampling=True,
               sparse_routes=False):
    gates = F.softmax(logits, dim=1)
    indices1_s = torch.argmax(gates, dim=1)
    num_experts = int(gates.shape[1])
    mask1 = F.one_hot(indices1_s, num_classes=num_experts)
    if top2_2nd_expert_sampling:
        logits += gumbel_rsample(logits.shape, device=logits.device)      # in place, as DeepSpeed's
    indices2_s = torch.argmax(logits.masked_fill(mask1.bool(), float("-inf")), dim=1)
    mask2 = F.one_hot(indices2_s, num_classes=num_experts)
    locations1 = torch.cumsum(mask1, dim=0) - 1
    locations2 = torch.cumsum(mask2, dim=0) - 1 + torch.sum(mask1, dim=0, keepdim=True)
    l_aux = torch.mean(torch.mean(gates, dim=0) * torch.mean(mask1.float(), dim=0)) * num_experts * num_experts
    exp_counts = torch.sum(mask1 + mask2, dim=0).detach().to(logits.device)
    if drop_tokens:
        capacity = _capacity(gates, torch.tensor(capacity_factor * 2), torch.tensor(min_capacity))
        mask1 *= torch.lt(locations1, capacity)
        mask2 *= torch.lt(locations2, capacity)
    else:
        capacity = _no_drop_capacity(exp_counts, ep_group)
    locations1_s = torch.sum(locations1 * mask1, dim=1)
    locations2_s = torch.sum(locations2 * mask2, dim=1)
    gates1_s = torch.einsum("se,se->s", gates, mask1.float())
    gates2_s = torch.einsum("se,se->s", gates, mask2.float())
    denom_s = torch.clamp(gates1_s + gates2_s, min=torch.finfo(gates1_s.dtype).eps)
    gates1_s /= denom_s
    gates2_s /= denom_s
    if sparse_routes:
        indices1_s = torch.where(mask1.any(dim=1), indices1_s, torch.full_like(indices1_s, -1))
        indices2_s = torch.where(mask2.any(dim=1), indices2_s, torch.full_like(indices2_s, -1))
        return (l_aux, capacity, num_experts, torch.stack([indices1_s, indices2_s]).to(torch.int32),
                torch.stack([locations1_s, locations2_s]).to(torch.int32), torch.stack([gates1_s, gates2_s]),
                exp_counts)
    combine, dispatch = _combine([torch.einsum("s,se->se", gates1_s, mask1.float()),
                                  torch.einsum("s,se->se", gates2_s, mask2.float())],
                                 [locations1_s, locations2_s], capacity)
    return l_aux, combine, dispatch, exp_counts


def topkgating(logits, k, capacity_factor, min_capacity, drop_tokens=True, ep_group=None, drop_policy="probs",
               sparse_routes=False):
    gates = F.softmax(logits, dim=1)
    num_experts = int(gates.shape[1])
    top_gate, top_idx = torch.topk(gates, k=k, dim=1)
    mask = torch.zeros_like(gates, dtype=torch.bool).scatter_(1, top_idx, 1)
    exp_counts = torch.sum(mask, dim=0).detach().to(logits.device)
    l_aux = torch.mean(torch.mean(gates, dim=0) * torch.mean(mask.float(), dim=0)) * num_experts * num_experts / k
    if not drop_tokens:
        capacity = _no_drop_capacity(exp_counts, ep_group)
        locations = torch.cumsum(mask, dim=0) - 1
    else:
        capacity = _capacity(gates, torch.tensor(capacity_factor * k), torch.tensor(min_capacity))
        if drop_policy == "probs":       # keep the C most confident tokens of each expert
            masked = torch.zeros_like(gates).scatter(1, top_idx, top_gate)
            keep = torch.topk(masked, k=min(capacity, torch.tensor(gates.size(0)).to(capacity.device)), dim=0,
                              sorted=False)[1]
            mask &= torch.zeros_like(gates, dtype=torch.bool).scatter_(0, keep, True)
            locations = torch.cumsum(mask, dim=0) - 1
        elif drop_policy == "position":  # keep the first C tokens of each expert
            locations = torch.cumsum(mask, dim=0) - 1
            mask *= torch.lt(locations, capacity)
        else:
            raise ValueError(f"Invalid drop_policy: {drop_policy}")
    gates_masked = gates * mask
    gates_masked = gates_masked / torch.clamp(torch.sum(gates_masked, dim=-1, keepdim=True),
                                              min=torch.finfo(gates_masked.dtype).eps)
    if sparse_routes:
        kept = mask.gather(1, top_idx)
        return (l_aux, capacity, num_experts,
                torch.where(kept, top_idx, torch.full_like(top_idx, -1)).t().contiguous().to(torch.int32),
                (locations.gather(1, top_idx) * kept).t().contiguous().to(torch.int32),
                gates_masked.gather(1, top_idx).t().contiguous(), exp_counts)
    combine = torch.einsum("se,sec->sec", gates_masked, F.one_hot(locations * mask, num_classes=capacity).float())
    return l_aux, combine, combine.bool(), exp_counts


def _no_tutel(use_tutel) -> None:
    if use_tutel:
        raise NotImplementedError("top1gating/TopKGate use_tutel=True is refused by ringzero: DeepSpeed would call "
                                  "Tutel's fused cumsum (tutel is not installed here); pass use_tutel=False")


class TopKGate(torch.nn.Module):
    """The gate: wg (model_dim → num_experts, no bias) and the routing rule above."""

    def __init__(self, model_dim, num_experts, k=1, capacity_factor=1.0, eval_capacity_factor=1.0, min_capacity=8,
                 noisy_gate_policy=None, drop_tokens=True, use_rts=True, ep_group=None, top2_2nd_expert_sampling=True):
        super().__init__()
        self.wg = torch.nn.Linear(model_dim, num_experts, bias=False)
        self.ep_group, self.k = ep_group, k
        self.capacity_factor, self.eval_capacity_factor, self.min_capacity = capacity_factor, eval_capacity_factor, min_capacity
        self.noisy_gate_policy, self.drop_tokens, self.use_rts = noisy_gate_policy, drop_tokens, use_rts
        self.top2_2nd_expert_sampling = top2_2nd_expert_sampling
        self.wall_clock_breakdown, self.gate_time = False, 0.0

    def _set_ep_group(self, ep_group):
        assert self.ep_group is None, "Attempting to override an existing ep_group"
        self.ep_group = ep_group

    def forward(self, input, used_token=None, sparse_routes=False, use_tutel=False):
        with timed(self, "gate_time"):
            return self._gate(input, used_token, sparse_routes, use_tutel)

    def _gate(self, input, used_token, sparse_routes, use_tutel):
        _no_tutel(use_tutel)
        x = input.float()
        if self.noisy_gate_policy == "Jitter" and self.training:
            x = multiplicative_jitter(x, device=input.device)
        logits = F.linear(x, weight=self.wg.weight.float(), bias=None)
        factor = self.capacity_factor if self.training else self.eval_capacity_factor
        if self.k == 1:
            return top1gating(logits, factor, self.min_capacity, used_token,
                              self.noisy_gate_policy if self.training else None, self.drop_tokens, self.use_rts,
                              self.ep_group, sparse_routes)
        if self.k == 2:
            return top2gating(logits, factor, self.min_capacity, self.drop_tokens, self.ep_group,
                              self.top2_2nd_expert_sampling, sparse_routes)
        return topkgating(logits, self.k, factor, self.min_capacity, self.drop_tokens, self.ep_group,
                          sparse_routes=sparse_routes)


@contextlib.contextmanager
def timed(module, attr: str):
    """With module.wall_clock_breakdown (the engine sets it, as DeepSpeed's): the block's ms added to `attr`;
    cumulative, as DeepSpeed's timers read with elapsed(reset=False) and never reset."""
    t = time.perf_counter()
    try:
        yield
    finally:
        if module.wall_clock_breakdown:
            setattr(module, attr, getattr(module, attr) + (time.perf_counter() - t) * 1000)
