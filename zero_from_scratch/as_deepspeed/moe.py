"""deepspeed.moe.layer.MoE, sharded_moe.MOELayer and experts.Experts (DeepSpeed 0.19.8), under the runner.

    from deepspeed.moe.layer import MoE                 (python -m zero_from_scratch.as_deepspeed SCRIPT)
    self.moe = MoE(hidden_size=16, expert=nn.Linear(16, 16), num_experts=4, ep_size=1, k=1)
    out, l_aux, exp_counts = self.moe(x)      # deepspeed.initialize creates the "ep_size_E" groups

A mixture-of-experts layer (GShard, arXiv 2006.16668): the gate (moe_gating.py) sends each of the S
tokens to k of E experts, at most C per expert; the dispatched tokens, an [E, C, M] buffer, go
through the experts and come back weighted by their gate values. Experts holds E/ep_size deep copies
of `expert` (this rank's local experts), their parameters marked `allreduce = False` and
`group_name = "ep_size_E"`: the engine reduces their gradients over the expert-data-parallel group
(engine/moe_params.py, moe_grads.py). With ep_size > 1 the [E, C, M] buffer is exchanged by an all-to-all over the
expert-parallel group (the textbook's, primitives/all_to_all.py, through deepspeed.comm's
all_to_all_single, as DeepSpeed calls it): rank r receives, from each of the ep_size ranks, the
tokens routed to its own experts; a second all-to-all returns the outputs (backward: the same two,
reversed). use_residual (Residual MoE, arXiv 2201.05596): out·coef₀ + mlp(x)·coef₁ with coef =
softmax(Linear(hidden, 2)(x)). use_tutel: tutel is not installed, so DeepSpeed warns and goes on
without it; so does this. enable_expert_tensor_parallelism acts only with an mpu, which the engine
refuses with MoE. The gate, its capacity and random draws: moe_gating.py.
Cost per layer and micro-batch: the gate O(S·E·M); with ep_size > 1, two all-to-alls of E·C·M
elements forward (each rank sends (ep-1)/ep of them) and two backward.
"""
from __future__ import annotations

import copy

import torch
import torch.nn.functional as F
from torch import nn

from zero_from_scratch.as_deepspeed import expert_groups as groups
from zero_from_scratch.as_deepspeed.moe_gating import TopKGate, timed
from zero_from_scratch.as_deepspeed.utils import log_dist, logger


class _AllToAll(torch.autograd.Function):
    """Rows of dim 0 split evenly over the group's ranks, block p to rank p; its gradient, the same
    exchange of the output's gradient."""

    @staticmethod
    def forward(ctx, group, input):
        ctx.group = group
        input = input.contiguous()
        output = torch.empty_like(input)
        groups._dist().all_to_all_single(output, input, group=group)
        return output

    @staticmethod
    def backward(ctx, *grad_output):
        return None, _AllToAll.apply(ctx.group, *grad_output)


def _route_slots(indices, locations, num_experts, capacity):
    """Each (route, token)'s flat slot e·C + c in the [E·C] buffer; a dropped route (index -1) the extra last slot."""
    flat = indices.long() * capacity + locations.long()
    return torch.where(indices >= 0, flat, torch.full_like(flat, num_experts * capacity))


def _sparse_encode(x, slots, num_experts, capacity):
    """The [E, C, M] buffer: the token of each filled slot, zeros elsewhere (one gather)."""
    num_tokens, d_model = x.shape
    source = torch.full((num_experts * capacity + 1,), num_tokens, dtype=torch.long, device=slots.device)
    source.scatter_(0, slots.reshape(-1), torch.arange(num_tokens, device=slots.device).expand_as(slots).reshape(-1))
    padded = torch.cat([x, x.new_zeros(1, d_model)])            # row S: the zero row of empty slots
    return padded.index_select(0, source[:-1]).view(num_experts, capacity, d_model)


def _sparse_decode(expert_output, slots, gates, num_tokens):
    """Σ over a token's routes of gate × its expert's output row (a dropped route reads the zero row)."""
    d_model = expert_output.size(-1)
    padded = torch.cat([expert_output, expert_output.new_zeros(1, d_model)])
    routed = padded.index_select(0, slots.reshape(-1)).view(slots.size(0), num_tokens, d_model)
    return (routed * gates.unsqueeze(-1)).sum(0).to(expert_output.dtype)


class Experts(nn.Module):
    def __init__(self, expert, num_local_experts=1, expert_group_name=None):
        super().__init__()
        self.deepspeed_experts = nn.ModuleList([copy.deepcopy(expert) for _ in range(num_local_experts)])
        self.num_local_experts = num_local_experts
        for e in self.deepspeed_experts:
            for p in e.parameters():
                p.allreduce, p.group_name = False, expert_group_name

    def forward(self, inputs):
        outs = []
        for chunk, expert in zip(inputs.chunk(self.num_local_experts, dim=1), self.deepspeed_experts):
            out = expert(chunk)
            outs.append(out[0] if isinstance(out, tuple) else out)     # a (output, bias) expert: output
        return torch.cat(outs, dim=1)


class MOELayer(nn.Module):
    def __init__(self, gate, experts, ep_group_name, ep_size, num_local_experts, use_tutel=False):
        super().__init__()
        self.gate, self.experts = gate, experts
        self.ep_group, self.ep_size, self.ep_group_name = None, ep_size, ep_group_name
        self.num_local_experts = num_local_experts
        self.time_falltoall = self.time_salltoall = self.time_moe = 0.0
        self.wall_clock_breakdown = False
        self.use_tutel = False
        if use_tutel:
            logger.warning("Tutel optimization requested but not installed. Proceeding without Tutel.")

    def _set_ep_group(self, ep_group):
        self.ep_group = ep_group
        self.gate._set_ep_group(ep_group)

    def forward(self, *input, **kwargs):
        with timed(self, "time_moe"):
            return self._forward(*input)

    def _forward(self, *input):
        d_model = input[0].shape[-1]
        x = input[0].reshape(-1, d_model)
        self.l_aux, C, E, indices, locations, gates, self.exp_counts = self.gate(x, input[1], True, self.use_tutel)
        S, M, C = x.size(0), x.size(1), int(C)
        slots = _route_slots(indices, locations, E, C)
        dispatched = _sparse_encode(x, slots, E, C)
        with timed(self, "time_falltoall"):
            dispatched = _AllToAll.apply(self.ep_group, dispatched) if self.ep_size > 1 else dispatched.contiguous()
        dispatched = dispatched.reshape(self.ep_size, self.num_local_experts, -1, d_model)
        out = self.experts(dispatched).reshape(self.ep_size * self.num_local_experts, -1, d_model)
        with timed(self, "time_salltoall"):
            out = _AllToAll.apply(self.ep_group, out) if self.ep_size > 1 else out.contiguous()
        return _sparse_decode(out.view(E * C, M), slots, gates, S).reshape(input[0].shape)


class MoE(nn.Module):
    is_deepspeed_moe = True        # what engine/moe_params.py recognises (DeepSpeed: isinstance(module, MoE))

    def __init__(self, hidden_size, expert, num_experts=1, ep_size=1, k=1, capacity_factor=1.0,
                 eval_capacity_factor=1.0, min_capacity=4, use_residual=False, noisy_gate_policy=None,
                 drop_tokens=True, use_rts=True, use_tutel=False, enable_expert_tensor_parallelism=False,
                 top2_2nd_expert_sampling=True):
        super().__init__()
        self.use_residual = use_residual
        self.enable_expert_tensor_parallelism = enable_expert_tensor_parallelism
        assert num_experts % ep_size == 0, \
            f"Number of experts ({num_experts}) should be divisible by expert parallel size ({ep_size})"
        self.ep_size, self.expert_group_name = ep_size, f"ep_size_{ep_size}"
        self.num_experts, self.num_local_experts = num_experts, num_experts // ep_size
        log_dist(f"Creating MoE layer with num_experts: {num_experts} | num_local_experts: {self.num_local_experts} "
                 f"| expert_parallel_size: {self.ep_size}", [0])
        assert noisy_gate_policy is None or noisy_gate_policy in ["None", "Jitter", "RSample"], \
            "Unsupported noisy_gate_policy: " + noisy_gate_policy
        experts = Experts(expert, self.num_local_experts, self.expert_group_name)
        gate = TopKGate(hidden_size, num_experts, k, capacity_factor, eval_capacity_factor, min_capacity,
                        noisy_gate_policy, drop_tokens, use_rts, None, top2_2nd_expert_sampling)
        self.deepspeed_moe = MOELayer(gate, experts, self.expert_group_name, self.ep_size, self.num_local_experts,
                                      use_tutel=use_tutel)
        if self.use_residual:
            self.mlp = expert
            self.coefficient = nn.Linear(hidden_size, 2)

    def set_deepspeed_parallelism(self, use_data_before_expert_parallel_=False):
        self._create_process_groups(use_data_before_expert_parallel_=use_data_before_expert_parallel_)

    def _create_process_groups(self, use_data_before_expert_parallel_=False):
        if self.expert_group_name not in groups._get_expert_parallel_group_dict():
            print(f"No existing process group found, creating a new group named: {self.expert_group_name}")
            groups._create_expert_and_data_parallel(self.ep_size,
                                                    use_data_before_expert_parallel_=use_data_before_expert_parallel_)
        self.deepspeed_moe._set_ep_group(groups._get_expert_parallel_group(self.expert_group_name))
        # the engine reduces the experts' gradients over it (engine/moe_params.py; DeepSpeed reads its groups module)
        self.expert_data_parallel_group = groups._get_expert_data_parallel_group(self.expert_group_name)

    def forward(self, hidden_states, used_token=None):
        output = self.deepspeed_moe(hidden_states, used_token)
        if self.use_residual:
            mlp = self.mlp(hidden_states)
            mlp = mlp[0] if isinstance(mlp, tuple) else mlp
            coef = F.softmax(self.coefficient(hidden_states), dim=-1)
            output = output * coef[..., 0:1] + mlp * coef[..., 1:]
        return output, self.deepspeed_moe.l_aux, self.deepspeed_moe.exp_counts
